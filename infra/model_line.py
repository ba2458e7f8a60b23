"""Model lines: long-lived registered models that chosen versions of runs are promoted into.

Each Sluice run keeps its own registered model (infra/registry.py): one model version
per committed policy version, and a forward-only alias whose moves gate weight reloads.
What is worth keeping goes to a *model line*: one MLflow registered model (say
``sluice-math``) whose versions come from many runs, with aliases people move
(``champion``, ``candidate``), loaded as any registered model is::

    path = mlflow.artifacts.download_artifacts("models:/sluice-math@champion")
    model = AutoModelForCausalLM.from_pretrained(path)

``promote_version`` adds a run's committed version to a line. The new model version's
source is the run's checkpoint (no bytes are copied), and its tags say where it came
from: ``sluice.source_run``, ``sluice.source_policy_version``,
``sluice.source_model_version`` (``models:/<run model>/<n>``) and
``sluice.checkpoint_digest``. They are not the registry's ``sluice.policy_version`` /
``sluice.run_id``, so a line's version is never read as a run's committed policy version.

Guarantees:

- A version whose checkpoint retention deleted, or whose files are missing or short, is
  refused with one line, before anything is registered.
- The run's version is pinned (``sluice.keep``) before the line points at it, so the
  run's retention never deletes files a line serves.
- Promoting the same run version into the same line again returns the model version it
  already has (the alias, if given, still moves to it).
- A line's aliases go wherever the promoter says (promoting an older version is a
  rollback), unlike a run's own alias, which only moves forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from sluice.infra.checkpoints import CheckpointError, verify_checkpoint
from sluice.infra.config.tracking import PromotionTarget
from sluice.infra.policy_version import TAG_CHECKPOINT_DIGEST, TAG_KEEP, CommittedVersion
from sluice.infra.registry import CheckpointRegistry, RegistryError
from sluice.infra.tracking import get_client

TAG_SOURCE_RUN = "sluice.source_run"
"""The Sluice run a line's version was promoted from."""
TAG_SOURCE_POLICY_VERSION = "sluice.source_policy_version"
"""Its policy version in that run."""
TAG_SOURCE_MODEL_VERSION = "sluice.source_model_version"
"""``models:/<run's registered model>/<model version>``: the run's own model version."""
LINE_DESCRIPTION = "Sluice model line: policy versions promoted from runs (`sluice promote`)."


class PromotionError(RegistryError):
    """A version cannot be promoted; the message says which and why, in one line."""


@dataclass(frozen=True)
class PromotedVersion:
    """A run's policy version as a model version of a model line."""

    target: PromotionTarget
    """The line (registered model) and the alias set on the version, if any."""
    model_version: int
    """The version number in the line (MLflow's counter)."""
    source: CommittedVersion
    """The run's committed version it came from."""
    source_run: str
    """The Sluice run id."""
    created: bool
    """False when this run version was already in the line (a repeated promotion)."""

    @property
    def uri(self) -> str:
        """The ``models:/`` URI that loads it: by alias when one was set."""
        name = self.target.model
        return (
            f"models:/{name}@{self.target.alias}"
            if self.target.alias
            else f"models:/{name}/{self.model_version}"
        )


@contextlib.contextmanager
def _mlflow(what: str, tracking_uri: str) -> Iterator[None]:
    try:
        yield
    except MlflowException as exc:
        raise PromotionError(f"{what} failed at {tracking_uri}: {exc.message}") from exc


