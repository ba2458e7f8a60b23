"""The flow's progress line: steps, elapsed time and an ETA from the roles' status documents.

Status documents are given as the train role writes them (`step`, `updated_at`, and
`wall_time_s` on every document written right after a step); nothing is polled.
"""

from __future__ import annotations

import threading
import time

import pytest

from sluice.flows.role_watch import (
    StepPace,
    format_duration,
    nap,
    progress_line,
    seconds_left,
)
from sluice.infra.outages import within


def step_status(step: int, updated_at: float) -> dict:
    return {"state": "running", "step": step, "updated_at": updated_at, "wall_time_s": 1.0}


def test_seconds_left_follows_the_pace_of_the_steps_done():
    # 20 steps in 200 s is 10 s a step; 50 steps to go.
    assert seconds_left(20, 200.0, 50) == 500.0
    assert seconds_left(20, 200.0, 0) == 0.0
    assert seconds_left(0, 0.0, 50) is None


def test_durations_read_as_hours_minutes_seconds():
    assert format_duration(7.4) == "7s"
    assert format_duration(500) == "8m20s"
    assert format_duration(3900) == "1h05m"


def test_progress_line_shows_elapsed_time_and_eta_since_the_first_step():
    pace = StepPace()
    # Start-up write (no step timed yet), then steps 11 and 31 done 200 s apart.
    pace.observe({"state": "running", "step": 10, "updated_at": 1_000.0})
    pace.observe(step_status(11, 1_010.0))
    latest = step_status(31, 1_210.0) | {"reward_mean": 0.25}
    pace.observe(latest)
    # The role's closing write repeats the last step later: it is not a faster step.
    pace.observe(latest | {"state": "finished", "updated_at": 1_300.0})

    line = progress_line({"train": latest}, 81, elapsed_s=300.0, eta_s=pace.eta_s(81))

    # 20 steps in 200 s: 10 s a step, 50 steps left.
    assert line.startswith("step 31/81 | elapsed 5m00s | ETA 8m20s |")
    assert "reward 0.250" in line


def test_eta_waits_for_a_second_timed_step():
    pace = StepPace()
    pace.observe({"step": 0, "updated_at": 1_000.0})
    pace.observe(step_status(1, 1_005.0))

    assert pace.eta_s(80) is None
    assert "ETA -" in progress_line({"train": {"step": 1}}, 80, elapsed_s=5.0, eta_s=None)


def test_eta_of_a_resumed_run_ignores_the_stale_status_and_the_pause():
    pace = StepPace()
    # The run before the resume left its document at step 37, an hour earlier.
    pace.observe(step_status(37, 1_000.0))
    # The resumed trainer restarts from committed version 35 and steps every 4 s.
    pace.observe({"step": 35, "updated_at": 4_600.0})
    for step in range(36, 41):
        pace.observe(step_status(step, 4_600.0 + 4 * (step - 35)))

    # Steps 36..40 took 16 s for 4 steps: 4 s a step, 40 steps left.
    assert pace.eta_s(80) == 160.0


def test_a_read_that_hangs_is_given_up_on_and_one_that_answers_or_raises_is_not() -> None:
    release = threading.Event()
    began = time.monotonic()
    assert within(lambda: release.wait(30), 0.2) is None  # a hung store
    assert time.monotonic() - began < 5
    release.set()
    assert within(lambda: {"train": {"step": 3}}, 5) == {"train": {"step": 3}}
    with pytest.raises(KeyError, match="status"):
        within(lambda: {}["status"], 5)


class EndsLater:
    """A role task's future (the two calls `finished` makes) that ends when told."""

    def __init__(self) -> None:
        self.ended = threading.Event()

    def wait(self, timeout: float) -> None:
        self.ended.wait(timeout)

    @property
    def state(self) -> EndsLater:
        return self

    def is_final(self) -> bool:
        return self.ended.is_set()


def test_the_watch_wakes_when_a_role_ends_not_at_its_next_tick() -> None:
    running, ending = EndsLater(), EndsLater()
    threading.Timer(0.3, ending.ended.set).start()
    began = time.monotonic()
    nap({"rollout": running, "reward": ending}, 30.0, slice_s=0.05)
    assert 0.3 <= time.monotonic() - began < 5
    began = time.monotonic()  # nothing ends: the whole pause
    nap({"rollout": running, "reward": ending}, 0.3, slice_s=0.05)
    assert time.monotonic() - began >= 0.3
