"""A config's nested dict before validation: read from a YAML file, then changed by
`--set key.sub=value` overrides (a name TRL or verl gives a knob is translated, with one
line on stderr: infra/config/peer_names.py); and the one line a config that fails validation gets."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from sluice.infra.config.peer_names import (
    PeerNameError,
    peer_suggestion,
    resolve_peer_name,
    say_once,
)
from sluice.infra.secrets import REDACTED, redact_text


class ConfigError(ValueError):
    """A config that cannot run, with a one-line message that says how to fix it."""


def parse_value(text: str) -> Any:
    """A `--set` value: YAML scalars/lists/maps (`4`, `true`, `null`, `[a, b]`), else a string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_override(
    data: dict[str, Any], assignment: str, schema: type[BaseModel] | None = None
) -> None:
    """Apply one `key.sub=value` to a nested dict in place. A TRL or verl name
    (`learning_rate=1e-5`) sets its Sluice key and says so on stderr, once per name; one
    whose meaning differs from Sluice's fails with a line saying how."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got '{assignment}'")
    key, _, raw = assignment.partition("=")
    key = key.strip()
    if not key:
        raise ConfigError(f"--set expects key=value, got '{assignment}'")
    value = parse_value(raw)
    try:
        peer = resolve_peer_name(key, value, raw, data, schema)
    except PeerNameError as err:
        raise ConfigError(str(err)) from None
    if peer is None:
        _set(data, key, value)
        return
    for target, translated in peer.assignments:
        _set(data, target, translated)
    say_once(key, peer.notice)


def _set(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"cannot set '{key}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping in the YAML file at `path` (empty for an empty file); ConfigError
    naming the file (and line) for anything that is not one."""
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot be read ({exc.strerror or exc})") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}:{where} is not valid YAML: {exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{source}: top level must be a mapping of config sections")
    return loaded


# Keys that existed under another name: an old key gets an error naming the new one.
RENAMED_KEYS: dict[str, str] = {
    "rollout.eta": "staleness.max_staleness",
    "rollout.max_staleness": "staleness.max_staleness",
    "trainer.batch_size": "trainer.prompts_per_batch",
    "trainer.max_tokens_per_mb": "trainer.max_tokens_per_micro_batch",
    "rollout.n_samples": "rollout.group_size",
    "model.dtype": "rollout.dtype",
    "problem.eval_dataset": "evaluation.dataset",
    "problem.num_eval_prompts": "evaluation.num_prompts",
    "problem.eval_samples": "evaluation.samples",
    "problem.eval_temperature": "evaluation.temperature",
    "problem.eval_greedy": "evaluation.greedy",
    "trainer.eval_every": "evaluation.every",
    "trainer.eval_during_run": "evaluation.during_run",
}

# Keys that are gone, with what to do instead.
REMOVED_KEYS: dict[str, str] = {}


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_valid_keys(ann, dotted + "."))
    return keys


def _closest(key: str, model: type[BaseModel]) -> str:
    if key in RENAMED_KEYS:
        return f"; it was renamed to '{RENAMED_KEYS[key]}'"
    if key in REMOVED_KEYS:
        return f"; {REMOVED_KEYS[key]}"
    peer = peer_suggestion(key)
    if peer:
        return peer
    valid = _valid_keys(model)
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not match:
        leaf = key.rsplit(".", 1)[-1]
        match = [k for k in valid if k.rsplit(".", 1)[-1] == leaf][:1]
    return f"; did you mean '{match[0]}'?" if match else ""


def format_validation_error(err: ValidationError, source: str, model: type[BaseModel]) -> str:
    """One line for the first problem pydantic found: the key and, for an unknown key,
    its new name or the closest valid one."""
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        return f"{source}: unknown config key '{key}'{_closest(key, model)}"
    more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    if not key:  # a rule across sections: its message names the keys itself
        return redact_text(f"{source}: {first['msg'].removeprefix('Value error, ')}{more}")
    value = first.get("input")
    shown = json.dumps(value, default=str) if not isinstance(value, dict) else "{...}"
    if key.startswith("storage.options"):  # may be a credential: never echoed
        shown = REDACTED
    message = f"{source}: invalid value for '{key}' = {shown}: {first['msg']}{more}"
    return redact_text(message)
