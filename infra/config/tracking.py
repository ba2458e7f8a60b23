"""The `tracking` section: where MLflow lives and the names Sluice's versions get there.

Two kinds of registered model (MLflow's named, versioned models):

- each run keeps its own, ``{registered_model}-{run}``: one model version per committed
  policy version, and `alias` on the newest (the forward-only pointer the rollout side
  polls to reload weights);
- a *model line* is a long-lived registered model that people promote chosen versions
  of many runs into (``sluice promote``, or `promote_final_to` when a run ends), with
  aliases such as ``champion`` that serving code loads as ``models:/NAME@ALIAS``.

Pure: parsing a promotion target imports no MLflow, so the config still fails in
milliseconds (infra/config/run.py).
"""

from __future__ import annotations

import re
import shlex
from typing import NamedTuple

from pydantic import Field, field_validator

from sluice.infra.config.section import Section
from sluice.infra.secrets import redact_uri

DEFAULT_ALIAS = "newest"
"""The run's alias on its newest committed version; MLflow accepts it as typed, so
``models:/<run model>@newest`` works (``latest`` is reserved by MLflow)."""
MLFLOW_RESERVED_ALIAS = re.compile(r"^(latest|v\d+)$", re.IGNORECASE)
"""Alias names MLflow refuses: ``latest`` (``models:/NAME/latest`` is the highest version
number) and ``v<digits>`` (version references)."""
_ALIAS = re.compile(r"^[\w-]{1,255}$")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$")


class PromotionTarget(NamedTuple):
    """Where a promoted version goes: a registered model, and an alias to set on it."""

    model: str
    alias: str | None

    def __str__(self) -> str:
        return self.model if self.alias is None else f"{self.model}@{self.alias}"


def parse_target(text: str) -> PromotionTarget:
    """``NAME`` or ``NAME@ALIAS`` -> PromotionTarget; ValueError (one line) otherwise.

    NAME: letters, digits, '_', '.', '-' (no '/', ':' or quotes, which MLflow or a
    ``models:/`` URI would misread). ALIAS: letters, digits, '_', '-', and not one MLflow
    reserves, so ``models:/NAME@ALIAS`` resolves exactly as typed.
    """
    name, at, alias = str(text).strip().partition("@")
    if not _MODEL_NAME.match(name):
        raise ValueError(
            f"model name {name!r} in {text!r} must be 1-200 letters, digits, '_', '.' or '-' "
            "(write NAME or NAME@ALIAS)"
        )
    if not at:
        return PromotionTarget(name, None)
    if not _ALIAS.match(alias):
        raise ValueError(f"alias {alias!r} in {text!r} must be letters, digits, '_' or '-'")
    if MLFLOW_RESERVED_ALIAS.match(alias):
        raise ValueError(
            f"alias {alias!r} is reserved by MLflow ('latest' and 'v<N>' name versions); "
            "choose another, e.g. champion"
        )
    return PromotionTarget(name, alias)


class TrackingConfig(Section):
    """MLflow: metrics, config and the checkpoint registry."""

    uri: str = "sqlite:///.sluice/mlflow.db"
    """MLflow tracking URI (sqlite file by default, or http://host:5000)."""
    artifact_location: str | None = ".sluice/mlartifacts"
    """Artifact root for a new experiment (None = server default)."""
    experiment: str = "sluice"
    """MLflow experiment name (tagged as a model-training experiment, so MLflow's UI lists its runs as training runs)."""
    registered_model: str = "sluice-policy"
    """Prefix of each run's own registered model, `{registered_model}-{run id}`: one model version per committed policy version."""
    alias: str = DEFAULT_ALIAS
    """MLflow alias on the newest committed version of the run's registered model
    (`models:/{registered_model}-{run id}@newest`); it only moves forward, and the rollout side
    reloads weights when it moves. MLflow reserves `latest` and `v<N>`: such a name is stored as
    `sluice-<name>`. Runs from before `newest` was the default carry `sluice-latest`, which is read
    while `newest` is absent."""
    system_metrics_interval_s: float = Field(10.0, ge=0, le=3600)
    """Seconds between samples of the training machine's CPU, memory, disk, network and GPU, logged
    to the MLflow run as `system/...` (MLflow's system metrics, infra/system_metrics.py). 10 s costs
    a 2-core machine nothing measurable; 0 = off."""
    promote_final_to: str | None = None
    """Registered model (MLflow's long-lived, versioned model, a "model line") into which the run's
    final committed version is promoted when the run ends: `NAME` adds a model version of NAME
    (created if missing), `NAME@ALIAS` also points MLflow alias ALIAS at it, e.g.
    `sluice-math@candidate`, loadable as `models:/sluice-math@candidate`. None = promote nothing
    (`sluice promote` does it by hand)."""

    @field_validator("promote_final_to")
    @classmethod
    def _target(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        return str(parse_target(value))


def ui_command(tracking_uri: str) -> str:
    """The shell line that shows `tracking_uri`'s runs and registry at http://127.0.0.1:5000.

    A bare ``mlflow ui`` of MLflow 3.17 started 15 processes, 2.4 GB RSS (4 uvicorn workers,
    the job runner and 7 huey consumers for GenAI jobs); with job execution off and one
    worker, 2 (the ``mlflow`` launcher and one uvicorn process), 0.5 GB. An HTTP tracking
    server serves its own UI: its address is returned. The line is shown (terminal,
    Prefect artifacts), so a password in the URI is redacted.
    """
    tracking_uri = redact_uri(tracking_uri)
    if tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}   (the tracking server serves the UI)"
    return (
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui "
        f"--backend-store-uri {shlex.quote(tracking_uri)} --workers 1"
    )
