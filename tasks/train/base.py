"""What the two training roles share: the asynchronous train role and the colocated sync loop.

Both hold the run's trainer lease (one trainer per run, infra/lease.py), build the
same trainer from the run config, start from the newest durable policy version (its
policy and trainer state, tasks/run/versions.py), commit each published version to the
registry only once its checkpoint and trainer state are durable, apply retention after
each commit (tasks/run/retention.py), and leave the same end state: the run's done
marker once the last step is trained, and a final status document. The holder of the
lease also samples the machine's system metrics into the MLflow run
(`tracking.system_metrics_interval_s`), and both log each step's metrics the same way:
to MLflow and to the run's `metrics.jsonl` (tasks/run/metrics_file.py), with the
batch's samples counted by staleness (`staleness_counts`).
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from sluice.engines.policy.adapter import is_adapter_dir
from sluice.engines.rl.advantages import AdvantageFn, make_advantage_fn
from sluice.engines.rl.lineage import LostAfter
from sluice.engines.rl.reward_shaping import overlong_penalty
from sluice.engines.rl.samples import RewardShaping
from sluice.engines.rl.trainer import PolicyTrainer
from sluice.engines.rl.watchdog import Firing
from sluice.infra.checkpoints import canonical_url, save_checkpoint
from sluice.infra.config.run import RunConfig
from sluice.infra.failpoints import failpoint
from sluice.infra.lease import StorageLease
from sluice.infra.registry import CommittedVersion
from sluice.infra.system_metrics import SystemMetrics, start_system_metrics
from sluice.tasks.process.following_ranks import join, start_following_ranks
from sluice.tasks.process.ray_ranks import RankStart
from sluice.tasks.role import EXIT_WATCHDOG, WATCHDOG_MARK, Role
from sluice.tasks.run.control import INCARNATION_FILE, LEASE_FILE
from sluice.tasks.run.paths import filesystem, read_json, write_json
from sluice.tasks.run.retention import Retention
from sluice.tasks.run.versions import (
    SavedVersion,
    base_reference,
    fetch_training_dir,
    lost_versions,
    write_base_reference,
    write_consumed,
)
from sluice.tasks.train.factory import build_rank_trainer
from sluice.tasks.train.watchdog import StepWatch, stop_line

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger("sluice.train")


def build_trainer(
    config: RunConfig,
    model_dir: Path,
    reference_dir: Path | None = None,
    start: RankStart | None = None,
) -> PolicyTrainer:
    """The policy trainer the run config asks for, on the weights in `model_dir`.

    With more than one trainer process (`trainer.world_size`) this process becomes rank
    0 and starts the other ranks (on other Ray nodes, they fetch `start`, the version
    `model_dir` holds, from storage); the trainer returned runs each `train_step` and
    `save` on all of them, and `close()` releases them.
    """
    if config.trainer.world_size == 1:
        return build_rank_trainer(config, model_dir, reference_dir)
    from transformers import AutoConfig

    from sluice.engines.megatron import convert
    from sluice.engines.megatron.lockstep import LockstepTrainer

    # Refuse a policy the ranks cannot split before starting any of them.
    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    convert.check_supported(hf_config)
    convert.check_tensor_parallel(hf_config, config.trainer.tensor_parallel)
    convert.check_pipeline_parallel(hf_config, config.trainer.pipeline_parallel)
    ranks = start_following_ranks(config, model_dir, start)
    lead = LockstepTrainer(build_rank_trainer(config, model_dir), on_close=lambda: join(ranks))
    return lead  # type: ignore[return-value]  # a PolicyTrainer by delegation


def reward_shaping(config: RunConfig) -> RewardShaping | None:
    """What the trainer adds to the verifier's rewards (DAPO's overlong penalty), if anything."""
    buffer = config.reward.overlong_buffer_tokens
    if buffer == 0:
        return None
    return functools.partial(
        overlong_penalty,
        max_response_tokens=config.rollout.max_new_tokens,
        buffer_tokens=buffer,
        penalty_factor=config.reward.overlong_penalty,
    )


def advantage_fn(config: RunConfig) -> AdvantageFn:
    """Group advantages as `trainer.advantage` configures them."""
    return make_advantage_fn(**config.trainer.advantage.model_dump())


def staleness_counts(table: pa.Table, policy_version: int, max_staleness: int) -> dict[str, float]:
    """The batch's samples by lag: `staleness/count_lag_{k}` for k = 0 .. max(eta, largest lag).

    A sample's lag is counted as `staleness/mean` counts it: the versions between the
    weights being updated (`policy_version`) and the version that generated its first
    token (`version_start`). Every bucket up to eta is logged, zeros too, so each is a
    whole series and the counts sum to the batch's samples; a lag past eta (a run
    resumed with a smaller eta) gets buckets of its own rather than being hidden.
    """
    start = table.column("version_start").to_numpy(zero_copy_only=False).astype(np.int64)
    # A negative lag (a sample newer than the weights it trains) cannot happen; it would
    # show in `staleness/min`, and counting it as on-policy keeps the sum whole.
    lag = np.clip(policy_version - start, 0, None)
    counts = np.bincount(lag, minlength=max_staleness + 1)
    return {f"staleness/count_lag_{k}": float(n) for k, n in enumerate(counts)}


LEASE_TTL_S = 60.0
"""A dead trainer's lease expires this long after its last renewal (a restart on the
same host takes it over at once)."""


class TrainingRole(Role):
    """A role that trains the policy and publishes its versions."""

    name = "train"
    finished_note = ""
    """Appended to the done marker's reason ("trained N steps{note}")."""

    lease: StorageLease | None = None
    incarnation: int = 0
    """This trainer's incarnation r (`claim_incarnation`), in every version it publishes."""
    lost: LostAfter = {}
    """The versions earlier incarnations served and lost: samples holding their tokens
    are dropped (`engines.rl.lineage`)."""
    system_metrics: SystemMetrics | None = None
    _retention: Retention | None = None
    _base_reference: dict[str, Any] | None = None
    last_commit_s: float | None = None
    """How long the latest upload + registry commit took (what a version waits before
    the rollout can see it)."""
    last_commit_parts: dict[str, float] = {}
    """The same as ``train/commit_s`` with, of it, each checkpoint's save
    (``train/commit_state_s``, ``commit_policy_s``: side by side, so the longer one is
    what the commit waited for); swapped in whole, so a reader on another thread never
    mixes two versions."""

    def claim_run(self) -> None:
        """Hold the run's trainer lease (`LeaseHeld` if a live trainer has it), renewed
        in the background until the role ends; and, with it, sample the machine's system
        metrics into the MLflow run (one trainer a run, so one monitor a run)."""
        fs, path = filesystem(self.config, f"{self.paths.control}/{LEASE_FILE}")
        self.lease = StorageLease(
            fs, path, what=f"the trainer lease of run {self.run_id}", ttl_s=LEASE_TTL_S
        )
        self.lease.acquire()
        tracking = self.config.tracking
        self.system_metrics = start_system_metrics(
            tracking.uri, self.mlflow_run_id, tracking.system_metrics_interval_s
        )

    def close(self) -> None:
        if self.system_metrics is not None:
            self.system_metrics.stop()
            self.system_metrics = None
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def start_version(self) -> CommittedVersion:
        """The newest durable policy version, the one training goes on from (taken with
        the run's trainer lease), and this trainer's incarnation.

        A crash between creating a version in the registry and moving an alias leaves
        that alias one version behind: `sync_alias` moves it forward first. Versions
        served after the newest durable one are then tagged lost (`reset_lineage`): this
        trainer retrains their steps under a new incarnation r, so every (r, k) it
        publishes names new weights and is newer than anything served before.
        """
        self.claim_run()
        first = self.wait_for_first_version()
        durable = self.registry.sync_alias() or first
        self.incarnation = self.claim_incarnation()
        lost = self.registry.reset_lineage(durable)
        self.lost = lost_versions(self.registry.versions())
        if lost:
            cfg = self.config
            bound = cfg.checkpoint.every_versions + cfg.staleness.max_staleness
            log.warning(
                "resumed from %s (incarnation %d); %s to %s were served, not durable: %d "
                "steps are retrained, and the groups holding their tokens regenerated "
                "(at most (N + eta) x B = %d)",
                durable.name,
                self.incarnation,
                lost[0].name,
                lost[-1].name,
                max(v.policy_version for v in lost) - durable.policy_version,
                bound * cfg.trainer.prompts_per_batch,
            )
        return durable

    def claim_incarnation(self) -> int:
        """This trainer's incarnation r: one more than any earlier start of the run (the
        control dir's record, kept under the lease, so a trainer that died before it
        published anything still used up its number) and than any registered version."""
        url = f"{self.paths.control}/{INCARNATION_FILE}"
        record = read_json(self.config, url) or {}
        incarnation = max(int(record.get("incarnation", 0)) + 1, self.registry.next_incarnation())
        if self.lease is not None:
            self.lease.check()
        write_json(self.config, url, {"incarnation": incarnation, "started_at": time.time()})
        return incarnation

    def training_dir(self, version: CommittedVersion, local_root: Path) -> Path:
        """`version`'s policy and trainer state side by side, for `build_trainer`."""
        return fetch_training_dir(self.config, self.paths, version, local_root)

    def commit_version(
        self,
        saved: SavedVersion,
        version: int,
        tags: dict[str, Any],
        consumed: list[str] | None = None,
        next_group: int | None = None,
        *,
        registered: bool = False,
        policy_saved: bool = False,
    ) -> str:
        """Upload the trainer state, the `consumed` shard list and the policy in `saved`,
        then commit the policy as durable `version`; returns its URI. Retention runs
        after the commit and never fails it. A role whose lease was taken over commits
        nothing (`LeaseLost`). `registered`: the version is registered servable already
        (it is marked durable); `policy_saved`: its policy files are on storage already
        (the disk path's servable copy).

        The version is not durable yet (a trainer continues from the newest durable
        one), so whatever its URLs hold is the leftover of an attempt that died before
        its commit, and is replaced.
        """
        if self.lease is not None:
            self.lease.check()
        started = time.monotonic()
        options = self.config.storage.options
        # Durable before the commit: a resume from this version reads them.
        # The trainer wrote both folders fresh for this version and never rewrites them:
        # on a local disk they are linked into storage, not copied. The trainer state
        # (twice the weights) is saved beside the policy, not before it: hashing and
        # fsync release the GIL, so the commit waits for the larger of the two.
        parts: dict[str, float] = {}

        def save_state() -> None:
            save_checkpoint(
                saved.trainer_state,
                self.paths.trainer_state(version),
                options,
                replace=True,
                link=True,
            )
            parts["train/commit_state_s"] = time.monotonic() - started

        with ThreadPoolExecutor(1, thread_name_prefix="trainer-state") as pool:
            state = pool.submit(save_state)
            if consumed is not None:
                write_consumed(self.config, self.paths, version, consumed, next_group)
            if is_adapter_dir(saved.policy):  # a LoRA version names the base it applies to
                if self._base_reference is None:
                    self._base_reference = base_reference(self.config, self.registry)
                write_base_reference(saved.policy, self._base_reference)
                tags = {**tags, "lora.base_digest": self._base_reference["base_digest"]}
            url = self.paths.checkpoint(version)
            if policy_saved:
                uri = canonical_url(url, options)
            else:
                uri = save_checkpoint(saved.policy, url, options, replace=True, link=True)
            parts["train/commit_policy_s"] = time.monotonic() - started
            state.result()
        failpoint("train.written_not_committed")  # on storage, not yet durable in the registry
        if registered:
            self.registry.mark_durable(version, incarnation=self.incarnation)
        else:
            self.registry.commit(
                version,
                uri,
                run_id=self.mlflow_run_id,
                tags=tags,
                trainer_step=version,
                incarnation=self.incarnation,
            )
        self.last_commit_s = time.monotonic() - started
        made = [saved.trainer_state] if policy_saved else [saved.trainer_state, saved.policy]
        durable_bytes = float(
            sum(f.stat().st_size for d in made for f in d.rglob("*") if f.is_file())
        )
        self.last_commit_parts = {
            **parts,
            "train/commit_s": self.last_commit_s,
            "train/commit_bytes": durable_bytes,
            "train/commit_gb_per_s": durable_bytes / 1e9 / max(1e-9, self.last_commit_s),
        }
        self.retention.after_commit(version)
        return uri

    def register_servable(self, version: int, tags: dict[str, Any]) -> None:
        """Register `version` servable only (``skipped``): served, never written."""
        self.registry.commit(
            version,
            self.paths.checkpoint(version),
            run_id=self.mlflow_run_id,
            tags=tags,
            incarnation=self.incarnation,
            durable=False,
            pending=False,
        )

    @property
    def retention(self) -> Retention:
        if self._retention is None:
            self._retention = Retention(self.config, self.paths, self.registry)
        return self._retention

    def stop_for_watchdog(self, firing: Firing, watch: StepWatch) -> NoReturn:
        """End the role on a watchdog `stop`, once what the role holds is settled: one
        line names the signal and the newest durable version, where a resume goes on
        (the flow raises it as WatchdogStopped)."""
        latest = self.registry.newest_durable()
        self.status.update(force=True, state="stopped", **watch.status())
        last_good = latest.policy_version if latest is not None else 0
        log.error(f"train stops: {WATCHDOG_MARK}%s", stop_line(firing, last_good))
        raise SystemExit(EXIT_WATCHDOG)

    def finish(self, version: int) -> None:
        """The run's done marker once the last step is trained; the final status either way."""
        total = self.config.trainer.total_steps
        if version >= total:
            self.control.mark_done(f"trained {total} steps{self.finished_note}")
        self.status.update(
            force=True, state="finished" if version >= total else "stopped", step=version
        )
