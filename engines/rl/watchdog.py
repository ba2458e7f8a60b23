"""The mismatch watchdog: each training step's health signals, judged against fixed
limits and against the run's own recent history before the step's update is applied.

Why: a run that collapses from train–inference mismatch or staleness announces it. The
k3 estimate of KL(π_behav‖π_prox), the log-perplexity gap between engine and trainer and
the gradient norm climb for tens of steps before reward falls ("When Speed Kills
Stability"). A watchdog that reads them can warn, leave a batch out, or stop the run
while its last versions are still good.

Every signal is judged on its *badness*, a number that grows as the step gets worse: the
metric itself, or 1 − ESS for the effective sample size (whose bad direction is down).
A signal fires on a step when

- its badness passes ``limit`` (an absolute bound, judged on every step) on this step
  and on the ``limit_steps`` − 1 steps before it, fired or not (1: this step alone), or
- the median badness of the last ``recent`` steps (this one included) is more than
  ``spike`` times the median of the ``window`` steps before them, and above ``floor``
  (judged once ``min_history`` earlier steps are known).

Why a short median and not one step, nor a short mean: on 21 healthy runs of Sluice
(the toy task and SmolLM2 on reasoning-gym, η 1 to 4), single steps rose up to 11x
(k3 KL), 7x (log-PPL gap), 17x (gradient norm) and 7x (1 − sequence ESS) over their
30-step median. A 5-step mean still lets one such step fire: a clean run's single k3 KL
step of 0.105 among steps of 0.003–0.02 lifted its 5-step mean to 8.5x. The median of
5 needs 3 of them high. On 31 healthy runs it rose at most 5.1x, 3.5x, 2.4x and 4.1x;
the default ratios (8, 5, 10, 6) sit above those, so a healthy run stays quiet while a
climb that lasts is caught on its third step. A step where a signal fired does not
enter that signal's history, so a climb is measured against the healthy baseline
instead of being absorbed into it.

Pure bookkeeping over plain floats; the train role decides what a firing does
(tasks/train/watchdog.py).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Literal

Action = Literal["warn", "skip", "stop"]
ACTIONS: tuple[Action, ...] = ("warn", "skip", "stop")


SIGNALS: dict[str, tuple[str, bool]] = {
    "kl_k3": ("mismatch/kl_k3", False),
    "log_ppl_gap": ("mismatch/log_ppl_abs_diff", False),
    "grad_norm": ("train/grad_norm", False),
    "ess": ("is/ess_sequence", True),
    "masked_fraction": ("is/masked_fraction", False),
}
"""Each signal's training metric, and whether its bad direction is down."""


@dataclass(frozen=True)
class SignalRule:
    """How one signal is judged (see the module docstring)."""

    name: str
    """Short name, used in logs, tags and metric names (``kl_k3``)."""
    metric: str
    """The training metric it reads (``mismatch/kl_k3``)."""
    limit: float | None = None
    """Absolute bound on the badness (None = none)."""
    limit_steps: int = 1
    """Steps in a row (this one included) that must pass `limit` before it fires."""
    spike: float | None = None
    """Ratio of the recent median badness to its rolling median that fires (None = none)."""
    floor: float = 0.0
    """The recent median badness must also exceed this for `spike` to fire."""
    action: Action = "warn"
    inverted: bool = False
    """Badness is 1 − value (a signal whose bad direction is down, like ESS)."""

    def badness(self, value: float) -> float:
        return 1.0 - value if self.inverted else value


def signal_rule(
    name: str,
    *,
    limit: float | None = None,
    limit_steps: int = 1,
    spike: float | None = None,
    floor: float = 0.0,
    action: Action = "warn",
) -> SignalRule:
    """The rule of a signal in `SIGNALS`, with `limit` and `floor` as a user states them:
    on the metric itself (for ESS, `limit` is its lowest allowed value and `floor` is on
    1 - ESS)."""
    metric, inverted = SIGNALS[name]
    if limit is not None and inverted:
        limit = 1.0 - limit
    if limit_steps < 1:
        raise ValueError(f"limit_steps must be at least 1, got {limit_steps}")
    return SignalRule(name, metric, limit, limit_steps, spike, floor, action, inverted)


