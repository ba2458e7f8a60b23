"""The checkpoint registry: committed policy versions as MLflow model versions.

The trainer publishes policy version k by (1) saving the weights as a checkpoint
(``sluice.infra.checkpoints.save_checkpoint``, manifest last) and (2) calling
``CheckpointRegistry.commit``, which verifies the manifest, creates an MLflow model version
whose source is the checkpoint URI, and moves an alias onto it. The rollout side polls
``latest()`` (one indexed alias lookup) and reloads weights when the policy version grows;
that poll is what gates reloads under the staleness bound (docs/design.md §2).

Guarantees:

- No model version exists for a checkpoint whose manifest is missing or whose files are
  missing or short: verification runs before anything is written to MLflow.
- One policy version maps to at most one model version. ``commit`` is idempotent, so a
  trainer that crashed anywhere inside it simply calls it again.
- The alias never moves backwards: committing a policy version at or below the one the
  alias points at is refused (it would mean a stale trainer is still publishing).

Departures and choices:

- The run's alias defaults to ``newest``, a name MLflow accepts as typed
  (``models:/<run model>@newest``). MLflow reserves ``latest`` and ``v<digits>``; such a
  configured alias is stored as ``sluice-<alias>`` (``mlflow_alias`` says which). Runs
  written while the default was ``latest`` carry ``sluice-latest``. The two defaults
  stand in for each other: where the configured one is absent, ``latest()`` reads the
  other, and the next move of the alias sets the configured one and removes the other.
- Evaluation results are tags ``sluice.eval.reward`` and ``sluice.eval.pass_at_<k>``
  (``eval_tag``); the ``eval.*`` tags of versions scored before read as the same names.
- ``commit`` checks presence and sizes against the manifest but, by default, does not
  re-read every byte to re-hash it: that would make each commit of a multi-GB checkpoint
  on S3 download it once more. Truncation (the real "not yet durable" failure) is caught
  by the size check; corruption is caught by ``fetch_checkpoint``, which hashes while it
  downloads. ``verify_hashes=True`` restores the full check.
- One writer per registered model is assumed (the single trainer of a run). Two trainers
  committing concurrently are not serialised beyond the monotonic-alias check.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from pydantic import BaseModel, ConfigDict

from sluice.infra.checkpoints import canonical_url, verify_checkpoint
from sluice.infra.failpoints import failpoint
from sluice.infra.tracking import get_client
from sluice.infra.tracking_config import DEFAULT_ALIAS, MLFLOW_RESERVED_ALIAS

TAG_POLICY_VERSION = "sluice.policy_version"
TAG_TRAINER_STEP = "sluice.trainer_step"
TAG_RUN_ID = "sluice.run_id"
TAG_CHECKPOINT_DIGEST = "sluice.checkpoint_digest"
TAG_DELETED = "sluice.deleted"
"""Set ("true") on a version whose checkpoint retention deleted: nothing may load it."""
TAG_KEEP = "sluice.keep"
"""Set it ("true") on a version, in the MLflow UI or with ``set_tag``, to keep its
checkpoint through retention (an alias on the version does the same)."""
RESERVED_TAGS = frozenset(
    {TAG_POLICY_VERSION, TAG_TRAINER_STEP, TAG_RUN_ID, TAG_CHECKPOINT_DIGEST, TAG_DELETED}
)
TAG_EVAL_PREFIX = "sluice.eval."
TAG_EVAL_REWARD = "sluice.eval.reward"
"""Mean held-out reward of a version, set by the evaluate role once it scored it."""
LEGACY_ALIAS = "sluice-latest"
"""The run's alias as stored while the default alias was ``latest`` (MLflow reserves it)."""
_DEFAULT_ALIASES = (DEFAULT_ALIAS, LEGACY_ALIAS)

_LEGACY_EVAL_TAG = re.compile(r"^eval\.(reward|pass_at_\d+)$")
_ALIAS_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,200}$")
# Far above any run's version count, far below MLflow's 200k page cap.
_PAGE_SIZE = 1000


