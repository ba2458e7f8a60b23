"""Where a run lives: its streams, checkpoints, control and status documents, and the
JSON files roles exchange there.

Roles talk only through storage URLs and the tracking URI (docs/design.md §2), so the
only shared state is naming: stream and checkpoint locations under
``{storage.url}/{run}``, a control prefix for the stop marker, and one status document
per role. They live on the same object storage as the streams, so a role on another
machine finds them the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import fsspec

from sluice.infra.config.run import RunConfig
from sluice.infra.storage import open_filesystem, put_atomic

if TYPE_CHECKING:
    from sluice.infra.registry import CheckpointRegistry

ROLES = ("rollout", "reward", "train", "evaluate")
ROLLOUTS, SCORED = "rollouts", "scored"
"""The two trajectory streams: generated groups, then the same groups with rewards."""


@dataclass(frozen=True)
class RunPaths:
    """Every location of one run, derived from the storage root and the run id."""

    root: str
    run: str

    @property
    def prefix(self) -> str:
        return f"{self.root.rstrip('/')}/{self.run}"

    @property
    def checkpoints(self) -> str:
        return f"{self.prefix}/checkpoints"

    def checkpoint(self, policy_version: int) -> str:
        """The published policy: weights, config, tokenizer; what every reader fetches."""
        return f"{self.checkpoints}/v{policy_version:06d}"

    @property
    def trainer_states(self) -> str:
        return f"{self.checkpoints}/trainer_state"

    def trainer_state(self, policy_version: int) -> str:
        """Optimizer, RNG and trainer_state.json of a version: what a resuming trainer
        reads beside the policy (kept for the newest committed version only)."""
        return f"{self.trainer_states}/v{policy_version:06d}"

    def consumed(self, policy_version: int) -> str:
        """The scored shards a version trained on (JSON list; kept for every version)."""
        return f"{self.checkpoints}/consumed/v{policy_version:06d}.json"

    @property
    def control(self) -> str:
        return f"{self.prefix}/_control"

    def status(self, role: str) -> str:
        return f"{self.prefix}/_status/{role}.json"


def run_paths(config: RunConfig, run_id: str) -> RunPaths:
    return RunPaths(root=config.storage.url, run=run_id)


def registered_model_name(config: RunConfig, run_id: str) -> str:
    """One registered model per run, so policy versions of two runs never collide."""
    return f"{config.tracking.registered_model}-{run_id}"


def run_registry(config: RunConfig, run_id: str) -> CheckpointRegistry:
    """The checkpoint registry of one run (its own registered model, the run's alias)."""
    from sluice.infra.registry import (
        CheckpointRegistry,  # MLflow: imported by the roles that need it
    )

    return CheckpointRegistry(
        config.tracking.uri,
        registered_model_name(config, run_id),
        alias=config.tracking.alias,
        storage_options=config.storage.options,
        source_root=run_paths(config, run_id).checkpoints,
    )


def filesystem(config: RunConfig, url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of a run file, opened with the run's storage options."""
    return open_filesystem(url, config.storage.options)


def write_json(config: RunConfig, url: str, payload: dict[str, Any]) -> None:
    """Whole-object write: a reader sees the old document or the new one, never half."""
    fs, path = filesystem(config, url)
    put_atomic(fs, path, json.dumps(payload, default=str).encode())


def read_json(config: RunConfig, url: str) -> dict[str, Any] | None:
    """The JSON document at `url`, None when it is missing or not (yet) valid JSON."""
    fs, path = filesystem(config, url)
    try:
        return json.loads(fs.cat_file(path))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
