"""Retention: which published versions keep their checkpoints, and deleting the rest.

Without it every version stays on storage forever: at 135M parameters a version's
float32 weights are 0.54 GB and its AdamW state twice that, so a 150-version run
would leave ~240 GB. After each durable commit the trainer's background thread keeps

- the policy of the newest `storage.keep_versions` versions (0 or None: every version);
- the policy of every version an MLflow alias points at, or a `sluice.keep` tag pins;
- the policy of every version the evaluation schedule still has to score: those
  `should_evaluate` (tasks/run/eval_schedule.py) names, not yet tagged with a result
  and newer than the newest version scored (the evaluate role never goes back to an
  older one);
- the policy of the version the run (re)started from (the control document `start.json`):
  a launched server container that dies is restarted on it, then brought forward;
- version 0 of a LoRA run: the base every later version's adapter applies to; and of a
  run with a KL penalty (`trainer.kl`): its reference policy, which a resume reloads;
- the trainer states of the newest two durable versions (a resume reads the newest);
- a servable version that never became durable: while it is among the newest K (a
  server may be loading it), and always while its durable commit is under way;
- every version's consumed list (a few KB: the run's exactly-once record).

A version let go is first tagged `sluice.deleted` in the registry, so no reader picks
it any more, then its files are deleted, manifest first. Nothing outside the run's
checkpoint folder is ever deleted. A failure (storage or registry) is logged as a
warning and the work is picked up again after the next commit: a tagged version whose
files are still there is deleted again. Retention never stops a run.
"""

from __future__ import annotations

import logging

from sluice.infra.checkpoints import canonical_url, delete_checkpoint, open_checkpoint_fs
from sluice.infra.config.run import RunConfig
from sluice.infra.policy_version import PENDING, TAG_EVAL_REWARD, CommittedVersion
from sluice.infra.registry import CheckpointRegistry
from sluice.infra.storage import list_names
from sluice.tasks.run.control import START_FILE
from sluice.tasks.run.eval_schedule import should_evaluate
from sluice.tasks.run.paths import RunPaths, read_json

log = logging.getLogger("sluice.retention")
EVALUATED_TAG = TAG_EVAL_REWARD
"""The tag the evaluate role sets on a version once it is scored (`eval.reward` on
versions scored before the `sluice.` namespace reads as this one)."""


def awaiting_evaluation(committed: list[CommittedVersion], config: RunConfig) -> set[int]:
    """Versions the evaluation schedule will still score (during the run or, with
    `evaluation.during_run` off, afterwards with `sluice eval`)."""
    scored = [v.policy_version for v in committed if EVALUATED_TAG in v.tags]
    newest_scored = max(scored, default=-1)
    return {
        v.policy_version
        for v in committed
        if v.policy_version > newest_scored
        and EVALUATED_TAG not in v.tags
        and should_evaluate(v.policy_version, config)
    }


def versions_to_keep(
    committed: list[CommittedVersion],
    keep_latest: int | None,
    aliased: set[int],
    awaiting: set[int],
) -> set[int]:
    """Policy versions whose checkpoints stay: the newest `keep_latest` (every one when
    0 or None), the `aliased`, those tagged `sluice.keep` and those `awaiting` evaluation."""
    versions = sorted(v.policy_version for v in committed)
    if not keep_latest:
        return set(versions)
    return (
        set(versions[-keep_latest:])
        | aliased
        | awaiting
        | {v.policy_version for v in committed if v.kept}
    )


