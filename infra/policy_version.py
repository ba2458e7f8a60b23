"""A policy version as the registry names it: (incarnation r, step k), its durability,
and the MLflow model-version tags that carry them (docs/design.md §2).

Pure data over MLflow's ``ModelVersion``: the registry (``sluice.infra.registry``) writes
these tags and moves the aliases; everything that reads versions reads them through
``CommittedVersion``.
"""

from __future__ import annotations

import re
from typing import Any

from mlflow.entities.model_registry import ModelVersion
from pydantic import BaseModel, ConfigDict

TAG_POLICY_VERSION = "sluice.policy_version"
TAG_INCARNATION = "sluice.incarnation"
"""The trainer incarnation r that published the version (absent on older runs: 0)."""
TAG_DURABLE = "sluice.durable"
"""``true`` | ``pending`` | ``skipped`` | ``lost`` (absent on older runs: ``true``)."""
TAG_TRAINER_STEP = "sluice.trainer_step"
TAG_RUN_ID = "sluice.run_id"
TAG_CHECKPOINT_DIGEST = "sluice.checkpoint_digest"
TAG_DELETED = "sluice.deleted"
"""Set ("true") on a version whose checkpoint retention deleted: nothing may load it."""
TAG_KEEP = "sluice.keep"
"""Set it ("true") on a version, in the MLflow UI or with ``set_tag``, to keep its
checkpoint through retention (an alias on the version does the same)."""
RESERVED_TAGS = frozenset(
    {
        TAG_POLICY_VERSION,
        TAG_INCARNATION,
        TAG_DURABLE,
        TAG_TRAINER_STEP,
        TAG_RUN_ID,
        TAG_CHECKPOINT_DIGEST,
        TAG_DELETED,
    }
)
DURABLE = "true"
PENDING = "pending"
SKIPPED = "skipped"
LOST = "lost"
DURABILITY_STATES = (DURABLE, PENDING, SKIPPED, LOST)
DURABLE_ALIAS_SUFFIX = "-durable"
"""The durable alias is the servable alias's name with this suffix: ``newest-durable``."""
TAG_EVAL_PREFIX = "sluice.eval."
TAG_EVAL_REWARD = "sluice.eval.reward"
"""Mean held-out reward of a version, set by the evaluate role once it scored it."""
_LEGACY_EVAL_TAG = re.compile(r"^eval\.(reward|pass_at_\d+)$")


class CommittedVersion(BaseModel):
    """One registered policy version, as the rollout side and evaluators see it."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    policy_version: int
    """Step k along the lineage (0 = initial weights; the k-th update publishes k): what
    admission, batches and staleness count."""
    incarnation: int = 0
    """Trainer incarnation r that published it (0: the run's initial weights, and every
    version of a run from before incarnations)."""
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
    def identity(self) -> tuple[int, int]:
        """(r, k): what every "newer than" test compares."""
        return (self.incarnation, self.policy_version)

    @property
    def durability(self) -> str:
        """``true`` | ``pending`` | ``skipped`` | ``lost`` (module notes)."""
        return self.tags.get(TAG_DURABLE, DURABLE)

    @property
    def durable(self) -> bool:
        """Whether its weights, trainer state and consumed list are on storage, committed."""
        return self.durability == DURABLE

    @property
    def lost(self) -> bool:
        """Whether it was served, then left behind by a trainer restarted from an older
        durable version: nothing may load it, and samples holding its tokens are dropped."""
        return self.durability == LOST

    @property
    def name(self) -> str:
        """How logs and messages name it: ``v0`` (incarnation 0), ``r2/v121``."""
        prefix = f"r{self.incarnation}/" if self.incarnation else ""
        return f"{prefix}v{self.policy_version}"

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


def as_committed(version: ModelVersion) -> CommittedVersion | None:
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
        incarnation=int(tags.get(TAG_INCARNATION) or 0),
        checkpoint_uri=str(version.source),
        model_version=int(version.version),
        trainer_step=int(step) if step not in (None, "") else None,
        run_id=tags.get(TAG_RUN_ID) or None,
        checkpoint_digest=tags.get(TAG_CHECKPOINT_DIGEST) or None,
        created_at_ms=int(version.creation_timestamp or 0),
        tags=tags,
    )


def check_policy_version(policy_version: Any) -> int:
    if (
        isinstance(policy_version, bool)
        or not isinstance(policy_version, int)
        or policy_version < 0
    ):
        raise ValueError(f"policy_version must be an int >= 0, got {policy_version!r}")
    return policy_version


def check_incarnation(incarnation: Any) -> int:
    if isinstance(incarnation, bool) or not isinstance(incarnation, int) or incarnation < 0:
        raise ValueError(f"incarnation must be an int >= 0, got {incarnation!r}")
    return incarnation