def _checked_source(
    registry: CheckpointRegistry, version: CommittedVersion, source_run: str
) -> CommittedVersion:
    """`version` pinned through retention, its checkpoint complete; PromotionError if not."""
    where = f"policy version {version.policy_version} of run {source_run!r}"
    gone = (
        f"{where} cannot be promoted: retention deleted its checkpoint (storage.keep_versions); "
        "promote a version that was kept (the newest ones, an aliased or `sluice.keep` one)"
    )
    if version.deleted:
        raise PromotionError(gone)
    if not version.durable:
        raise PromotionError(
            f"{where} cannot be promoted: it is {version.durability}, not durable (its "
            "trainer state and weights are not committed to storage); promote a durable "
            f"version, e.g. the newest, alias {registry.durable_alias!r}"
        )
    registry.set_tag(version.policy_version, TAG_KEEP, "true", incarnation=version.incarnation)
    pinned = registry.get(version.policy_version, incarnation=version.incarnation)
    if pinned is None:
        raise PromotionError(f"{where} is not committed in {registry.tracking_uri}")
    if pinned.deleted:  # retention got there between the first look and the pin
        raise PromotionError(gone)
    try:
        manifest = verify_checkpoint(
            pinned.checkpoint_uri, registry.storage_options, check_hashes=False
        )
    except CheckpointError as exc:
        raise PromotionError(f"{where} cannot be promoted: {exc}") from exc
    if pinned.checkpoint_digest is not None and manifest.digest != pinned.checkpoint_digest:
        raise PromotionError(
            f"{where} cannot be promoted: {pinned.checkpoint_uri} holds other weights than "
            f"were committed (digest {manifest.digest[:12]}, committed "
            f"{pinned.checkpoint_digest[:12]})"
        )
    return pinned


def _ensure_line(registry: CheckpointRegistry, name: str) -> None:
    client = get_client(registry.tracking_uri)
    try:
        client.get_registered_model(name)
        return
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    try:
        client.create_registered_model(name, description=LINE_DESCRIPTION)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":  # another promoter won the race
            raise


def _already_promoted(
    registry: CheckpointRegistry, name: str, source_run: str, policy_version: int
) -> ModelVersion | None:
    query = (
        f"name = '{name}' and tags.`{TAG_SOURCE_RUN}` = '{source_run}' "
        f"and tags.`{TAG_SOURCE_POLICY_VERSION}` = '{policy_version}'"
    )
    found = get_client(registry.tracking_uri).search_model_versions(query, max_results=100)
    return min(found, key=lambda v: int(v.version)) if found else None


def promote_version(
    registry: CheckpointRegistry,
    version: CommittedVersion,
    target: PromotionTarget,
    source_run: str,
) -> PromotedVersion:
    """Add committed `version` of `registry` (the run `source_run`) to the line
    `target.model` (created if missing) and point `target.alias` at it, if given.

    Raises PromotionError (one line, nothing registered) for a deleted or incomplete
    checkpoint, a target that is the run's own registered model, or a failing MLflow.
    """
    if target.model == registry.model_name:
        raise PromotionError(
            f"{target.model!r} is run {source_run!r}'s own registered model (its alias gates "
            "weight reloads); promote into another name"
        )
    source = _checked_source(registry, version, source_run)
    client = get_client(registry.tracking_uri)
    with _mlflow(f"promoting into {target.model!r}", registry.tracking_uri):
        _ensure_line(registry, target.model)
        existing = _already_promoted(registry, target.model, source_run, source.policy_version)
        if existing is None:
            existing = client.create_model_version(
                target.model,
                source=source.checkpoint_uri,
                run_id=source.run_id,
                tags={
                    TAG_SOURCE_RUN: source_run,
                    TAG_SOURCE_POLICY_VERSION: str(source.policy_version),
                    TAG_SOURCE_MODEL_VERSION: f"models:/{registry.model_name}/{source.model_version}",
                    TAG_CHECKPOINT_DIGEST: source.checkpoint_digest or "",
                },
                description=f"Sluice run {source_run}, policy version {source.policy_version}",
            )
            created = True
        else:
            created = False
        if target.alias is not None:
            client.set_registered_model_alias(target.model, target.alias, str(existing.version))
    return PromotedVersion(
        target=target,
        model_version=int(existing.version),
        source=source,
        source_run=source_run,
        created=created,
    )