@dataclass(frozen=True)
class Firing:
    """One signal that fired on one step."""

    signal: str
    step: int
    """The policy version the step would have produced."""
    value: float
    """The metric as logged (not its badness)."""
    action: Action
    reason: str
    """One line: what passed which bound."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class MismatchWatchdog:
    """Judges a step's signals; remembers each signal's history of healthy steps."""

    def __init__(
        self,
        rules: Iterable[SignalRule],
        *,
        recent: int = 5,
        window: int = 30,
        min_history: int = 10,
    ):
        if recent < 1 or window < 1 or min_history < 1:
            raise ValueError("recent, window and min_history must be at least 1")
        self.rules = {rule.name: rule for rule in rules}
        self.recent, self.window, self.min_history = recent, window, min(min_history, window)
        self.history: dict[str, deque[float]] = {
            name: deque(maxlen=window + recent - 1) for name in self.rules
        }
        self.last: dict[str, deque[float]] = {
            name: deque(maxlen=rule.limit_steps - 1) for name, rule in self.rules.items()
        }
        """Each signal's badness on the steps just before, fired or not (for `limit_steps`)."""

    def rules_for(self, metrics: Mapping[str, float]) -> list[SignalRule]:
        return [r for r in self.rules.values() if _finite(metrics.get(r.metric))]

    def judge(self, metrics: Mapping[str, float], step: int) -> list[Firing]:
        """The signals in `metrics` that fire on `step` (nothing is remembered)."""
        firings = []
        for rule in self.rules_for(metrics):
            value = float(metrics[rule.metric])
            reason = self._reason(rule, rule.badness(value))
            if reason is not None:
                firings.append(Firing(rule.name, step, value, rule.action, reason))
        return firings

    def record(self, metrics: Mapping[str, float], fired: Iterable[str] = ()) -> None:
        """Remember the signals of a judged step: in the history unless they fired."""
        skip = set(fired)
        for rule in self.rules_for(metrics):
            badness = rule.badness(float(metrics[rule.metric]))
            self.last[rule.name].append(badness)
            if rule.name not in skip:
                self.history[rule.name].append(badness)

    def seed(self, metric: str, values: Iterable[float]) -> None:
        """Resume a signal's history from the values a run logged before a restart."""
        for rule in self.rules.values():
            if rule.metric == metric:
                history = self.history[rule.name]
                history.extend(rule.badness(v) for v in values if _finite(v))

    def _reason(self, rule: SignalRule, badness: float) -> str | None:
        shown = _shown(rule, badness)
        before = self.last[rule.name]
        if (
            rule.limit is not None
            and badness > rule.limit
            and len(before) == before.maxlen
            and all(b > rule.limit for b in before)
        ):
            bound = _shown(rule, rule.limit)
            side = "below" if rule.inverted else "above"
            row = f" for {rule.limit_steps} steps in a row" if rule.limit_steps > 1 else ""
            return f"{rule.metric} = {shown} is {side} its limit {bound}{row}"
        if rule.spike is None:
            return None
        earlier = list(self.history[rule.name])
        lately = earlier[len(earlier) - (self.recent - 1) :] if self.recent > 1 else []
        baseline = earlier[: len(earlier) - len(lately)][-self.window :]
        if len(baseline) < self.min_history:
            return None
        now = statistics.median([*lately, badness])
        median = statistics.median(baseline)
        if now <= rule.floor or now <= rule.spike * median:
            return None
        what = f"1 - {rule.metric}" if rule.inverted else rule.metric
        ratio = f"{now / median:.1f}x" if median > 0 else "infinitely"
        return (
            f"{what}: median of the last {len(lately) + 1} steps {now:.4g} is {ratio} "
            f"its median {median:.4g} over the {len(baseline)} steps before "
            f"(limit {rule.spike:g}x)"
        )


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _shown(rule: SignalRule, badness: float) -> str:
    return f"{rule.badness(badness) if rule.inverted else badness:.4g}"


def blocking(firings: Iterable[Firing]) -> Firing | None:
    """The firing that decides a step, if any does: a `stop` before a `skip`."""
    ranked = sorted(
        (f for f in firings if f.action != "warn"), key=lambda f: ACTIONS.index(f.action)
    )
    return ranked[-1] if ranked else None
