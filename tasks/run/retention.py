"""Retention: which published versions keep their checkpoints, and deleting the rest.

Without it every version stays on storage forever: at 135M parameters a version's
float32 weights are 0.54 GB and its AdamW state twice that, so a 150-version run
would leave ~240 GB. After each commit the trainer's background thread keeps

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
- the trainer state of the newest committed version only (a resume reads no other);
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
from sluice.infra.config import RunConfig
from sluice.infra.policy_version import TAG_EVAL_REWARD, CommittedVersion
from sluice.infra.registry import CheckpointRegistry
from sluice.infra.storage import list_names
from sluice.tasks.run.eval_schedule import should_evaluate
from sluice.tasks.run.paths import START_FILE, RunPaths, read_json

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
        """Let go of what the rules no longer keep once `newest` is committed; never raises."""
        try:
            self._trainer_states(newest)
            if self.config.storage.keep_versions:
                self._policies()
        except Exception as exc:  # a retention failure must never stop training
            log.warning("retention after version %d failed (%s); retried next commit", newest, exc)

    def _trainer_states(self, newest: int) -> None:
        options = self.config.storage.options
        fs, root = open_checkpoint_fs(self.paths.trainer_states, options)
        keep = self.paths.trainer_state(newest).rsplit("/", 1)[-1]
        for name in sorted(list_names(fs, root)):
            if name.startswith("v") and name != keep:
                self._delete(f"{self.paths.trainer_states}/{name}", f"trainer state {name}")

    def _policies(self) -> None:
        committed = self.registry.versions()
        aliased = set(self.registry.aliased_versions(committed).values())
        keep = versions_to_keep(
            committed,
            self.config.storage.keep_versions,
            aliased,
            awaiting_evaluation(committed, self.config)
            | self._start_version()
            # The base of every adapter; the reference policy of a KL penalty.
            | ({0} if self.config.trainer.lora.rank or self.config.trainer.kl.coef else set()),
        )
        options = self.config.storage.options
        ours = canonical_url(self.paths.checkpoints, options).rstrip("/") + "/"
        fs, root = open_checkpoint_fs(self.paths.checkpoints, options)
        present = set(list_names(fs, root))
        for version in committed:
            name = version.checkpoint_uri.rstrip("/").rsplit("/", 1)[-1]
            if version.policy_version in keep or not version.checkpoint_uri.startswith(ours):
                continue  # kept, or not this run's to delete (a source registered by hand)
            if version.deleted and name not in present:
                continue  # done earlier
            try:
                if not version.deleted:
                    self.registry.mark_deleted(version.policy_version)
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
            delete_checkpoint(url, self.config.storage.options)
        except Exception as exc:
            log.warning("cannot delete %s at %s (%s); retried next commit", what, url, exc)
            return False
        log.info("retention deleted %s (%s)", what, url)
        return True
