"""A run's training metrics as a local file: `metrics.jsonl`, one JSON object a step.

Each line holds what the training step logged to MLflow, the same keys and values (the
finite numbers: `loggable` keeps exactly what `log_metrics` would store), plus `step`
and `time` (Unix seconds, the timestamp MLflow got). Lines are appended as the steps
are logged and each is flushed whole, so `tail -f` and `jq` follow a run while it
goes. The file lives in the run's local folder, `{workdir}/runs/{run}/metrics.jsonl`
beside `logs/`, on the machine of the training role. A resumed run appends to it; a
step retrained after a crash appears again, as it does in MLflow's metric history (the
later line is the one that counts).

Only the training role's per-step metrics go here: evaluations and system metrics
(`system/...`) are in MLflow alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sluice.infra.config.run import RunConfig
from sluice.infra.tracking import log_metrics, loggable

METRICS_FILE = "metrics.jsonl"


def metrics_file(config: RunConfig, run_id: str) -> Path:
    """Where the run's `metrics.jsonl` is: its local folder, beside `logs/`."""
    return Path(config.workdir) / "runs" / run_id / METRICS_FILE


def append_step(path: Path, metrics: Mapping[str, float], step: int, time_s: float) -> None:
    """Append one step's line to `path` (created with its folder if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"step": step, "time": round(time_s, 3), **metrics}, allow_nan=False)
    # One write of a whole line, then close (a flush): a reader never sees half a line
    # from this writer, and a crash loses at most the step it was writing.
    with path.open("a", encoding="utf-8") as out:
        out.write(line + "\n")


def log_step_metrics(
    config: RunConfig, run_id: str, mlflow_run_id: str, metrics: Mapping[str, Any], step: int
) -> int:
    """Log one training step's metrics to MLflow and append them to `metrics.jsonl`, the
    same keys and timestamp in both; returns how many were logged.

    The file line goes first: it is local and cheap, and a tracking server that stopped
    answering (which ends the role) still leaves the step on disk.
    """
    numbers = loggable(metrics)
    now_ms = int(time.time() * 1000)
    append_step(metrics_file(config, run_id), numbers, step, now_ms / 1000)
    return log_metrics(config.tracking.uri, mlflow_run_id, numbers, step=step, timestamp_ms=now_ms)
