"""The `staleness` section (the bound on how far generation may run ahead of training) and
verl's fully-asynchronous modes by name (`mode:`), presets of that bound and of Sluice's
other asynchrony knobs.

verl's fully-async recipe names four ways to run rollout and training apart by three
settings: how many local trainer updates pass between two weight syncs
(`trigger_parameter_sync_step`, K), how many extra samples the rollout may generate
past a sync (`staleness_threshold`, s) and whether a sync interrupts generation in flight
(`partial_rollout`). Its one-step-off recipe is the fifth. In Sluice terms a sync is a
published version (`trainer.publish_every` = K), the samples the rollout may run ahead
are the staleness bound (η, in versions: the rollout may start batch floor(n / B) while
it is at most η past the newest published version), and interrupting is
`rollout.interruptible`:

| mode | verl | η | publish_every | interruptible |
|---|---|---|---|---|
| on_policy | on-policy pipeline: K = 1, s = 0 | 0 | 1 | false |
| one_step_off | one-step-off policy | 1 | 1 | false |
| stream | stream off-policy pipeline: K > 1, s = 0 | K − 1 = 3 | K = 4 | false |
| stale | async stream with stale samples: s > 0, no partial rollout | ⌈(1 + s)K⌉ − 1 = 5 | 4 | false |
| partial | async stream with partial rollout | 5 | 4 | true |

K = 4 and s = 0.5 are the values of verl's own 7B experiments. `stream` lets the rollout
produce the K batches of one sync with one version (η = K − 1); `stale` lets it produce
(1 + s)K per sync; without interruption a sync waits for the requests in flight.

A key set explicitly still wins: with `mode` in a config file, every key of that file
and every `--set`; with `--set mode=...`, every other `--set` (the mode then overrides
what the file says). `describe_mode` is the line a run logs with the values it resolved.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from sluice.infra.config.section import Section


class StalenessConfig(Section):
    """The admission rule floor(n / B) <= i + eta (docs/design.md §1)."""

    max_staleness: int = Field(4, ge=0, le=1000)
    """eta: how many policy versions behind a trained batch may be. 0 = synchronous."""


Mode = Literal["on_policy", "one_step_off", "stream", "stale", "partial"]

MODES: dict[str, dict[str, Any]] = {
    "on_policy": {
        "staleness.max_staleness": 0,
        "trainer.publish_every": 1,
        "rollout.interruptible": False,
    },
    "one_step_off": {
        "staleness.max_staleness": 1,
        "trainer.publish_every": 1,
        "rollout.interruptible": False,
    },
    "stream": {
        "staleness.max_staleness": 3,
        "trainer.publish_every": 4,
        "rollout.interruptible": False,
    },
    "stale": {
        "staleness.max_staleness": 5,
        "trainer.publish_every": 4,
        "rollout.interruptible": False,
    },
    "partial": {
        "staleness.max_staleness": 5,
        "trainer.publish_every": 4,
        "rollout.interruptible": True,
    },
}


def dotted_keys(data: dict[str, Any], prefix: str = "") -> set[str]:
    """Every leaf key of a nested mapping, dotted (`trainer.lr`)."""
    keys = set()
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            keys |= dotted_keys(value, f"{name}.")
        else:
            keys.add(name)
    return keys


def apply_mode(data: dict[str, Any], explicit: set[str] | None = None) -> None:
    """Fill in `data` (a raw config mapping, in place) the keys its `mode` presets,
    except those in `explicit` (default: every key `data` already holds)."""
    mode = data.get("mode")
    if mode is None or mode not in MODES:
        return  # no mode, or a wrong one: validation names it
    given = dotted_keys(data) if explicit is None else explicit
    for key, value in MODES[mode].items():
        if key in given:
            continue
        section, _, name = key.partition(".")
        node = data.setdefault(section, {})
        if isinstance(node, dict):
            node[name] = value


def describe_mode(config: Any) -> str | None:
    """One line: a run config's mode and the values it resolved for the mode's keys,
    each marked where an explicit key overrode the preset (None without a mode)."""
    mode = config.mode
    if mode is None:
        return None

    def shown(value: Any) -> str:
        return str(value).lower() if isinstance(value, bool) else str(value)

    parts = []
    for key, preset in MODES[mode].items():
        section, _, name = key.partition(".")
        value = getattr(getattr(config, section), name)
        note = "" if value == preset else f" (set explicitly; the mode says {shown(preset)})"
        parts.append(f"{key}={shown(value)}{note}")
    return f"mode {mode}: " + ", ".join(parts)