class Retention:
    """Applies the retention rules of one run after each commit (see the module notes)."""

    def __init__(self, config: RunConfig, paths: RunPaths, registry: CheckpointRegistry) -> None:
        self.config = config
        self.paths = paths
        self.registry = registry
        self.deleted: list[int] = []
        """Policy versions whose checkpoints this process deleted (newest last)."""

    def after_commit(self, newest: int) -> None:
        """Let go of what the rules no longer keep once `newest` is durable; never raises."""
        try:
            committed = self.registry.versions()
            self._trainer_states(newest, committed)
            if self.config.storage.keep_versions:
                self._policies(committed)
        except Exception as exc:  # a retention failure must never stop training
            log.warning("retention after version %d failed (%s); retried next commit", newest, exc)

    def _trainer_states(self, newest: int, committed: list[CommittedVersion]) -> None:
        """Keep the trainer states of the newest two durable versions: a resume reads the
        newest, and the one before is there should the newest turn out damaged."""
        durable = sorted({v.policy_version for v in committed if v.durable} | {newest})
        keep = {self.paths.trainer_state(k).rsplit("/", 1)[-1] for k in durable[-2:]}
        options = self.config.storage.options
        fs, root = open_checkpoint_fs(self.paths.trainer_states, options)
        for name in sorted(list_names(fs, root)):
            if name.startswith("v") and name not in keep:
                self._delete(f"{self.paths.trainer_states}/{name}", f"trainer state {name}")

    def _policies(self, committed: list[CommittedVersion]) -> None:
        """Servable versions that never became durable (``skipped``, ``lost``) keep their
        files while they are among the newest `keep_versions` (a server may be loading
        one); durable ones by the rules above. A ``pending`` version is never let go: its
        durable commit is under way."""
        aliased = set(self.registry.aliased_versions(committed).values())
        durable = [v for v in committed if v.durable]
        keep_steps = versions_to_keep(
            durable,
            self.config.storage.keep_versions,
            aliased,
            awaiting_evaluation(durable, self.config)
            | self._start_version()
            # The base of every adapter; the reference policy of a KL penalty.
            | ({0} if self.config.trainer.lora.rank or self.config.trainer.kl.coef else set()),
        )
        recent = {v.identity for v in committed if not v.lost}
        recent = set(sorted(recent)[-(self.config.storage.keep_versions or 0) :])
        kept = [
            v
            for v in committed
            if (v.durable and v.policy_version in keep_steps)
            or v.identity in recent
            or v.durability == PENDING
        ]
        # A step retrained after a crash reuses its folder: never delete a kept one's.
        kept_urls = {v.checkpoint_uri for v in kept}
        options = self.config.storage.options
        ours = canonical_url(self.paths.checkpoints, options).rstrip("/") + "/"
        fs, root = open_checkpoint_fs(self.paths.checkpoints, options)
        present = set(list_names(fs, root))
        for version in committed:
            name = version.checkpoint_uri.rstrip("/").rsplit("/", 1)[-1]
            if version in kept or not version.checkpoint_uri.startswith(ours):
                continue  # kept, or not this run's to delete (a source registered by hand)
            if version.checkpoint_uri in kept_urls:
                continue
            if version.deleted and name not in present:
                continue  # done earlier
            try:
                if not version.deleted:
                    self.registry.mark_deleted(
                        version.policy_version, incarnation=version.incarnation
                    )
            except Exception as exc:
                log.warning(
                    "cannot mark policy version %d deleted (%s)", version.policy_version, exc
                )
                continue  # its files stay until the registry says nobody may load them
            if self._delete(version.checkpoint_uri, f"policy version {version.policy_version}"):
                self.deleted.append(version.policy_version)

    def _start_version(self) -> set[int]:
        """The version the run (re)started from: a launched server container that dies is
        restarted on those weights (then brought forward), so they must stay."""
        start = read_json(self.config, f"{self.paths.control}/{START_FILE}")
        return {int(start["policy_version"])} if start and "policy_version" in start else set()

    def _delete(self, url: str, what: str) -> bool:
        try:
            deleted = delete_checkpoint(url, self.config.storage.options)
        except Exception as exc:
            log.warning("cannot delete %s at %s (%s); retried next commit", what, url, exc)
            return False
        if deleted:  # not when another incarnation's version of the step went first
            log.info("retention deleted %s (%s)", what, url)
        return True
