"""The train role: consume `scored` in issue order, B groups a step, publish versions.

Per step k: train the B prompt groups the rollout role issued as numbers kB..kB+B-1
(read from the scored stream in whatever order they finished), compute group
advantages, recompute π_prox and run the decoupled PPO step (sluice.engines.rl.trainer). Every
`publish_every` steps the weights are published as the next policy version: servable at
once, durable at the cadence of `checkpoint.*` (tasks/train/publisher.py); the shards that
went into it are acknowledged once a durable version covers them.

Why by issue number and not by arrival: the staleness gate admitted group n only while
floor(n / B) <= i + eta (i = the version the rollout served), so training group n in
batch floor(n / B) keeps every sample at most eta versions old. Taking groups as they
arrive would let a slow group of batch k slip into batch k + 1 (eta + 1 versions old).
Training in issue order also makes exactly-once simple: version v has trained exactly
the groups numbered below v * B. A group whose shard was quarantined as corrupt (in
either stream) is lost: the step goes on without it once that is certain.

Exactly once: each durable version records the shards trained since the durable version
before it (`checkpoints/consumed/`, on storage before its commit). A crash after the
commit but before the ack is repaired on restart by acking that list; a crash before
it retrains those shards from the newest durable version, whose weights never saw them.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn

import pyarrow as pa

from sluice.engines.rl.groups import GroupBuffer, group_key
from sluice.engines.rl.lineage import lost_groups as lineage_lost_groups
from sluice.engines.rl.train_batch import TrainingSample
from sluice.engines.rl.trainer import PolicyTrainer
from sluice.engines.rl.watchdog import Firing
from sluice.infra.config.run import RunConfig
from sluice.infra.registry import CommittedVersion
from sluice.infra.streams.names import ShardRef, shard_key_tag
from sluice.infra.streams.reader import StreamReader
from sluice.tasks.process.ray_ranks import RankStart
from sluice.tasks.role import StopRequested
from sluice.tasks.run.metrics_file import log_step_metrics
from sluice.tasks.run.paths import ROLLOUTS, SCORED
from sluice.tasks.run.state_timer import OTHER, StateTimer
from sluice.tasks.run.status import read_statuses
from sluice.tasks.run.threads import Background
from sluice.tasks.run.versions import (
    fetch_reference,
    read_consumed,
    read_next_group,
)
from sluice.tasks.train.base import (
    TrainingRole,
    build_trainer,
)
from sluice.tasks.train.publisher import Publisher
from sluice.tasks.train.steps import StepBook

log = logging.getLogger("sluice.train")
LOST_CHECK_INTERVAL_S = 5.0
"""How often a trainer waiting on missing groups checks whether they were quarantined."""
BATCH_POLL_S = 0.05
"""How often the trainer looks for the rest of its batch while it waits."""
TRAIN_STATES = ("start", "wait_data", "proximal", "train", "publish")
"""Where the train role's time goes (tasks/run/state_timer.py): its setup, waiting for
its batch (polling, reading and filing shards included), the π_prox pass the step
measures, the rest of the step (batch preparation included), and the publish on the
critical path (the wait for the previous commit and the host copy)."""


def lost_groups(rollouts: StreamReader, scored: StreamReader, indices: list[int]) -> list[int]:
    """Those of `indices` that can never reach `scored`: a shard of theirs was quarantined.

    The rollout role keys each group's shard by `group_key(index)` and the reward role
    keys the scored shard by the rollout shard's name, so both are found by key. When
    nothing was quarantined (the usual case) this costs two listings of empty folders.
    """
    bad_rollouts = rollouts.quarantined_tags()
    bad_scored = scored.quarantined_tags()
    if not bad_rollouts and not bad_scored:
        return []
    rollout_names = {ref.tag: ref.name for ref in rollouts.committed()} if bad_scored else {}
    lost = []
    for index in indices:
        tag = shard_key_tag(group_key(index))
        name = rollout_names.get(tag)
        if tag in bad_rollouts or (name is not None and shard_key_tag(name) in bad_scored):
            lost.append(index)
    return lost


class TrainRole(TrainingRole):
    name = "train"

    def __init__(self, config: RunConfig, run_id: str, mlflow_run_id: str):
        super().__init__(config, run_id, mlflow_run_id)
        self.local_root = self.local_dir("trainer")
        self.reader = self.stream_reader(SCORED, consumer="trainer")
        self.buffer: GroupBuffer[ShardRef] = GroupBuffer(
            config.trainer.prompts_per_batch, refill=config.trainer.dynamic_sampling
        )
        self._rollouts: StreamReader | None = None
        self.background = Background("trainer-metrics")
        self.book = StepBook(config, mlflow_run_id)
        self.watch = self.book.watch
        self.lineage_dropped = 0
        self.live: PolicyTrainer | None = None
        """The trainer of `run`, once built: a stop makes the version it holds durable."""
        """Groups dropped for holding tokens of versions a crash lost."""
        self.publisher: Publisher | None = None
        """Set once the start version is known (`start_version`)."""
        self.timer = StateTimer(TRAIN_STATES, initial="start")

    def start_version(self) -> CommittedVersion:
        """The newest durable version (alias repaired), its consumed shards acked."""
        latest = super().start_version()
        self.publisher = Publisher(self, self.reader, self.local_root, latest.policy_version)
        self.reconcile_ledger(latest)
        if self.buffer.refill:
            recorded = read_next_group(self.config, self.paths, latest)
            B = self.config.trainer.prompts_per_batch
            # A run that turned refill on at a resume took B numbers per batch so far.
            self.buffer.cursor = latest.policy_version * B if recorded is None else recorded
        return latest

    def reconcile_ledger(self, committed: CommittedVersion) -> None:
        """Ack what the committed version consumed, in case the last run died before acking."""
        names = read_consumed(self.config, self.paths, committed)
        if not names:
            return
        missing = [n for n in names if not self.reader.is_acked(n)]
        if missing:
            log.info(
                "acking %d shards consumed by the committed version before the restart",
                len(missing),
            )
            self.reader.ack(missing, meta={"reconciled": True})

    def next_batch(self, step: int) -> tuple[pa.Table | None, list[ShardRef], float, list[int]]:
        """Batch `step`: its B groups, whatever order they finished in.

        Returns the table (None when every group of the batch was lost), the shards
        completed by it, the seconds spent waiting, and the issue numbers found lost.
        Raises StopRequested when told to stop first.
        """
        waited = 0.0
        last_check = time.monotonic()
        lost: list[int] = []

        def file_shard(ref: ShardRef, table: pa.Table) -> None:
            dropped = lineage_lost_groups(table, self.lost)
            if dropped:  # tokens of versions a crash lost: the rollout issues them again
                self.lineage_dropped += len(dropped)
                self.reader.ack([ref], meta={"lineage_dropped": sorted(dropped)})
                return
            for warning in self.buffer.add(ref, table, step):
                log.warning("%s", warning)

        def wait_a_little() -> None:
            nonlocal waited, last_check, lost
            t0 = time.monotonic()
            self.control.sleep(BATCH_POLL_S)
            waited += time.monotonic() - t0
            if time.monotonic() - last_check < LOST_CHECK_INTERVAL_S:
                return
            last_check = time.monotonic()
            self.check_draws(step + 1)
            missing = self.buffer.missing(step)
            found = lost_groups(self.rollouts_audit(), self.reader, missing)
            if found and self.buffer.refill:  # passed over; the batch draws further
                log.error(
                    "step %d passes over %d group(s) lost to corrupt shards: %s",
                    step,
                    len(found),
                    ", ".join(group_key(i) for i in found),
                )
                self.buffer.lost.update(found)
                lost.extend(found)
            elif found and len(found) == len(missing):
                log.error(
                    "step %d goes on without %d group(s) lost to corrupt shards: %s",
                    step,
                    len(found),
                    ", ".join(group_key(i) for i in found),
                )
                lost = found

        def complete() -> bool:
            return (bool(lost) and not self.buffer.refill) or not self.buffer.missing(step)

        # A stop (the time budget, a failed role) ends training before the next step even
        # when its batch is already complete: consume() would not ask.
        if self.control.should_stop(check_marker_every_s=0.0) or not self.consume(
            self.reader, file_shard, wait_a_little, done=complete
        ):
            raise StopRequested
        table, done = self.buffer.take(step)
        return table, done, waited, lost

    def check_draws(self, step: int) -> None:
        """Dynamic sampling: stop the run (as the watchdog does) when the batch of `step`
        has drawn `dynamic_sampling_max_draws` x B groups and is still not full."""
        if not self.buffer.refill:
            return
        drawn = self.buffer.drawn()
        limit = self.config.trainer.dynamic_sampling_max_draws * self.buffer.prompts_per_batch
        if drawn >= limit:
            reason = (
                f"batch {step} drew {drawn} groups and found fewer than the "
                f"{self.buffer.prompts_per_batch} whose rewards differ that it needs "
                f"(trainer.dynamic_sampling_max_draws={limit // self.buffer.prompts_per_batch}); "
                "the task is too hard or too easy for this policy"
            )
            firing = Firing("dynamic_sampling", step, float(drawn), "stop", reason)
            self.watch.note(firing)
            self.stop_on_watchdog(firing, holds=step - 1)

    def rollouts_audit(self) -> StreamReader:
        """A reader of the rollouts stream that only looks (it never reads or acks)."""
        if self._rollouts is None:
            self._rollouts = self.stream_reader(ROLLOUTS, consumer="trainer-audit")
        return self._rollouts

    def publish(
        self, trainer: PolicyTrainer, version: int, consumed: list[ShardRef], tags: dict[str, Any]
    ) -> None:
        """Publish version `version`, which trained `consumed`: servable at once, durable
        at the cadence (tasks/train/publisher.py). On the critical path: one copy of the
        weights (and, for a durable version, the optimizer state)."""
        if self.publisher is None:
            self.publisher = Publisher(self, self.reader, self.local_root, version - 1)
        cursor = self.buffer.cursor if self.buffer.refill else None
        self.publisher.publish(trainer, version, consumed, tags, cursor)

    def finish_publish(self, trainer: PolicyTrainer | None = None, trained: int = -1) -> None:
        """Wait for every publishing job and ack what durable versions cover; with the
        `trainer` that trained `trained` steps, its newest version is made durable too."""
        if self.publisher is not None:
            self.publisher.finish(trainer, trained)

    def stop_on_watchdog(self, firing: Firing, holds: int | None = None) -> NoReturn:
        """End the role on a watchdog `stop`: the commit in flight finishes, the step
        that fired is not published, and one line names the signal and the newest
        durable version, where a resume goes on (the flow raises it as
        WatchdogStopped).

        A stop is a clean stop: when the trainer's tensors are still version `holds`
        (the step that fired applied no update, or the stop came before the step), that
        version is made durable first, so the servable-only versions before it
        (`checkpoint.every_versions` > 1) are not lost. None: the step changed them, and
        the run goes on from the newest durable version."""
        self.finish_publish(
            self.live if holds is not None else None, -1 if holds is None else holds
        )
        self.background.close()
        if self.publisher is not None:
            self.publisher.close()
            self.publisher.stop_sender()
        self.stop_for_watchdog(firing, self.watch)

    def run(self) -> None:
        cfg = self.config
        latest = self.start_version()
        reference = fetch_reference(cfg, self.registry, self.local_root / "reference")
        trainer = build_trainer(
            cfg,
            self.training_dir(latest, self.local_root),
            reference,
            start=RankStart(run_id=self.run_id, version=latest),
        )
        self.live = trainer
        assert self.publisher is not None
        publisher = self.publisher
        publisher.start_sender()
        version = latest.policy_version
        total = cfg.trainer.total_steps
        B = cfg.trainer.prompts_per_batch
        book = self.book
        book.start(version)
        unpublished: list[ShardRef] = []
        extra_total = 0
        log.info("training from policy version %d to %d (B=%d)", version, total, B)
        self.status.update(force=True, state="running", step=version)
        while version < total:
            self.timer.enter("wait_data")
            try:
                table, refs, waited, lost = self.next_batch(version)
            except StopRequested:
                break
            self.timer.enter("train")
            book.idle_s += waited
            if table is None:  # every group of this batch was lost: the version moves on
                samples: list[TrainingSample] = []
                stats = {
                    k: float("nan") for k in ("reward/mean", "staleness/mean", "staleness/max")
                }
            else:
                samples, stats = book.batch(table, version)
            stats["train/lost_groups"] = float(len(lost))
            stats["train/lineage_dropped_groups"] = float(self.lineage_dropped)
            if self.buffer.refill:  # the cost of keeping B informative groups per batch
                extra_total += self.buffer.last_dropped
                stats["dynamic_sampling/drawn_groups"] = float(self.buffer.last_drawn)
                stats["dynamic_sampling/extra_groups"] = float(self.buffer.last_dropped)
                stats["dynamic_sampling/extra_groups_per_batch"] = extra_total / (
                    version + 1 - latest.policy_version
                )
            metrics, firings, verdict = book.train(trainer, samples, version + 1, self.timer)
            if verdict is not None and verdict.action == "stop":
                stopped = book.stopped(metrics, stats, firings)
                self.background.submit(
                    log_step_metrics, cfg, self.run_id, self.mlflow_run_id, stopped, version + 1
                )
                # A refused update leaves the tensors at `version`: it can be made durable.
                applied = metrics.get("train/applied_minibatches", 1.0) > 0
                self.stop_on_watchdog(verdict, holds=None if applied else version)
            book.settle(metrics, table, firings, verdict)
            version += 1
            unpublished.extend(refs)
            elapsed = book.rates(metrics, stats, self.last_commit_parts)
            rollout_status = read_statuses(cfg, self.paths).get("rollout", {})
            for key in ("tokens_per_s", "idle_ratio", "partial_rollout_ratio", "weight_updates"):
                if key in rollout_status:
                    metrics[f"rollout/{key}"] = rollout_status[key]
            for key, value in rollout_status.items():  # its time split, beside the trainer's
                if key.startswith("time/") and key.endswith("_frac"):
                    metrics[f"rollout/{key}"] = value
            if version % cfg.trainer.publish_every == 0 or version == total:
                tags = {
                    "staleness_mean": f"{stats['staleness/mean']:.3f}",
                    "staleness_max": f"{stats['staleness/max']:.0f}",
                    "reward_mean": f"{stats['reward/mean']:.4f}",
                    **self.watch.take_tags(),
                }
                stall = time.monotonic()
                self.timer.enter("publish")
                self.publish(trainer, version, unpublished, tags)
                self.timer.enter(OTHER)
                metrics["train/publish_stall_s"] = time.monotonic() - stall
                metrics.update(publisher.parts)
                unpublished = []
                log.info(
                    "step %d: reward %.3f, staleness %.2f, loss %.4f",
                    version,
                    stats["reward/mean"],
                    stats["staleness/mean"],
                    metrics.get("loss/policy_loss", float("nan")),
                )
            # This step's timeline (its states sum to `time/step_s`) for the metrics, the
            # role's since it started for its status; the background thread's work is
            # outside both.
            timeline, cumulative = self.timer.lap_metrics(), self.timer.report()
            metrics.update(timeline)
            metrics.update(self.background.report())
            metrics.update(publisher.report())
            self.background.submit(
                log_step_metrics, cfg, self.run_id, self.mlflow_run_id, metrics, version
            )
            self.status.update(
                **book.status(version, stats, metrics, elapsed),
                **publisher.status(),
                **cumulative,
                step_timeline=timeline,
                **self.background.report(),
            )
        self.timer.enter("publish")  # the last commit, on the way out
        self.finish_publish(trainer, version)
        self.timer.enter(OTHER)
        trainer.close()
        self.background.close()
        publisher.close()
        self.status.update(**self.timer.report(), **self.background.report(), **publisher.report())
        self.finish(version)
        publisher.stop_sender()  # after the done marker: a rollout that finds it gone sees why
