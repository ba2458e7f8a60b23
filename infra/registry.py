"""The checkpoint registry: policy versions as MLflow model versions, servable and durable.

A policy version is named by (incarnation r, step k) (docs/design.md §2): r rises at
every trainer start, k counts optimizer steps along the lineage. Every "newer than" test
compares the pair (``CommittedVersion.identity``), so a trainer restarted from step 120
after versions up to 124 were served names its next version (r+1, 121), never a second
(r, 121).

``commit`` registers a version: an MLflow model version whose source is its checkpoint
URI (where its durable checkpoint is or will be), tagged with r, k and
``sluice.durable``, and moves the *servable* alias (the configured one, ``newest``) onto
it. The rollout polls ``newest_servable()`` (one indexed lookup) and reloads when it
moves: the gate of reloads under the staleness bound. Once the version's weights,
trainer state and consumed list are committed to storage the durable alias,
``<alias>-durable``, moves onto it (``mark_durable``, or ``commit(durable=True)``).
Whatever fetches bytes from storage reads ``newest_durable()``.

Guarantees:

- No durable version exists for a checkpoint whose manifest is missing or whose files
  are missing or short: verification runs before anything is written to MLflow.
- One (r, k) maps to at most one model version. ``commit`` is idempotent, so a trainer
  that crashed anywhere inside it simply calls it again.
- The aliases never move backwards: committing a version at or below the one the
  servable alias points at is refused (it would mean a stale trainer is still
  publishing). The one exception is a lineage reset (``reset_lineage``): versions newer
  than the newest durable one are marked lost and the servable alias goes back to it.
- The durable alias never points at a version that is not durable, and the servable
  alias never at a lost one.

Departures and choices:

- The run's alias defaults to ``newest`` (``models:/<run model>@newest``). MLflow
  reserves ``latest`` and ``v<digits>``: such a configured alias is stored as
  ``sluice-<alias>`` (``mlflow_alias``). Runs written while the default was ``latest``
  carry ``sluice-latest``; where the configured default is absent the other is read,
  and the next move sets the configured one and removes the other.
- Evaluation results are tags ``sluice.eval.reward`` and ``sluice.eval.pass_at_<k>``.
- ``commit`` checks presence and sizes against the manifest, not every byte's hash
  (that would download a multi-GB checkpoint on S3 once more): truncation is caught
  here, corruption by ``fetch_checkpoint``, which hashes while it downloads.
  ``verify_hashes=True`` restores the full check.
- One writer per registered model is assumed (the run's trainer, under its lease);
  two writers are not serialised beyond the forward-only alias.
- With `source_root` (a run's registry) a version whose source lies elsewhere is never
  read: a writer of the registry cannot make servers load their weights
  (infra/registry_reads.py).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from sluice.infra.checkpoints import canonical_url, verify_checkpoint
from sluice.infra.config.tracking import DEFAULT_ALIAS, MLFLOW_RESERVED_ALIAS
from sluice.infra.failpoints import failpoint
from sluice.infra.policy_version import (
    DURABLE,
    DURABLE_ALIAS_SUFFIX,
    LOST,
    PENDING,
    RESERVED_TAGS,
    SKIPPED,
    TAG_CHECKPOINT_DIGEST,
    TAG_DELETED,
    TAG_DURABLE,
    TAG_INCARNATION,
    TAG_POLICY_VERSION,
    TAG_RUN_ID,
    TAG_TRAINER_STEP,
    CommittedVersion,
    as_committed,
    check_incarnation,
    check_policy_version,
)
from sluice.infra.registry_reads import PAGE_SIZE, list_versions, read_version
from sluice.infra.tracking import get_client

LEGACY_ALIAS = "sluice-latest"
"""The run's alias as stored while the default alias was ``latest`` (MLflow reserves it)."""
_DEFAULT_ALIASES = (DEFAULT_ALIAS, LEGACY_ALIAS)

_ALIAS_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,200}$")


class RegistryError(Exception):
    """A registry operation was refused or failed; the message says which and why."""


class PolicyVersionConflict(RegistryError, ValueError):
    """A commit would move the alias backwards or re-point an already committed version."""


