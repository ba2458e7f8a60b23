"""How the checkpoint registry reads MLflow model versions: as `CommittedVersion`s, and
only those whose source lies under the run's own checkpoints.

A model version's source is a URL anyone who can write the MLflow registry can set.
Sluice loads whatever a version's source names (weights, a tokenizer, a chat template),
so a registry opened with a `source_root` (the run's checkpoint prefix, as
``tasks/run/paths.run_registry`` opens it) never hands out a version stored anywhere
else: listings leave such a version out, as they leave out versions registered by hand,
and an alias that points at one is refused in one line (``ForeignCheckpoint``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mlflow.entities.model_registry import ModelVersion

from sluice.infra.checkpoints import ForeignCheckpoint, check_source_within
from sluice.infra.policy_version import CommittedVersion, as_committed

PAGE_SIZE = 1000  # far above any run's version count, far below MLflow's 200k page cap


def read_version(
    version: ModelVersion,
    source_root: str | None,
    storage_options: Mapping[str, Any] | None = None,
    *,
    refuse: bool = False,
) -> CommittedVersion | None:
    """`version` as Sluice reads it: None when Sluice did not register it, or when its
    source lies outside `source_root` (with `refuse`, ForeignCheckpoint instead)."""
    committed = as_committed(version)
    if committed is None or source_root is None:
        return committed
    try:
        check_source_within(committed.checkpoint_uri, source_root, storage_options)
    except ForeignCheckpoint:
        if refuse:
            raise
        return None
    return committed


def list_versions(
    search: Callable[[str | None], Any], read: Callable[[ModelVersion], CommittedVersion | None]
) -> list[CommittedVersion]:
    """Every version the paged `search` (a page token -> a page) returns that `read`
    accepts, oldest (r, k) first."""
    out: list[CommittedVersion] = []
    token: str | None = None
    while True:
        page = search(token)
        out.extend(c for c in map(read, page) if c is not None)
        token = page.token
        if not token:
            break
    return sorted(out, key=lambda c: c.identity)
