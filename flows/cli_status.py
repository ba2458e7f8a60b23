"""`sluice status [RUN]`: where a run stands, from another terminal while it goes.

Read from the run's own files only, the status document each role writes
(tasks/run/status.py), the run's stop marker (tasks/run/control.py) and the roles' logs,
so it answers without Prefect or MLflow, in a fraction of a second. What it prints is
what the flow's progress line says (flows/role_watch.py), plus each role's state, where
each role's time went (its states' shares of its wall time, tasks/run/state_timer.py),
the training step's mean timeline from `metrics.jsonl` and, for a role that failed, the
newest line of its log. Before any role reports, it says what the flow is doing (a
supervised pass, a warm start, starting the roles) from the flow's status document.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from sluice.flows.cli_common import fail
from sluice.infra.config.run import RunConfig
from sluice.tasks.run.control import RunControl
from sluice.tasks.run.paths import ROLES, run_paths
from sluice.tasks.run.state_timer import OTHER
from sluice.tasks.run.status import read_flow_status, read_statuses

LIVE_STATES = ("starting", "running", "waiting")
"""States a role writes while its process goes; `stopped` and `finished` are its last."""
FAILED_MARK = "role failed: "
"""How the flow's stop marker names the roles that failed for good (flows/role_watch.py)."""
OTHER_LIMIT = 0.05
"""A role whose unnamed time (`other`) is over this share of its wall gets a note: some
of its loop's time is not accounted for by a state."""
METRICS_FILE = "metrics.jsonl"
"""The training role's per-step file (tasks/run/metrics_file.py, not imported here: it
imports MLflow, which `status` must answer without)."""
TIMELINE_STEPS = 50
"""How many of the newest training steps the mean step timeline averages."""


def process_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def role_log(log_dir: Path, role: str) -> Path | None:
    """The log of the process that writes `role`'s status (the colocated baseline's
    `sync` process writes the `train` document)."""
    for name in (role, "sync") if role == "train" else (role,):
        if (log_dir / f"{name}.log").is_file():
            return log_dir / f"{name}.log"
    return None


def newest_log_line(path: Path, tail_bytes: int = 16384) -> str | None:
    """The last non-empty line of a log, read from its end (logs grow large)."""
    with path.open("rb") as log:
        log.seek(max(0, path.stat().st_size - tail_bytes))
        lines = log.read().decode(errors="replace").splitlines()
    found = [line for line in lines if line.strip()]
    return found[-1].rstrip() if found else None


