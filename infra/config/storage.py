"""The `storage` section: the fsspec root where a run's streams and checkpoints live,
and how many published versions keep their weights there."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from sluice.infra.config.section import Section


class StorageConfig(Section):
    """Where streams and checkpoints live."""

    url: str = "file://.sluice/runs"
    """fsspec URL root: file://, s3://bucket/prefix, memory:// (tests)."""
    options: dict[str, Any] = {}
    """fsspec storage options (e.g. s3 endpoint_url, key, secret). Credentials here (key, secret,
    token, password, ... and those under client_kwargs) are redacted wherever the config leaves the
    process (MLflow, Prefect parameters, --dry-run, errors) and reach the roles only through 0600
    files; better still, leave them out and give them in the environment (docs/operations.md,
    "Giving credentials")."""
    keep_versions: int | None = Field(3, ge=0)
    """Published policy versions whose weights stay on storage: the newest K (at least 2: the
    rollout side serves one while it fetches the next), plus every version an MLflow alias or a
    `sluice.keep` tag pins and every version the evaluation schedule has yet to score
    (docs/operations.md, "Checkpoints and retention"). Older ones are deleted after each durable
    commit and tagged `sluice.deleted`; the newest two durable versions' trainer states are kept.
    Versions that were only servable (`checkpoint.every_versions`) count among the newest K and go
    the same way. 0 or None = keep every version (at 135M parameters each is ~0.5 GB)."""

    @field_validator("keep_versions")
    @classmethod
    def _keep_two(cls, value: int | None) -> int | None:
        if value == 1:
            raise ValueError(
                "use 2 or more (0 keeps all): the rollout serves one while fetching the next"
            )
        return value
