"""Both train roles keep their step's books in `StepBook` (tasks/train/steps.py): the
step runs under the watchdog's guard, and one rule counts trained tokens."""

from __future__ import annotations

from typing import Any

from sluice.infra.config.run import load_config
from sluice.tasks.run.state_timer import StateTimer
from sluice.tasks.train.steps import StepBook


class RecordingTrainer:
    """Answers `train_step` with fixed metrics and remembers the guard it was given."""

    def __init__(self, metrics: dict[str, float]) -> None:
        self.metrics = metrics
        self.guards: list[Any] = []

    def train_step(self, samples: list, guard: Any = None) -> dict[str, float]:
        self.guards.append(guard)
        return dict(self.metrics)


def timer() -> StateTimer:
    return StateTimer(("start", "train", "proximal"), initial="train")


def test_the_step_runs_under_the_watchdogs_guard_when_the_watchdog_is_on():
    book = StepBook(load_config(None), "mlflow-run")
    trainer = RecordingTrainer({"train/trained_tokens": 10.0, "train/applied_minibatches": 1.0})
    book.train(trainer, ["a sample"], 1, timer())
    assert callable(trainer.guards[0])

    off = StepBook(load_config(None, ["trainer.watchdog.enabled=false"]), "mlflow-run")
    trainer = RecordingTrainer({"train/trained_tokens": 10.0, "train/applied_minibatches": 1.0})
    off.train(trainer, ["a sample"], 1, timer())
    assert trainer.guards == [None]


def test_only_a_batch_with_an_applied_minibatch_counts_its_tokens():
    book = StepBook(load_config(None), "mlflow-run")
    for applied, tokens in ((2.0, 30.0), (0.0, 50.0), (1.0, 20.0)):
        metrics = {"train/trained_tokens": tokens, "train/applied_minibatches": applied}
        book.settle(metrics, None, [], None)
    # An empty batch logs no metrics and trains nothing.
    book.settle({}, None, [], None)
    assert book.trained_tokens == 30.0 + 20.0


def test_the_rates_divide_the_totals_by_the_seconds_since_the_start():
    book = StepBook(load_config(None), "mlflow-run")
    book.start(0)
    book.started -= 10.0  # ten seconds ago
    book.trained_tokens, book.idle_s = 500.0, 2.5
    metrics: dict[str, float] = {}
    stats = {"reward/mean": 0.5, "staleness/mean": 0.0}
    elapsed = book.rates(metrics, stats, {"train/commit_s": 1.0})
    assert 10.0 <= elapsed < 11.0
    assert metrics["train/effective_tokens_per_s"] == 500.0 / metrics["train/wall_time_s"]
    assert metrics["train/idle_ratio"] == 2.5 / metrics["train/wall_time_s"]
    assert metrics["reward/mean"] == 0.5 and metrics["train/commit_s"] == 1.0
    status = book.status(3, stats, metrics, elapsed)
    assert status["step"] == 3 and status["idle_ratio"] == metrics["train/idle_ratio"]
    assert status["watchdog_firings"] == 0