def role_states(
    statuses: dict[str, dict[str, Any]], done_reason: str | None, same_machine: bool
) -> dict[str, str]:
    """Each role's state: what its document says, `failed` for a role the run's stop
    marker names, `died` for one whose document says it runs but whose process (on this
    machine) is gone."""
    failed = set()
    if done_reason and done_reason.startswith(FAILED_MARK):
        failed = {role.strip() for role in done_reason.removeprefix(FAILED_MARK).split(",")}
    states = {}
    for role in ROLES:
        status = statuses.get(role)
        if role in failed:
            states[role] = "failed"
        elif status is None:
            continue
        elif (
            status.get("state") in LIVE_STATES
            and same_machine
            and isinstance(status.get("pid"), int)
            and not process_alive(status["pid"])
        ):
            states[role] = "died"
        else:
            states[role] = str(status.get("state", "-"))
    return states


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    return f"{seconds / 60:.0f}m ago" if seconds < 7200 else f"{seconds / 3600:.0f}h ago"


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def time_split(status: dict[str, Any]) -> str | None:
    """A role's states as shares of its wall time since it started, largest first and
    `other` last (they sum to 100% up to rounding), then its process CPU in cores; None
    for a document without them."""
    shares = {
        key.removeprefix("time/").removesuffix("_frac"): value
        for key, value in status.items()
        if key.startswith("time/") and key.endswith("_frac") and isinstance(value, int | float)
    }
    if not shares:
        return None
    named = sorted((s for s in shares if s != OTHER), key=lambda s: -shares[s])
    parts = [f"{state} {_pct(shares[state])}" for state in named if shares[state] >= 0.005]
    parts.append(f"{OTHER} {_pct(shares.get(OTHER, 0.0))}")
    wall, cores = status.get("time/wall_s"), status.get("time/cpu_cores")
    line = "  ".join(parts)
    if isinstance(wall, int | float):
        line = f"{_duration(wall)}: {line}"
    if isinstance(cores, int | float):
        line += f"; CPU {cores:.1f} cores"
    if status.get("time/cpu_over_cores"):
        line += " (more CPU than the process has cores: the split is not to be trusted)"
    if shares.get(OTHER, 0.0) > OTHER_LIMIT:
        line += f" ({OTHER} over {_pct(OTHER_LIMIT)}: time no state accounts for)"
    busy, lag = status.get("background/busy_s"), status.get("background/lag_s")
    if isinstance(busy, int | float):
        line += f"; background {busy:.1f} s busy"
        line += f", newest job {lag:.1f} s after its submission" if lag is not None else ""
    return line


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def mean_step_timeline(path: Path, steps: int = TIMELINE_STEPS) -> str | None:
    """The newest `steps` training steps' mean timeline from `metrics.jsonl`: the mean
    step's seconds, then each state's mean seconds. Means (not medians) so the parts add
    up to the whole, as each step's states add up to its `time/step_s`. None without
    timed steps."""
    if not path.is_file():
        return None
    with path.open("rb") as lines:  # the file grows a line a step: read its end
        lines.seek(max(0, path.stat().st_size - steps * 16384))
        tail = lines.read().decode(errors="replace").splitlines()
    timed: dict[int, dict[str, Any]] = {}
    for line in tail:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the first line read may be a partial one
            continue
        if isinstance(record, dict) and "time/step_s" in record:
            timed[int(record.get("step", 0))] = record  # a retrained step: the later line
    newest = [timed[step] for step in sorted(timed)[-steps:]]
    if not newest:
        return None

    def mean(key: str) -> float:
        return sum(float(r.get(key, 0.0)) for r in newest) / len(newest)

    states = sorted(  # largest first, `other` last, as in each role's split
        {k for r in newest for k in r if k.startswith("time/") and k.endswith("_s")}
        - {"time/step_s"},
        key=lambda k: (k == f"time/{OTHER}_s", -mean(k), k),
    )

    parts = [
        f"{key.removeprefix('time/').removesuffix('_s')} {mean(key):.2f}"
        for key in states
        if mean(key) >= 0.005 or key == f"time/{OTHER}_s"
    ]
    return f"{mean('time/step_s'):.2f} s = " + " + ".join(parts) + f" (mean of {len(newest)})"


