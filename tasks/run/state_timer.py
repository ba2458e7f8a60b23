"""Where a role's wall time goes: exclusive states whose seconds add up to the wall.

A role's main loop is in one state at a time (`generate`, `score`, `wait_data`,
`proximal`, `train`, `publish`, `reload`, `idle`, `write`, `start`, ...): entering a
state ends the one before, so no second is counted twice and none is lost. `other` is
whatever is not inside a named state, computed as the wall time less the named states,
so the states sum to the wall time exactly, by construction, not by a tolerance. A
large `other` says the loop spends time nobody named.

The state is what the role's own loop waits on: the rollout role's loop is in
`generate` while it awaits in-flight groups, though the servers generate under its
`reload` too. Work on a role's background thread (hashing, writing, uploading,
committing) is outside the sum: it is reported as that thread's busy and CPU seconds
and as the lag from a job's submission to its end (`tasks/run/threads.py`). Process CPU
seconds are reported beside the wall, with a check that they stay within the cores the
process may run on (more means the clock or the accounting is wrong).

Pure Python: the clocks are injectable, so tests drive it by hand.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

log = logging.getLogger("sluice")

OTHER = "other"
"""Whatever time is not inside a named state."""
CPU_SLACK_S = 0.05
"""Process CPU seconds may exceed cores x wall by this much before it counts as a
violation: the CPU clock ticks coarser than the wall clock on some systems."""


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS: no affinity, every core
        return os.cpu_count() or 1


class StateTimer:
    """Exclusive states of one role's time since the timer started.

    `enter(state)` ends the current state and starts `state`; `state(name)` is the
    same as a context that returns to the state before on exit. `totals()` gives every
    state's seconds since the start (including `other`), `lap()` the same since the
    last lap: one training step's timeline. `move()` re-labels seconds a state held
    when a part of it was measured inside (the π_prox pass inside a training step).
    """

    def __init__(
        self,
        states: Sequence[str] = (),
        initial: str = OTHER,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
        cores: int | None = None,
    ) -> None:
        self.states = tuple(states)
        """States reported even before the role first enters them (at 0 s)."""
        self._clock = clock
        self._cpu_clock = cpu_clock
        self.cores = cores or usable_cores()
        self.started = clock()
        self._cpu_started = self._lap_cpu = cpu_clock()
        self.current = initial
        """The state the role is in now (`initial` at the start: a role's setup)."""
        self._since = self.started
        self._named: dict[str, float] = {}
        self._lap_at = self.started
        self._lap_named: dict[str, float] = {}
        self.cpu_violations = 0
        """How many checks found process CPU above cores x wall."""

    def enter(self, state: str) -> str:
        """End the current state and start `state` (`other`: no named state); returns
        the state that ended."""
        now = self._clock()
        previous = self.current
        if previous != OTHER:
            self._add(previous, now - self._since)
        self.current, self._since = state, now
        return previous

    @contextmanager
    def state(self, name: str) -> Iterator[None]:
        """`name` for the block, then back to the state before it."""
        previous = self.enter(name)
        try:
            yield
        finally:
            self.enter(previous)

    def move(self, source: str, target: str, seconds: float) -> float:
        """Re-label up to `seconds` of `source`'s time as `target`'s (no more than
        `source` held this lap, so the lap's states stay non-negative); returns how much
        moved. The sum is unchanged."""
        if seconds <= 0 or source == target or OTHER in (source, target):
            return 0.0
        moved = min(seconds, self._lap_named.get(source, 0.0))
        if moved <= 0:
            return 0.0
        for named in (self._named, self._lap_named):
            named[source] -= moved
            named[target] = named.get(target, 0.0) + moved
        return moved

    def _add(self, state: str, seconds: float) -> None:
        self._named[state] = self._named.get(state, 0.0) + seconds
        self._lap_named[state] = self._lap_named.get(state, 0.0) + seconds

    def _open(self, now: float) -> dict[str, float]:
        """The current state's seconds so far, not yet added."""
        return {self.current: now - self._since} if self.current != OTHER else {}

    def _with_other(
        self, named: dict[str, float], open_: dict[str, float], wall: float
    ) -> dict[str, float]:
        seconds = {state: 0.0 for state in self.states}
        seconds.update(named)
        for state, s in open_.items():
            seconds[state] = seconds.get(state, 0.0) + s
        seconds[OTHER] = wall - sum(seconds.values())
        return seconds

    def totals(self) -> tuple[dict[str, float], float]:
        """(each state's seconds since the start, `other` included; the wall seconds
        since the start). The seconds sum to the wall."""
        now = self._clock()
        wall = now - self.started
        return self._with_other(self._named, self._open(now), wall), wall

    def lap(self) -> tuple[dict[str, float], float]:
        """(each state's seconds since the last lap, `other` included; the lap's wall
        seconds), and a new lap starts. The seconds sum to the lap's wall."""
        now = self._clock()
        wall = now - self._lap_at
        seconds = self._with_other(self._lap_named, self._open(now), wall)
        if self.current != OTHER:  # the open state's time so far closes with this lap
            self._named[self.current] = self._named.get(self.current, 0.0) + now - self._since
            self._since = now
        self._lap_at, self._lap_named = now, {}
        return seconds, wall

    def share(self, state: str) -> float:
        """`state`'s share of the wall since the start (0 before any time passed)."""
        seconds, wall = self.totals()
        return seconds.get(state, 0.0) / wall if wall > 0 else 0.0

    def cpu_s(self) -> float:
        """Process CPU seconds (every thread) since the timer started."""
        return self._cpu_clock() - self._cpu_started

    def check_cpu(self) -> tuple[float, float, bool]:
        """(process CPU seconds, wall seconds, whether CPU stays within cores x wall),
        since the start."""
        cpu, wall = self.cpu_s(), self._clock() - self.started
        return cpu, wall, self._within_cores(cpu, wall)

    def _within_cores(self, cpu: float, wall: float) -> bool:
        """Whether `cpu` seconds fit in `wall` on this process's cores. A violation is
        counted and logged once: a clock is wrong or the process ran on more cores than
        it may use, and the time split cannot be trusted."""
        within = cpu <= self.cores * wall + CPU_SLACK_S
        if not within:
            self.cpu_violations += 1
            if self.cpu_violations == 1:
                log.warning(
                    "process CPU %.2f s exceeds %d cores x %.2f s wall: the time split is "
                    "not to be trusted",
                    cpu,
                    self.cores,
                    wall,
                )
        return within

    def report(self, prefix: str = "time/") -> dict[str, float]:
        """For a status document: each state's seconds and share of the wall since the
        start, the wall, process CPU seconds and the cores they amount to."""
        seconds, wall = self.totals()
        cpu, _, _ = self.check_cpu()
        out: dict[str, float] = {}
        for state, s in sorted(seconds.items()):
            out[f"{prefix}{state}_s"] = s
            out[f"{prefix}{state}_frac"] = s / wall if wall > 0 else 0.0
        out[f"{prefix}wall_s"] = wall
        out[f"{prefix}cpu_s"] = cpu
        out[f"{prefix}cpu_cores"] = cpu / wall if wall > 0 else 0.0
        out[f"{prefix}cpu_over_cores"] = float(self.cpu_violations)
        return out

    def lap_metrics(self, prefix: str = "time/") -> dict[str, float]:
        """`lap()` as one step's metrics: each state's seconds and share of the step,
        the step's wall (`step_s`, which the seconds sum to), and the process CPU in it
        in cores (checked against the cores, like `check_cpu`)."""
        cpu_now = self._cpu_clock()
        seconds, wall = self.lap()
        cpu, self._lap_cpu = cpu_now - self._lap_cpu, cpu_now
        self._within_cores(cpu, wall)
        out: dict[str, float] = {}
        for state, s in sorted(seconds.items()):
            out[f"{prefix}{state}_s"] = s
            out[f"{prefix}{state}_frac"] = s / wall if wall > 0 else 0.0
        out[f"{prefix}step_s"] = wall
        out[f"{prefix}cpu_cores"] = cpu / wall if wall > 0 else 0.0
        out[f"{prefix}cpu_over_cores"] = float(self.cpu_violations)
        return out
