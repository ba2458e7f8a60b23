"""A new run's id and its claim on it: name the run, refuse an id that already has files
in storage, mark the id as taken before any role starts, and write the resolved config.

Both training flows (flows/train.py, flows/train_sync.py) start a new run this way;
`sluice train --resume` continues a claimed one.
"""

from __future__ import annotations

import secrets
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from sluice.infra.config.run import RunConfig
from sluice.infra.secrets import write_private_json
from sluice.infra.storage import exists
from sluice.tasks.run.paths import filesystem, read_json, run_paths, write_json

RUN_CLAIM = "run.json"
"""Control-dir document a new run writes to take its id."""
CLAIM_SETTLE_S = 0.5
"""How long a new run waits before reading its claim back."""


def flow_run_name() -> str:
    """The Prefect flow run's name: the Sluice run id it was called with (so the Prefect
    UI, the MLflow run and the run's folder share one name), else the config's name
    and the time, where the flow picks the id itself."""
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    if parameters.get("run_id"):
        return str(parameters["run_id"])
    config = parameters.get("config")
    name = config.get("name") if isinstance(config, dict) else getattr(config, "name", None)
    return f"{name or 'sluice'}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"


class RunIdTaken(RuntimeError):
    """A new run was asked for under a run id that already has files in storage."""


def new_run_id(config: RunConfig) -> str:
    """`{name}-{UTC start}-{4 hex}`: two runs of one name started in the same second
    still get two ids."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{config.name}-{stamp}-{secrets.token_hex(2)}"


def claim_new_run(config: RunConfig, run_id: str) -> None:
    """Refuse to start a new run whose id already has files in storage (another run's,
    or an earlier one that `--resume` continues), so two runs never write into each
    other; then mark the id as taken by this run before any role starts.

    Of two flows that claim the same id at the same moment, the claim read back last
    wins and the other is refused, as with the trainer lease (infra/lease.py).
    """
    paths = run_paths(config, run_id)
    fs, prefix = filesystem(config, paths.prefix)
    if exists(fs, prefix):
        raise RunIdTaken(
            f"run id '{run_id}' already has files under {paths.prefix}; start a new run "
            f"under another id, or continue that one with --resume {run_id}"
        )
    claim = {"claimed_by": uuid.uuid4().hex, "at": time.time()}
    write_json(config, f"{paths.control}/{RUN_CLAIM}", claim)
    time.sleep(CLAIM_SETTLE_S)
    if read_json(config, f"{paths.control}/{RUN_CLAIM}") != claim:
        raise RunIdTaken(f"run id '{run_id}' was claimed by another run starting at the same time")


def write_resolved_config(config: RunConfig, run_id: str) -> Path:
    """The config each role reads: real values, credentials included, so 0600."""
    path = Path(config.workdir) / "runs" / run_id / "config.json"
    return write_private_json(path, config.model_dump(mode="json"))
