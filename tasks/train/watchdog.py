"""What the train role does with the mismatch watchdog (sluice.engines.rl.watchdog).

Each step is judged before its update is applied: the π_prox pass's signals (k3 KL,
log-PPL gap, ESS, masked fraction) before any weight changes, and each optimizer step's
gradient norm before it is taken (torch backend; a split Megatron trainer is judged
after its step). A firing then does what `trainer.watchdog` says:

- ``warn``: one log line, an MLflow metric (``watchdog/<signal>`` = 1 on that step), a
  tag on the next published version (``watchdog.<signal>``), and an entry in the train
  status, which the flow turns into a Prefect event (``sluice.watchdog.fired``) that an
  automation can route.
- ``skip``: all of that, and the batch is not applied. The version still moves on, with
  the previous weights, so batch k stays the k-th batch and the staleness gate's
  accounting is unchanged; its groups are acked and counted as skipped, not lost. A
  gradient-norm firing leaves out that optimizer step and the rest of the batch; the
  minibatches before it stay applied (``train/applied_minibatches``).
- ``stop``: the step is not published, the commit in flight finishes, and the role ends
  with `EXIT_WATCHDOG` and one line naming the signal and the last good version, which
  the flow raises as `WatchdogStopped`. `sluice train --resume` continues from that version.

A resumed run takes up each signal's history from the metrics it logged before.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from sluice.engines.rl.trainer import StepGuard
from sluice.engines.rl.watchdog import Firing, MismatchWatchdog, blocking, signal_rule
from sluice.infra.config.run import RunConfig
from sluice.infra.tracking import get_metric_history

log = logging.getLogger("sluice.train")

GRAD_NORM_OF_STEP = "train/grad_norm_max"
"""The step metric whose value enters the gradient norm's history (its largest step)."""
KEPT_FIRINGS = 20
"""Firings the train status lists (the newest); the counts cover all of them."""


def build_watchdog(config: RunConfig) -> MismatchWatchdog | None:
    """The watchdog `trainer.watchdog` describes; None when it is off."""
    cfg = config.trainer.watchdog
    if not cfg.enabled:
        return None
    rules = [
        signal_rule(name, **signal.rule_settings(cfg.action))
        for name, signal in cfg.signals().items()
    ]
    return MismatchWatchdog(
        rules, recent=cfg.recent, window=cfg.window, min_history=cfg.min_history
    )


def _step_signals(metrics: dict[str, float]) -> dict[str, float]:
    """A finished step's metrics, with its largest gradient norm as the norm to judge."""
    judged = dict(metrics)
    if GRAD_NORM_OF_STEP in metrics:
        judged["train/grad_norm"] = metrics[GRAD_NORM_OF_STEP]
    return judged


class StepWatch:
    """The watchdog of one train role: judging, counting, and what a firing leaves."""

    def __init__(self, config: RunConfig, mlflow_run_id: str):
        self.config = config
        self.mlflow_run_id = mlflow_run_id
        self.watchdog = build_watchdog(config)
        self.guards = config.trainer.world_size == 1
        """Whether the trainer takes a `StepGuard` (a split trainer is judged after its step)."""
        self.counts: Counter[str] = Counter()
        self.kept: list[dict[str, Any]] = []
        self.skipped_groups = 0
        self._tags: dict[str, str] = {}
        self._step_firings: list[Firing] = []

    def resume(self, version: int) -> None:
        """Take up each signal's history from what the run logged up to `version`."""
        if self.watchdog is None or version == 0:
            return
        uri = self.config.tracking.uri
        for rule in self.watchdog.rules.values():
            key = GRAD_NORM_OF_STEP if rule.metric == "train/grad_norm" else rule.metric
            history = sorted(get_metric_history(uri, self.mlflow_run_id, key))
            fired = {s for s, _ in get_metric_history(uri, self.mlflow_run_id, metric(rule.name))}
            kept = [v for s, v in history if s <= version and s not in fired]
            self.watchdog.seed(rule.metric, kept)

    def guard(self, step: int) -> StepGuard | None:
        """What `train_step` asks before it changes the weights for `step`."""
        self._step_firings = []
        if self.watchdog is None or not self.guards:
            return None
        watchdog = self.watchdog

        def allow(signals: dict[str, float]) -> bool:
            judged = {f.signal for f in self._step_firings}
            new = [f for f in watchdog.judge(signals, step) if f.signal not in judged]
            self._step_firings.extend(new)
            return blocking(new) is None

        return allow

    def settle(self, metrics: dict[str, float], step: int) -> tuple[list[Firing], Firing | None]:
        """After `step`'s train_step: every firing of the step (those the guard did not
        judge are judged now), each logged and counted, and the one that decides the
        step (a stop or a skip), if any. The step's healthy signals enter the history."""
        if self.watchdog is None:
            return [], None
        signals = _step_signals(metrics)
        judged = {f.signal for f in self._step_firings}
        firings = self._step_firings + [
            f for f in self.watchdog.judge(signals, step) if f.signal not in judged
        ]
        self._step_firings = []
        self.watchdog.record(signals, fired=[f.signal for f in firings])
        for firing in firings:
            self.note(firing)
        return firings, blocking(firings)

    def note(self, firing: Firing) -> None:
        """Log, count and keep one firing (the status lists it; the flow emits it)."""
        log.warning(
            "watchdog: %s fired at step %d (%s): %s",
            firing.signal,
            firing.step,
            firing.action,
            firing.reason,
        )
        self.counts[firing.signal] += 1
        self._tags[f"watchdog.{firing.signal}"] = f"step {firing.step} ({firing.action})"
        self.kept = [*self.kept, firing.as_dict()][-KEPT_FIRINGS:]

    @staticmethod
    def step_metrics(firings: list[Firing]) -> dict[str, float]:
        return {metric(f.signal): 1.0 for f in firings}

    def take_tags(self) -> dict[str, str]:
        """Tags for the version being published: the firings since the last one."""
        tags, self._tags = self._tags, {}
        return tags

    def status(self) -> dict[str, Any]:
        return {
            "watchdog_firings": sum(self.counts.values()),
            "watchdog_by_signal": dict(self.counts),
            "watchdog_last": self.kept,
            "groups_skipped": self.skipped_groups,
        }


def metric(signal: str) -> str:
    """The MLflow metric a firing of `signal` logs (1.0 at the step it fired on)."""
    return f"watchdog/{signal}"


def stop_line(firing: Firing, last_good: int) -> str:
    """The one line a `stop` leaves (the role's log; the flow's error)."""
    return (
        f"{firing.signal} fired at step {firing.step}: {firing.reason}; the last good "
        f"version is {last_good} (version {firing.step} was not published)"
    )