class RegistryError(Exception):
    """A registry operation was refused or failed; the message says which and why."""


class PolicyVersionConflict(RegistryError, ValueError):
    """A commit would move the alias backwards or re-point an already committed version."""


class CommittedVersion(BaseModel):
    """One committed policy version, as the rollout side and evaluators see it."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    policy_version: int
    """Trainer-side policy version (0 = initial weights; the k-th update publishes k)."""
    checkpoint_uri: str
    """Absolute fsspec URL of the checkpoint directory (the model version's source)."""
    model_version: int
    """MLflow model version number (MLflow's own counter, not the policy version)."""
    trainer_step: int | None
    """Optimizer step that produced these weights, when the trainer said so."""
    run_id: str | None
    """MLflow run that produced this version."""
    checkpoint_digest: str | None
    """Manifest digest of the checkpoint (equal digests mean identical weights)."""
    created_at_ms: int
    """When the model version was created, in ms since the epoch."""
    tags: dict[str, str]
    """All tags of the model version, Sluice's own and the caller's (staleness, eval...)."""

    @property
    def deleted(self) -> bool:
        """Whether retention deleted this version's checkpoint (it stays listed, unloadable)."""
        return self.tags.get(TAG_DELETED) == "true"

    @property
    def kept(self) -> bool:
        """Whether a person pinned this version through retention (tag ``sluice.keep``)."""
        return self.tags.get(TAG_KEEP, "").strip().lower() in ("true", "1", "yes")


def eval_tag(name: str) -> str:
    """The model-version tag of evaluation result `name`: 'reward' -> 'sluice.eval.reward'."""
    return f"{TAG_EVAL_PREFIX}{name}"


def _as_committed(version: ModelVersion) -> CommittedVersion | None:
    tags = dict(version.tags or {})
    for key, value in list(tags.items()):
        # Versions scored before the `sluice.` namespace carry `eval.reward` etc.
        if _LEGACY_EVAL_TAG.match(key):
            tags.setdefault(f"sluice.{key}", value)
    raw = tags.get(TAG_POLICY_VERSION)
    if raw is None:
        return None  # a version registered by hand, not by Sluice: ignore it
    step = tags.get(TAG_TRAINER_STEP)
    return CommittedVersion(
        policy_version=int(raw),
        checkpoint_uri=str(version.source),
        model_version=int(version.version),
        trainer_step=int(step) if step not in (None, "") else None,
        run_id=tags.get(TAG_RUN_ID) or None,
        checkpoint_digest=tags.get(TAG_CHECKPOINT_DIGEST) or None,
        created_at_ms=int(version.creation_timestamp or 0),
        tags=tags,
    )


def _check_policy_version(policy_version: Any) -> int:
    if (
        isinstance(policy_version, bool)
        or not isinstance(policy_version, int)
        or policy_version < 0
    ):
        raise ValueError(f"policy_version must be an int >= 0, got {policy_version!r}")
    return policy_version


class CheckpointRegistry:
    """Committed policy versions of one registered model, with a forward-only alias."""

    def __init__(
        self,
        tracking_uri: str,
        model_name: str,
        alias: str = DEFAULT_ALIAS,
        *,
        verify_hashes: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        """Connect to MLflow at `tracking_uri` and make sure `model_name` is registered.

        `alias` names the pointer to the newest committed version (see module notes on
        MLflow's reserved names). `verify_hashes` makes `commit` re-hash every file.
        `storage_options` are the fsspec options used to read checkpoint manifests.
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
        # A default name is read, while absent, through the other (module notes).
        others = [a for a in _DEFAULT_ALIASES if a != self.mlflow_alias]
        fallback = others if self.mlflow_alias in _DEFAULT_ALIASES else []
        self._alias_reads = (self.mlflow_alias, *fallback)
        self.verify_hashes = verify_hashes
        self.storage_options = dict(storage_options or {})
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
                    description="Sluice policy: one model version per committed policy version.",
                )
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":  # another process won the race
                    raise

    def _find(self, policy_version: int) -> list[ModelVersion]:
        query = f"name = '{self.model_name}' and tags.`{TAG_POLICY_VERSION}` = '{policy_version}'"
        with self._mlflow(f"looking up policy version {policy_version}"):
            found = list(self._client.search_model_versions(query, max_results=_PAGE_SIZE))
        return sorted(found, key=lambda v: int(v.version))

    def _move_alias_forward(self, committed: CommittedVersion) -> None:
        current, read_from = self._aliased()
        if current is not None and current.policy_version >= committed.policy_version:
            if read_from == self.mlflow_alias:
                return
            committed = current  # a run from before `newest`: adopt where its alias points
        with self._mlflow(f"moving alias {self.mlflow_alias!r}"):
            self._client.set_registered_model_alias(
                self.model_name, self.mlflow_alias, str(committed.model_version)
            )
            if read_from not in (None, self.mlflow_alias):  # set first: a poller finds one
                self._client.delete_registered_model_alias(self.model_name, read_from)

    # ------------------------------------------------------------ writing

    def commit(
        self,
        policy_version: int,
        checkpoint_uri: str,
        run_id: str | None = None,
        tags: Mapping[str, Any] | None = None,
        *,
        trainer_step: int | None = None,
    ) -> CommittedVersion:
        """Register the durable checkpoint at `checkpoint_uri` as `policy_version`.

        Order: verify the checkpoint manifest (CheckpointIncomplete, nothing registered);
        return the existing version if this policy version was already committed with the
        same checkpoint (retry); refuse with PolicyVersionConflict if the alias already
        points at this or a newer policy version, or if the policy version was committed
        with a different checkpoint; create the model version (source = checkpoint URI,
        tags sluice.policy_version / trainer_step / run_id / checkpoint_digest plus
        `tags`); move the alias. `trainer_step` defaults to `policy_version`.
        """
        policy_version = _check_policy_version(policy_version)
        extra = {str(k): str(v) for k, v in (tags or {}).items()}
        clashing = sorted(RESERVED_TAGS & extra.keys())
        if clashing:
            raise ValueError(f"tags {clashing} are set by the registry itself; rename them")
        source = canonical_url(checkpoint_uri, self.storage_options)
        manifest = verify_checkpoint(
            checkpoint_uri, self.storage_options, check_hashes=self.verify_hashes
        )

        existing = self._find(policy_version)
        if existing:
            committed = _as_committed(existing[0])
            assert committed is not None  # found by its policy-version tag
            # Same weights (digest) is a retry, whatever URL they were saved under.
            if committed.checkpoint_digest is not None:
                differs = committed.checkpoint_digest != manifest.digest
            else:
                differs = committed.checkpoint_uri != source
            if differs:
                raise PolicyVersionConflict(
                    f"policy version {policy_version} is already committed as model version "
                    f"{committed.model_version} of {self.model_name!r} with checkpoint "
                    f"{committed.checkpoint_uri}; refusing to re-point it to {source}"
                )
            # A retry after a crash between creating the version and moving the alias.
            self._move_alias_forward(committed)
            return committed

        current = self.latest()
        if current is not None and current.policy_version >= policy_version:
            raise PolicyVersionConflict(
                f"refusing to commit policy version {policy_version} of {self.model_name!r}: "
                f"alias {self.alias!r} already points at policy version "
                f"{current.policy_version} (policy versions only move forward)"
            )
        all_tags = {
            TAG_POLICY_VERSION: str(policy_version),
            TAG_TRAINER_STEP: str(policy_version if trainer_step is None else trainer_step),
            TAG_RUN_ID: run_id or "",
            TAG_CHECKPOINT_DIGEST: manifest.digest,
            **extra,
        }
        with self._mlflow(f"creating policy version {policy_version}"):
            # Tags go in with the version in one call: a version never exists untagged, so a
            # retry can always find it by policy version.
            created = self._client.create_model_version(
                self.model_name,
                source=source,
                run_id=run_id,
                tags=all_tags,
                description=f"Sluice policy version {policy_version}",
            )
        committed = _as_committed(created)
        assert committed is not None
        failpoint("registry.before_alias")
        self._move_alias_forward(committed)
        return committed

    def set_tag(self, policy_version: int, key: str, value: Any) -> None:
        """Tag a committed version (e.g. 'sluice.eval.pass_at_1' = 0.41 after evaluation)."""
        policy_version = _check_policy_version(policy_version)
        if key in RESERVED_TAGS:
            raise ValueError(f"tag {key!r} is set by the registry itself and cannot be changed")
        found = self._find(policy_version)
        if not found:
            raise RegistryError(
                f"policy version {policy_version} of {self.model_name!r} is not committed"
            )
        with self._mlflow(f"tagging policy version {policy_version}"):
            self._client.set_model_version_tag(
                self.model_name, str(found[0].version), key, str(value)
            )

    def mark_deleted(self, policy_version: int) -> None:
        """Tag committed `policy_version` as deleted (``sluice.deleted``), before its files go.

        Readers skip such versions; the alias never points at one (retention keeps the
        newest). Idempotent.
        """
        policy_version = _check_policy_version(policy_version)
        found = self._find(policy_version)
        if not found:
            raise RegistryError(
                f"policy version {policy_version} of {self.model_name!r} is not committed"
            )
        with self._mlflow(f"marking policy version {policy_version} deleted"):
            self._client.set_model_version_tag(
                self.model_name, str(found[0].version), TAG_DELETED, "true"
            )

    def aliased_versions(self, committed: list[CommittedVersion] | None = None) -> dict[str, int]:
        """Every alias of the registered model and the policy version it points at
        (Sluice's own alias included; a version registered by hand is left out).
        `committed` saves listing the versions again when the caller just did."""
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
        """Move the alias to the highest committed policy version; return it.

        The training roles call this when they start (`TrainingRole.start_version`): a crash
        between creating a version and moving the alias leaves the alias one version
        behind, and the trainer must continue from the newest durable version, not the
        alias.
        """
        committed = self.versions()
        if not committed:
            return None
        self._move_alias_forward(committed[-1])
        return committed[-1]

    # ------------------------------------------------------------ reading

    def latest(self) -> CommittedVersion | None:
        """The version the alias points at, or None before the first commit.

        One indexed lookup of the alias and its version: cheap enough to poll every
        `poll_interval_s` from every rollout worker. With a default alias name, a run
        written under the other default (`sluice-latest`) is read through that name.
        """
        return self._aliased()[0]

    def _aliased(self) -> tuple[CommittedVersion | None, str | None]:
        """The version the alias points at and the alias it was read from (the configured
        one, else the other default name), or (None, None)."""
        for alias in self._alias_reads:
            try:
                version = self._client.get_model_version_by_alias(self.model_name, alias)
            except MlflowException as exc:
                if exc.error_code in ("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST"):
                    continue  # alias not set (yet)
                raise RegistryError(
                    f"reading alias {alias!r} of {self.model_name!r} failed at "
                    f"{self.tracking_uri}: {exc.message}"
                ) from exc
            return _as_committed(version), alias
        return None, None

    def get(self, policy_version: int) -> CommittedVersion | None:
        """The committed version for `policy_version`, or None if it was never committed."""
        found = self._find(_check_policy_version(policy_version))
        return _as_committed(found[0]) if found else None

    def versions(self) -> list[CommittedVersion]:
        """Every committed policy version, oldest first."""
        out: list[CommittedVersion] = []
        token: str | None = None
        with self._mlflow("listing versions"):
            while True:
                page = self._client.search_model_versions(
                    f"name = '{self.model_name}'", max_results=_PAGE_SIZE, page_token=token
                )
                out.extend(c for c in map(_as_committed, page) if c is not None)
                token = page.token
                if not token:
                    break
        return sorted(out, key=lambda c: c.policy_version)