def format_status(
    run_id: str,
    config: RunConfig,
    statuses: dict[str, dict[str, Any]],
    done: dict[str, Any] | None,
    log_dir: Path,
    now: float | None = None,
    flow: dict[str, Any] | None = None,
) -> str:
    """The run's numbers as a two-column table, then one row per role, where each
    role's time went, then the newest log line of each role that failed. Before any
    role reports, what the flow does (`flow`: its status document)."""
    now = time.time() if now is None else now
    states = role_states(statuses, (done or {}).get("reason"), config.cluster.engine == "local")
    train, rollout = statuses.get("train", {}), statuses.get("rollout", {})
    evaluation = statuses.get("evaluate", {})
    held_out = _fmt(evaluation.get("last_reward"), ".3f")
    if evaluation.get("last_version") is not None:
        held_out += f" at version {evaluation['last_version']}"
    rows = [
        ("run", run_id),
        ("step", f"{train.get('step', 0)}/{config.trainer.total_steps}"),
        ("policy version", str(rollout.get("policy_version", train.get("step", "-")))),
        ("reward", f"{_fmt(train.get('reward_mean'), '.3f')} (training batch mean)"),
        ("held-out reward", held_out),
        ("staleness", f"{_fmt(train.get('staleness_mean'), '.2f')} versions (batch mean)"),
        (
            "tokens/s",
            f"{_fmt(rollout.get('tokens_per_s'), '.0f')} generated, "
            f"{_fmt(train.get('trained_tokens_per_s'), '.0f')} trained",
        ),
        (
            "idle",
            f"trainer {_pct(train.get('idle_ratio'))} (waiting for data), rollout "
            f"{_pct(rollout.get('idle_ratio'))} (held by the staleness gate)",
        ),
    ]
    if "newest_durable_version" in train:  # servable before durable (tasks/train/publisher.py)
        rows.append(
            (
                "versions",
                f"servable {train['newest_servable_version']}, durable "
                f"{train['newest_durable_version']} ({train.get('versions_at_risk', 0)} at "
                f"risk; durability {_fmt(train.get('durability_lag_s'), '.0f')} s behind, "
                f"{train.get('durability_skipped', 0)} skipped)",
            )
        )
    if done is not None:  # the run's stop marker: why it ends
        at = f" ({_ago(now - done['at'])})" if isinstance(done.get("at"), int | float) else ""
        live = any(state in LIVE_STATES for state in states.values())
        rows.append(("stopping" if live else "ended", f"{done.get('reason', '-')}{at}"))
    rows.append(("logs", f"{log_dir}/"))
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    if not states:
        return "\n".join([*lines, "", *before_roles(flow, now)])
    table = [("role", "state", "pid", "updated", "threads", "peak RSS")]
    for role, state in states.items():
        status = statuses.get(role, {})
        updated = status.get("updated_at")
        rss = status.get("peak_rss_mb")
        table.append(
            (
                role,
                state,
                str(status.get("pid", "-")),
                "-" if updated is None else _ago(now - updated),
                str(status.get("threads", "-")),
                "-" if rss is None else f"{rss:.0f} MB",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines.append("")
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table
    ]
    splits = {role: time_split(statuses.get(role, {})) for role in states}
    if any(splits.values()):
        width = max(len(role) for role in states)
        lines += ["", "time since each role started (its states add up to its wall time):"]
        lines += [f"  {role:<{width}}  {split}" for role, split in splits.items() if split]
        step = mean_step_timeline(log_dir.parent / METRICS_FILE)
        if step is not None:
            lines.append(f"  {'step':<{width}}  {step}")
    for role, state in states.items():
        if state not in ("failed", "died"):
            continue
        log = role_log(log_dir, role)
        if log is None:
            lines += ["", f"{role} {state}; it left no log in {log_dir}/"]
            continue
        newest = newest_log_line(log)
        lines += ["", f"{role} {state}; newest line of {log}:", f"  {newest or '(empty)'}"]
    return "\n".join(lines)


def before_roles(flow: dict[str, Any] | None, now: float) -> list[str]:
    """What the run does while no role has reported: the flow's newest progress line."""
    if not flow or not flow.get("activity"):
        return ["no role has reported yet"]
    updated = flow.get("updated_at")
    since = flow.get("started_at")
    when = f" (updated {_ago(now - updated)})" if isinstance(updated, int | float) else ""
    took = f", for {_duration(now - since)}" if isinstance(since, int | float) else ""
    return [
        f"no role has reported yet; the flow is {flow.get('state', 'running')}{took}:",
        f"  {flow['activity']}{when}",
    ]


def run_status(config: RunConfig, run_id: str, run_dir: Path) -> int:
    """Print the status of run `run_id` (its saved `config`, found in `run_dir`); exit 1
    with one line when its storage does not answer."""
    paths = run_paths(config, run_id)
    try:
        statuses = read_statuses(config, paths)
        done = RunControl(config, paths).done_marker()
        flow = read_flow_status(config, paths) if not statuses else None
    except OSError as err:  # the run's storage does not answer
        return fail(f"cannot read the status of run {run_id} under {paths.prefix}: {err}", 1)
    print(format_status(run_id, config, statuses, done, run_dir / "logs", flow=flow))
    return 0
