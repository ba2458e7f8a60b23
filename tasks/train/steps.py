"""The bookkeeping of a training step, written once for both train roles: the
asynchronous train role (tasks/train/role.py) and the colocated sync loop
(tasks/train/sync.py).

Both turn a batch table into samples and their statistics, run the step under the
mismatch watchdog's guard (tasks/train/watchdog.py), and log the same run-level rates
after it. Kept in one place because the two loops had drifted: only one was guarded,
and only one left out the tokens of a batch the watchdog kept from being applied.

One rule for trained tokens: a batch counts toward `train/effective_tokens_per_s` only
when at least one of its minibatches was applied (`train/applied_minibatches` > 0); a
batch the watchdog skipped whole trained nothing. Without a firing every batch is
applied, so the rule changes no number of an unguarded run.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from sluice.engines.rl.samples import samples_from_table, staleness_stats
from sluice.engines.rl.train_batch import TrainingSample
from sluice.engines.rl.watchdog import Firing
from sluice.infra.config.run import RunConfig
from sluice.tasks.run.state_timer import OTHER, StateTimer
from sluice.tasks.train.base import advantage_fn, reward_shaping, staleness_counts
from sluice.tasks.train.watchdog import StepWatch

if TYPE_CHECKING:
    import pyarrow as pa

    from sluice.engines.rl.trainer import PolicyTrainer


class StepBook:
    """One train role's steps: the batch's samples and statistics, the guarded step, and
    the run's totals (trained tokens, seconds the trainer sat idle) behind its rates."""

    def __init__(self, config: RunConfig, mlflow_run_id: str) -> None:
        self.config = config
        self.watch = StepWatch(config, mlflow_run_id)
        self.advantages = advantage_fn(config)
        self.shape_rewards = reward_shaping(config)
        self.started = time.monotonic()
        self.trained_tokens = 0.0
        """Tokens of the applied batches since the role started."""
        self.idle_s = 0.0
        """Seconds the trainer waited for its batches (the async role: for scored groups;
        the sync loop: while its engine generated)."""

    def start(self, version: int) -> None:
        """Start the clock of the role's rates at `version`; the watchdog takes up the
        history the run logged up to it."""
        self.started = time.monotonic()
        self.watch.resume(version)

    def batch(self, table: pa.Table, version: int) -> tuple[list[TrainingSample], dict[str, float]]:
        """The batch's training samples (advantages, shaped rewards) for the step that
        updates `version`, and its statistics: rewards, staleness, samples by lag."""
        samples, stats = samples_from_table(
            table, self.advantages, policy_version=version, shape_rewards=self.shape_rewards
        )
        stats.update(staleness_stats(table, version))
        stats.update(staleness_counts(table, version, self.config.staleness.max_staleness))
        return samples, stats

    def train(
        self, trainer: PolicyTrainer, samples: list[TrainingSample], step: int, timer: StateTimer
    ) -> tuple[dict[str, float], list[Firing], Firing | None]:
        """Step `step` over `samples`, the watchdog guarding its update: its metrics, the
        watchdog's firings, and the one that decides the step (a skip or a stop), if any.
        The step's π_prox pass, which it measured, moves to the timer's `proximal`."""
        guard = self.watch.guard(step)
        metrics: dict[str, float] = {}
        if samples:
            metrics = trainer.train_step(samples, guard) if guard else trainer.train_step(samples)
        timer.enter(OTHER)
        timer.move("train", "proximal", metrics.get("train/proximal_time_s", 0.0))
        firings, verdict = self.watch.settle(metrics, step)
        return metrics, firings, verdict

    def stopped(
        self, metrics: dict[str, float], stats: dict[str, float], firings: list[Firing]
    ) -> dict[str, float]:
        """What a step the watchdog stopped logs: its metrics, statistics and firings."""
        return {**metrics, **stats, **self.watch.step_metrics(firings)}

    def settle(
        self,
        metrics: dict[str, float],
        table: pa.Table | None,
        firings: list[Firing],
        verdict: Firing | None,
    ) -> None:
        """After a step the watchdog did not stop: a skipped batch's groups are counted,
        each firing logs its metric, and an applied batch's tokens enter the total."""
        if verdict is not None and table is not None:  # skip: the batch was left out
            self.watch.skipped_groups += len(set(table.column("group_id").to_pylist()))
        metrics.update(self.watch.step_metrics(firings))
        if metrics.get("train/applied_minibatches", 1.0) > 0:  # a skipped batch trains none
            self.trained_tokens += metrics.get("train/trained_tokens", 0.0)

    def rates(
        self, metrics: dict[str, float], stats: dict[str, float], commit_parts: dict[str, float]
    ) -> float:
        """Add the batch's statistics and the run's rates so far to the step's metrics
        (with the newest commit's times, `commit_parts`); returns the seconds since the
        role started."""
        elapsed = time.monotonic() - self.started
        metrics.update(stats)
        metrics["train/idle_ratio"] = self.idle_s / max(1e-9, elapsed)
        metrics["train/effective_tokens_per_s"] = self.trained_tokens / max(1e-9, elapsed)
        metrics["train/wall_time_s"] = elapsed
        metrics.update(commit_parts)  # train/commit_s and its parts
        return elapsed

    def status(
        self, version: int, stats: dict[str, float], metrics: dict[str, float], elapsed: float
    ) -> dict[str, Any]:
        """The fields of the train status document every step refreshes."""
        return {
            "state": "running",
            "step": version,
            "reward_mean": stats["reward/mean"],
            "staleness_mean": stats["staleness/mean"],
            "trained_tokens_per_s": metrics["train/effective_tokens_per_s"],
            "idle_ratio": metrics["train/idle_ratio"],
            "wall_time_s": elapsed,
            **self.watch.status(),
        }