class CheckpointRegistry:
    """Policy versions of one model: forward-only servable and durable aliases."""

    def __init__(
        self,
        tracking_uri: str,
        model_name: str,
        alias: str = DEFAULT_ALIAS,
        *,
        verify_hashes: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        source_root: str | None = None,
    ) -> None:
        """Connect to MLflow at `tracking_uri` and make sure `model_name` is registered.

        `alias`: the newest servable version's (module notes); `verify_hashes`: `commit`
        re-hashes every file; `storage_options`: fsspec options to read manifests;
        `source_root`: the only prefix versions are read from (module notes).
        Raises TrackingUnavailable naming the URI when MLflow cannot be reached.
        """
        if not isinstance(model_name, str) or not model_name or "'" in model_name:
            raise ValueError(f"registered model name must be non-empty, no quotes: {model_name!r}")
        if not isinstance(alias, str) or not _ALIAS_PATTERN.match(alias):
            raise ValueError(
                f"alias {alias!r} must be 1-200 letters, digits, '_' or '-' (an MLflow alias)"
            )
        self.tracking_uri = tracking_uri
        self.model_name = model_name
        self.alias = alias
        self.mlflow_alias = f"sluice-{alias}" if MLFLOW_RESERVED_ALIAS.match(alias) else alias
        self.durable_alias = f"{self.mlflow_alias}{DURABLE_ALIAS_SUFFIX}"
        # A default name is read, while absent, through the other (module notes).
        others = [a for a in _DEFAULT_ALIASES if a != self.mlflow_alias]
        fallback = others if self.mlflow_alias in _DEFAULT_ALIASES else []
        self._alias_reads = (self.mlflow_alias, *fallback)
        self.verify_hashes = verify_hashes
        self.storage_options = dict(storage_options or {})
        self.source_root = source_root
        self._client = get_client(tracking_uri)
        self._ensure_registered_model()

    # ------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _mlflow(self, what: str) -> Iterator[None]:
        try:
            yield
        except MlflowException as exc:
            raise RegistryError(
                f"{what} for model {self.model_name!r} failed at {self.tracking_uri}: {exc.message}"
            ) from exc

    def _ensure_registered_model(self) -> None:
        with self._mlflow("registering the model"):
            try:
                self._client.get_registered_model(self.model_name)
                return
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
            try:
                self._client.create_registered_model(
                    self.model_name,
                    description="Sluice policy: one model version per published policy version.",
                )
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":  # another process won the race
                    raise

    def _find(self, policy_version: int, incarnation: int | None = None) -> list[CommittedVersion]:
        """Versions of step `policy_version` (of `incarnation`, if given), oldest r first."""
        query = f"name = '{self.model_name}' and tags.`{TAG_POLICY_VERSION}` = '{policy_version}'"
        with self._mlflow(f"looking up policy version {policy_version}"):
            found = list(self._client.search_model_versions(query, max_results=PAGE_SIZE))
        versions = [c for c in map(self._read, found) if c is not None]
        if incarnation is not None:
            versions = [c for c in versions if c.incarnation == incarnation]
        return sorted(versions, key=lambda c: (c.incarnation, c.model_version))

    def _set_alias(self, alias: str, committed: CommittedVersion) -> None:
        with self._mlflow(f"moving alias {alias!r}"):
            self._client.set_registered_model_alias(
                self.model_name, alias, str(committed.model_version)
            )

    def _move_alias_forward(self, committed: CommittedVersion) -> None:
        current, read_from = self._aliased()
        if current is not None and current.identity >= committed.identity and not current.lost:
            if read_from == self.mlflow_alias:
                return
            committed = current  # a run from before `newest`: adopt where its alias points
        self._set_alias(self.mlflow_alias, committed)
        if read_from not in (None, self.mlflow_alias):  # set first: a poller finds one
            with self._mlflow(f"moving alias {self.mlflow_alias!r}"):
                self._client.delete_registered_model_alias(self.model_name, read_from)

    def _move_durable_alias_forward(self, committed: CommittedVersion) -> None:
        current = self._read_alias(self.durable_alias)
        if current is None or current.identity < committed.identity:
            self._set_alias(self.durable_alias, committed)

    def _tag(self, committed: CommittedVersion, key: str, value: str) -> None:
        with self._mlflow(f"tagging policy version {committed.name}"):
            self._client.set_model_version_tag(
                self.model_name, str(committed.model_version), key, value
            )

    def _resolve(self, policy_version: int, incarnation: int | None) -> CommittedVersion:
        found = self.get(policy_version, incarnation=incarnation)
        if found is None:
            which = "" if incarnation is None else f" of incarnation {incarnation}"
            raise RegistryError(
                f"policy version {policy_version}{which} of {self.model_name!r} is not committed"
            )
        return found

    # ------------------------------------------------------------ writing

    def commit(
        self,
        policy_version: int,
        checkpoint_uri: str,
        run_id: str | None = None,
        tags: Mapping[str, Any] | None = None,
        *,
        trainer_step: int | None = None,
        incarnation: int = 0,
        durable: bool = True,
        pending: bool = True,
        check_files: bool | None = None,
    ) -> CommittedVersion:
        """Register the checkpoint at `checkpoint_uri` as version (`incarnation`,
        `policy_version`) and make it the newest servable one (and, when `durable`, the
        newest durable one too).

        Order: verify the checkpoint manifest (CheckpointIncomplete, nothing registered);
        return the existing version if this (r, k) was already registered with the same
        checkpoint (a retry; a durable retry of a pending version marks it durable);
        refuse with PolicyVersionConflict if the servable alias already points at this
        or a newer (r, k), or if this (r, k) was registered with a different checkpoint;
        create the model version (source = checkpoint URI, tags sluice.policy_version /
        incarnation / durable / trainer_step / run_id / checkpoint_digest plus `tags`);
        move the aliases. `trainer_step` defaults to `policy_version`.

        A servable version (`durable` False) may have no files on storage yet (its
        weights are in the trainer's sender): its source is where its durable checkpoint
        will land, and nothing is verified unless `check_files` (default: `durable`);
        it is tagged ``pending`` (durability under way), or ``skipped`` if not `pending`.
        """
        policy_version = check_policy_version(policy_version)
        incarnation = check_incarnation(incarnation)
        extra = {str(k): str(v) for k, v in (tags or {}).items()}
        clashing = sorted(RESERVED_TAGS & extra.keys())
        if clashing:
            raise ValueError(f"tags {clashing} are set by the registry itself; rename them")
        source = canonical_url(checkpoint_uri, self.storage_options)
        manifest = (
            verify_checkpoint(checkpoint_uri, self.storage_options, check_hashes=self.verify_hashes)
            if (durable if check_files is None else check_files)
            else None
        )

        existing = self._find(policy_version, incarnation)
        if existing:
            committed = existing[0]
            # Same weights (digest) is a retry, whatever URL they were saved under.
            if committed.checkpoint_digest is not None and manifest is not None:
                differs = committed.checkpoint_digest != manifest.digest
            else:
                differs = committed.checkpoint_uri != source
            if differs:
                raise PolicyVersionConflict(
                    f"policy version {policy_version} is already committed (incarnation "
                    f"{incarnation}) as model version "
                    f"{committed.model_version} of {self.model_name!r} with checkpoint "
                    f"{committed.checkpoint_uri}; refusing to re-point it to {source}"
                )
            if committed.lost:
                raise PolicyVersionConflict(
                    f"policy version {committed.name} of {self.model_name!r} was marked lost "
                    "(a trainer restarted from an older durable version); it cannot be "
                    "published again"
                )
            # A retry after a crash between creating the version and moving the alias.
            self._move_alias_forward(committed)
            if durable:
                return self.mark_durable(policy_version, incarnation=incarnation)
            return committed

        current = self.newest_servable()
        if current is not None and current.identity >= (incarnation, policy_version):
            raise PolicyVersionConflict(
                f"refusing to publish policy version {policy_version} of incarnation "
                f"{incarnation} of {self.model_name!r}: alias {self.alias!r} already points "
                f"at {current.name} (incarnation {current.incarnation}, step "
                f"{current.policy_version}); versions only move forward"
            )
        all_tags = {
            TAG_POLICY_VERSION: str(policy_version),
            TAG_INCARNATION: str(incarnation),
            TAG_DURABLE: DURABLE if durable else PENDING if pending else SKIPPED,
            TAG_TRAINER_STEP: str(policy_version if trainer_step is None else trainer_step),
            TAG_RUN_ID: run_id or "",
            TAG_CHECKPOINT_DIGEST: manifest.digest if manifest is not None else "",
            **extra,
        }
        with self._mlflow(f"creating policy version {policy_version}"):
            # Tags go in with the version in one call: a version never exists untagged, so a
            # retry can always find it by (r, k).
            created = self._client.create_model_version(
                self.model_name,
                source=source,
                run_id=run_id,
                tags=all_tags,
                description=f"Sluice policy version {policy_version} (incarnation {incarnation})",
            )
        made = as_committed(created)
        assert made is not None
        failpoint("registry.before_alias")
        self._move_alias_forward(made)
        if durable:
            self._move_durable_alias_forward(made)
        return made

    def mark_durable(self, policy_version: int, *, incarnation: int = 0) -> CommittedVersion:
        """Tag (r, k) durable and move the durable alias onto it if it is the newest
        durable one. Refused for a lost version (its successor lineage may not hold
        it). Idempotent."""
        committed = self._resolve(check_policy_version(policy_version), incarnation)
        if committed.lost:
            raise PolicyVersionConflict(
                f"policy version {committed.name} of {self.model_name!r} was marked lost; "
                "it cannot become durable"
            )
        if not committed.durable:
            # Its checkpoint must be complete now; a version registered before its files
            # were on storage gets its digest here.
            manifest = verify_checkpoint(
                committed.checkpoint_uri, self.storage_options, check_hashes=self.verify_hashes
            )
            if committed.checkpoint_digest is None:
                self._tag(committed, TAG_CHECKPOINT_DIGEST, manifest.digest)
                committed = committed.model_copy(update={"checkpoint_digest": manifest.digest})
            elif committed.checkpoint_digest != manifest.digest:
                raise PolicyVersionConflict(
                    f"policy version {committed.name} of {self.model_name!r} was served as "
                    f"digest {committed.checkpoint_digest[:12]}, but "
                    f"{committed.checkpoint_uri} holds {manifest.digest[:12]}"
                )
            self._tag(committed, TAG_DURABLE, DURABLE)
            committed = committed.model_copy(
                update={"tags": {**committed.tags, TAG_DURABLE: DURABLE}}
            )
        self._move_durable_alias_forward(committed)
        return committed

    def reset_lineage(self, durable: CommittedVersion) -> list[CommittedVersion]:
        """Start a new incarnation from `durable`, the newest durable version: every
        version after it (all of them not durable) is tagged ``lost``, and the servable
        alias moves back onto `durable` (the one backwards move the aliases make).
        Returns the versions it marked lost (not those lost before), oldest first."""
        if not durable.durable:
            raise ValueError(f"policy version {durable.name} is not durable")
        after = [c for c in self.versions() if c.identity > durable.identity]
        made_durable = [c.name for c in after if c.durable]
        if made_durable:
            raise PolicyVersionConflict(
                f"{', '.join(made_durable)} of {self.model_name!r} are durable and newer "
                f"than {durable.name}: resume from the newest durable version"
            )
        lost = []
        for committed in after:
            if not committed.lost:
                self._tag(committed, TAG_DURABLE, LOST)
                lost.append(committed)
        current, _ = self._aliased()
        if current is None or current.identity != durable.identity:
            self._set_alias(self.mlflow_alias, durable)
        self._move_durable_alias_forward(durable)
        return lost

    def set_tag(
        self, policy_version: int, key: str, value: Any, *, incarnation: int | None = None
    ) -> None:
        """Tag a registered version (e.g. 'sluice.eval.pass_at_1' = 0.41 after
        evaluation); `incarnation` None means step `policy_version` of the surviving
        lineage."""
        policy_version = check_policy_version(policy_version)
        if key in RESERVED_TAGS:
            raise ValueError(f"tag {key!r} is set by the registry itself and cannot be changed")
        self._tag(self._resolve(policy_version, incarnation), key, str(value))

    def mark_deleted(self, policy_version: int, *, incarnation: int | None = None) -> None:
        """Tag `policy_version` deleted (``sluice.deleted``) before its files go: readers
        skip it; the aliases never point at one (retention keeps the newest). Idempotent."""
        committed = self._resolve(check_policy_version(policy_version), incarnation)
        self._tag(committed, TAG_DELETED, "true")

    def aliased_versions(self, committed: list[CommittedVersion] | None = None) -> dict[str, int]:
        """Every alias (Sluice's own too) and the policy version it points at; `committed`
        saves listing the versions again when the caller just did."""
        with self._mlflow("reading aliases"):
            aliases = dict(self._client.get_registered_model(self.model_name).aliases or {})
        listed = self.versions() if committed is None else committed
        by_model_version = {c.model_version: c.policy_version for c in listed}
        return {
            alias: by_model_version[int(mv)]
            for alias, mv in aliases.items()
            if int(mv) in by_model_version
        }

    def sync_alias(self) -> CommittedVersion | None:
        """Repair the aliases a crash left behind (between creating a version and moving
        an alias): the servable one to the newest version not lost, the durable one to
        the newest durable version, which is returned. A starting trainer calls it."""
        committed = self.versions()
        alive = [c for c in committed if not c.lost]
        if not alive:
            return None
        self._move_alias_forward(alive[-1])
        durable = [c for c in committed if c.durable]
        if not durable:
            return None
        self._move_durable_alias_forward(durable[-1])
        return durable[-1]

    # ------------------------------------------------------------ reading

    def newest_servable(self) -> CommittedVersion | None:
        """The version the servable alias points at (what the rollout serves), or None
        before the first commit.

        One indexed lookup of the alias and its version: cheap enough to poll every
        `poll_interval_s` from every rollout worker. With a default alias name, a run
        written under the other default (`sluice-latest`) is read through that name.
        Its bytes may be nowhere but in the trainer's sender: whatever fetches from
        storage reads `newest_durable`.
        """
        return self._aliased()[0]

    def newest_durable(self) -> CommittedVersion | None:
        """The newest durable version (weights, trainer state and consumed list on
        storage), or None before the first. A run from before the durable alias had
        every version durable: its servable alias is read then."""
        found = self._read_alias(self.durable_alias)
        if found is not None:
            return found
        servable = self.newest_servable()
        if servable is None or servable.durable:
            return servable
        durable = [c for c in self.versions() if c.durable]
        return durable[-1] if durable else None

    def _read_alias(self, alias: str) -> CommittedVersion | None:
        try:
            version = self._client.get_model_version_by_alias(self.model_name, alias)
        except MlflowException as exc:
            if exc.error_code in ("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST"):
                return None  # alias not set (yet)
            raise RegistryError(
                f"reading alias {alias!r} of {self.model_name!r} failed at "
                f"{self.tracking_uri}: {exc.message}"
            ) from exc
        return self._read(version, refuse=True)

    def _read(self, version: ModelVersion, refuse: bool = False) -> CommittedVersion | None:
        return read_version(version, self.source_root, self.storage_options, refuse=refuse)

    def _aliased(self) -> tuple[CommittedVersion | None, str | None]:
        """The servable alias's version and the alias read (the configured one, else the
        other default name), or (None, None)."""
        for alias in self._alias_reads:
            found = self._read_alias(alias)
            if found is not None:
                return found, alias
        return None, None

    def get(
        self, policy_version: int, *, incarnation: int | None = None
    ) -> CommittedVersion | None:
        """Step `policy_version` of the surviving lineage (the newest incarnation's, not
        lost), or of `incarnation` when given (lost or not); None if there is none."""
        found = self._find(check_policy_version(policy_version), incarnation)
        if incarnation is None:
            found = [c for c in found if not c.lost]
        return found[-1] if found else None

    def versions(self) -> list[CommittedVersion]:
        """Every registered version, lost ones included, oldest (r, k) first."""
        query = f"name = '{self.model_name}'"
        with self._mlflow("listing versions"):
            return list_versions(
                lambda token: self._client.search_model_versions(
                    query, max_results=PAGE_SIZE, page_token=token
                ),
                self._read,
            )

    def next_incarnation(self) -> int:
        """One more than the highest incarnation any version of this model carries."""
        return 1 + max((c.incarnation for c in self.versions()), default=0)
