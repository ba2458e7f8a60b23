"""The run's trainer failovers (`cluster.engine: ray`): when the node running the
trainer was lost and the flow placed the train role again, and what the rollout side
did meanwhile.

The flow appends one entry per failover to a control document (`FAILOVERS_FILE`) when
it places the trainer again, and fills in the recovery once the new trainer has
trained a step past the one its predecessor reached. The summary reads it, with the
registry: the seconds from the loss to the next committed version.
"""

from __future__ import annotations

import time
from typing import Any

from sluice.infra.config.run import RunConfig
from sluice.tasks.run.control import FAILOVERS_FILE
from sluice.tasks.run.paths import read_json, run_paths, write_json


def _url(config: RunConfig, run_id: str) -> str:
    return f"{run_paths(config, run_id).control}/{FAILOVERS_FILE}"


def read_failovers(config: RunConfig, run_id: str) -> list[dict[str, Any]]:
    """Every trainer failover of the run so far (empty: none)."""
    document = read_json(config, _url(config, run_id)) or {}
    return list(document.get("failovers", []))


def _counts(status: dict[str, Any]) -> dict[str, Any]:
    return {k: status.get(k) for k in ("samples_written", "tokens_generated", "groups_in_flight")}


def record_loss(
    config: RunConfig,
    run_id: str,
    role: str,
    message: str,
    statuses: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """Append a failover of `role` (its node lost: `message`) to the run's record, with
    the trainer's step and the rollout role's counts as last reported (`statuses`)."""
    train = statuses.get("train", {})
    entry = {
        "role": role,
        "lost_at": time.time(),
        "message": message,
        "lost_trainer": [train.get("pid"), train.get("started_at")],
        "step_at_loss": int(train.get("step") or 0),
        "rollout_at_loss": _counts(statuses.get("rollout", {})),
        "recovered_at": None,
    }
    failovers = [*read_failovers(config, run_id), entry]
    write_json(config, _url(config, run_id), {"failovers": failovers})
    return entry


def note_recovery(
    config: RunConfig, run_id: str, pending: dict[str, Any], statuses: dict[str, dict[str, Any]]
) -> bool:
    """Fill in the recovery of failover `pending` once the trainer reporting in
    `statuses` is a new process that has trained past the step the lost one reached;
    whether it did."""
    train = statuses.get("train", {})
    if (
        train.get("pid") is None
        or [train["pid"], train.get("started_at")] == pending["lost_trainer"]
    ):
        return False
    if int(train.get("step") or 0) <= pending["step_at_loss"]:
        return False
    failovers = read_failovers(config, run_id)
    for entry in failovers:
        if entry["lost_at"] == pending["lost_at"]:
            entry["recovered_at"] = time.time()
            entry["step_at_recovery"] = int(train["step"])
            entry["rollout_at_recovery"] = _counts(statuses.get("rollout", {}))
    write_json(config, _url(config, run_id), {"failovers": failovers})
    return True


def failover_summary(
    failovers: list[dict[str, Any]], commit_times_s: list[float]
) -> list[dict[str, Any]]:
    """Per failover: seconds from the loss to the next committed version
    (`commit_times_s`: every version's commit time, epoch seconds; None when none
    followed), to the new trainer's first step past the old one's, and the rollout
    side's samples written meanwhile."""
    rows = []
    for entry in failovers:
        lost = entry["lost_at"]
        later = [t for t in commit_times_s if t > lost]
        before, after = entry.get("rollout_at_loss") or {}, entry.get("rollout_at_recovery") or {}
        generated = None
        if before.get("samples_written") is not None and after.get("samples_written") is not None:
            # None when the rollout role restarted meanwhile (its counts start again)
            generated = after["samples_written"] - before["samples_written"]
            generated = generated if generated >= 0 else None
        recovered = entry.get("recovered_at")
        rows.append(
            {
                "role": entry["role"],
                "to_next_commit_s": min(later) - lost if later else None,
                "to_first_step_s": recovered - lost if recovered else None,
                "samples_generated_meanwhile": generated,
            }
        )
    return rows
