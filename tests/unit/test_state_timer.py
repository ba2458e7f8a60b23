"""A role's time split into exclusive states (tasks/run/state_timer.py): worked by hand
with a clock the test moves, then randomised against the invariant that the states
always add up to the wall; and the background thread's seconds, outside that sum."""

from __future__ import annotations

import random
import threading
import time

import pytest

from sluice.tasks.run.state_timer import OTHER, StateTimer
from sluice.tasks.run.threads import Background


class Clock:
    """A clock that moves only when told (seconds as exact binary fractions)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def timer_with(clock: Clock, cpu: Clock | None = None, **kwargs) -> StateTimer:
    return StateTimer(clock=clock, cpu_clock=cpu or Clock(), cores=2, **kwargs)


def test_entering_a_state_ends_the_one_before_and_other_is_the_unnamed_rest():
    clock = Clock()
    timer = timer_with(clock, states=("wait_data", "train", "publish"))
    clock.advance(1.5)  # before any state: other
    timer.enter("wait_data")
    clock.advance(2.0)
    timer.enter("train")  # ends wait_data after 2.0
    clock.advance(4.0)
    timer.enter(OTHER)
    clock.advance(0.25)
    timer.enter("wait_data")
    clock.advance(0.5)  # still open: counted up to now
    seconds, wall = timer.totals()
    # wait_data 2.0 + 0.5, train 4.0, publish never entered, other 1.5 + 0.25.
    assert seconds == {"wait_data": 2.5, "train": 4.0, "publish": 0.0, OTHER: 1.75}
    assert wall == 8.25 == sum(seconds.values())


def test_a_state_block_returns_to_the_state_before_it():
    clock = Clock()
    timer = timer_with(clock)
    timer.enter("generate")
    clock.advance(1.0)
    with timer.state("write"):
        clock.advance(0.5)
    assert timer.current == "generate"
    clock.advance(1.0)
    seconds, wall = timer.totals()
    assert seconds == {"generate": 2.0, "write": 0.5, OTHER: 0.0} and wall == 2.5


def test_a_state_block_ends_its_state_when_the_block_raises():
    clock = Clock()
    timer = timer_with(clock)
    with pytest.raises(RuntimeError), timer.state("train"):
        clock.advance(3.0)
        raise RuntimeError("step failed")
    clock.advance(1.0)
    assert timer.totals() == ({"train": 3.0, OTHER: 1.0}, 4.0)


def test_laps_split_the_wall_into_steps_and_an_open_state_is_cut_at_the_lap():
    clock = Clock()
    timer = timer_with(clock, states=("wait_data", "train"))
    timer.enter("wait_data")
    clock.advance(1.0)
    timer.enter("train")
    clock.advance(3.0)  # train is open at the lap: 3.0 here, the rest in the next lap
    first, first_wall = timer.lap()
    assert first == {"wait_data": 1.0, "train": 3.0, OTHER: 0.0} and first_wall == 4.0
    clock.advance(2.0)
    timer.enter(OTHER)
    clock.advance(0.5)
    second, second_wall = timer.lap()
    assert second == {"wait_data": 0.0, "train": 2.0, OTHER: 0.5} and second_wall == 2.5
    # The laps partition the whole: they add up to the totals state by state.
    totals, wall = timer.totals()
    assert totals == {s: first[s] + second[s] for s in totals} and wall == 6.5


def test_moving_a_measured_part_relabels_it_without_changing_the_sum():
    clock = Clock()
    timer = timer_with(clock, states=("proximal", "train"))
    with timer.state("train"):
        clock.advance(5.0)  # a training step; the trainer says 1.5 s of it was the π_prox pass
    assert timer.move("train", "proximal", 1.5) == 1.5
    # No more than the state holds this lap moves: the states never go negative.
    assert timer.move("train", "proximal", 9.0) == 3.5
    assert timer.move("train", "proximal", 1.0) == 0.0
    seconds, wall = timer.lap()
    assert seconds == {"proximal": 5.0, "train": 0.0, OTHER: 0.0} and wall == 5.0


def test_the_report_gives_seconds_and_shares_of_the_wall_and_cpu_in_cores():
    clock, cpu = Clock(), Clock()
    timer = timer_with(clock, cpu, states=("idle",))
    timer.enter("generate")
    clock.advance(3.0)
    cpu.advance(4.5)  # two threads busy most of the time: 1.5 cores
    timer.enter("idle")
    clock.advance(1.0)
    report = timer.report()
    assert report["time/generate_s"] == 3.0 and report["time/generate_frac"] == 0.75
    assert report["time/idle_s"] == 1.0 and report["time/idle_frac"] == 0.25
    assert report["time/other_s"] == 0.0 and report["time/wall_s"] == 4.0
    assert report["time/cpu_s"] == 4.5 and report["time/cpu_cores"] == 1.125
    assert report["time/cpu_over_cores"] == 0.0


def test_process_cpu_beyond_cores_times_wall_is_counted_and_logged_once(caplog):
    clock, cpu = Clock(), Clock()
    timer = timer_with(clock, cpu)  # 2 cores
    clock.advance(1.0)
    cpu.advance(2.0)  # exactly 2 cores x 1 s: within
    assert timer.check_cpu() == (2.0, 1.0, True)
    cpu.advance(1.0)  # 3 CPU seconds in 1 wall second on 2 cores: impossible
    with caplog.at_level("WARNING", logger="sluice"):
        assert timer.check_cpu() == (3.0, 1.0, False)
        timer.check_cpu()
    assert timer.cpu_violations == 2
    assert len([r for r in caplog.records if "exceeds 2 cores" in r.message]) == 1
    assert timer.report()["time/cpu_over_cores"] == 3.0


def test_states_always_add_up_to_the_wall_over_random_timelines():
    rng = random.Random(7)
    states = ("generate", "reload", "idle", "write")
    for _ in range(200):
        clock = Clock()
        timer = timer_with(clock, states=states)
        laps: list[dict[str, float]] = []
        spent = {s: 0.0 for s in (*states, OTHER)}  # what the script did, kept apart
        current = OTHER
        for _ in range(rng.randrange(1, 40)):
            step = rng.random()
            clock.advance(step)
            spent[current] += step
            action = rng.random()
            if action < 0.7:
                current = rng.choice((*states, OTHER))
                timer.enter(current)
            elif action < 0.85:
                lap, lap_wall = timer.lap()
                assert sum(lap.values()) == pytest.approx(lap_wall, abs=1e-9)
                assert min(lap.values()) >= -1e-9
                laps.append(lap)
            else:
                totals, wall = timer.totals()
                assert sum(totals.values()) == pytest.approx(wall, abs=1e-9)
        totals, wall = timer.totals()
        assert wall == pytest.approx(clock.now - 100.0)
        assert totals == pytest.approx(spent, abs=1e-9)
        last, _ = timer.lap()
        assert {s: sum(lap[s] for lap in [*laps, last]) for s in totals} == pytest.approx(
            totals, abs=1e-9
        )


def test_real_clocks_account_for_a_real_sleep():
    timer = StateTimer(states=("idle",))
    with timer.state("idle"):
        time.sleep(0.05)
    seconds, wall = timer.totals()
    assert seconds["idle"] >= 0.05 and seconds["idle"] <= wall
    assert sum(seconds.values()) == pytest.approx(wall, abs=1e-9)
    assert timer.check_cpu()[2]  # a sleeping process uses no more than its cores


def test_background_reports_its_busy_and_cpu_seconds_and_the_newest_jobs_lag():
    background = Background("test-bg")
    assert background.report() == {"background/busy_s": 0.0, "background/cpu_s": 0.0}
    release = threading.Event()
    background.submit(release.wait, 5.0)  # holds the worker: the next job queues behind it
    background.submit(sum, range(200_000))  # CPU work in the worker thread
    time.sleep(0.1)
    release.set()
    assert background.wait()[1] == sum(range(200_000))
    report = background.report()
    # The first job's 0.1 s blocked counts as busy (not CPU); the second waited behind it.
    assert report["background/busy_s"] >= 0.1
    assert 0.0 < report["background/cpu_s"] < report["background/busy_s"]
    assert report["background/lag_s"] >= 0.1
    background.close()


def test_a_failing_background_job_is_still_timed_and_its_error_surfaces():
    background = Background("test-bg")

    def fail() -> None:
        time.sleep(0.02)
        raise ValueError("upload failed")

    background.submit(fail)
    with pytest.raises(ValueError, match="upload failed"):
        background.wait()
    assert background.report()["background/busy_s"] >= 0.02
    background.close()


def test_a_steps_metrics_add_up_to_the_step_and_give_its_cpu_in_cores():
    clock, cpu = Clock(), Clock()
    timer = timer_with(clock, cpu, states=("wait_data", "train"))
    timer.enter("wait_data")
    clock.advance(0.5)
    timer.enter("train")
    clock.advance(1.5)
    cpu.advance(3.0)  # one and a half cores busy through the step
    first = timer.lap_metrics()
    assert first == {
        "time/other_s": 0.0, "time/other_frac": 0.0,
        "time/train_s": 1.5, "time/train_frac": 0.75,
        "time/wait_data_s": 0.5, "time/wait_data_frac": 0.25,
        "time/step_s": 2.0, "time/cpu_cores": 1.5, "time/cpu_over_cores": 0.0,
    }  # fmt: skip
    clock.advance(1.0)  # still training: the next step's, and its CPU the next step's too
    second = timer.lap_metrics()
    assert (second["time/train_s"], second["time/step_s"], second["time/cpu_cores"]) == (
        1.0,
        1.0,
        0.0,
    )


def test_a_timer_may_start_in_a_named_state():
    clock = Clock()
    timer = timer_with(clock, states=("start", "train"), initial="start")
    clock.advance(2.0)  # the role's setup
    timer.enter("train")
    clock.advance(1.0)
    assert timer.totals() == ({"start": 2.0, "train": 1.0, OTHER: 0.0}, 3.0)


def run_pipeline(generate_s: float, train_s: float, steps: int = 8) -> tuple[dict, dict]:
    """A rollout thread and a trainer thread under the real staleness gate (B = 2, η = 1),
    each timed by its own StateTimer as the roles are: the rollout `generate`s a group
    in `generate_s` or sits `idle` while the gate is closed; the trainer waits for its
    batch (`wait_data`), then `train`s for `train_s` and publishes the next version at
    once. Returns each side's time shares at the end (their `time/<state>_frac`)."""
    from sluice.engines.rl.staleness import StalenessGate

    B = 2
    gate = StalenessGate(B, max_staleness=1)
    done_groups: list[int] = []
    version = [0]
    lock = threading.Condition()
    stop = threading.Event()
    rollout = StateTimer(("generate", "idle"))
    trainer = StateTimer(("wait_data", "train"))

    def generate() -> None:
        n = 0
        while not stop.is_set():
            ticket = gate.try_start(version[0])
            if ticket is None:
                rollout.enter("idle")
                time.sleep(0.001)
                continue
            rollout.enter("generate")
            time.sleep(generate_s)
            with lock:
                done_groups.append(n)
                lock.notify_all()
            gate.finish(ticket)
            n += 1

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        for step in range(steps):
            trainer.enter("wait_data")
            with lock:
                lock.wait_for(lambda step=step: len(done_groups) >= (step + 1) * B, timeout=30)
            trainer.enter("train")
            time.sleep(train_s)
            version[0] = step + 1
    finally:
        stop.set()
        worker.join()
    shares = []
    for timer in (rollout, trainer):
        report = timer.report()
        fracs = {k: v for k, v in report.items() if k.endswith("_frac")}
        assert sum(fracs.values()) == pytest.approx(1.0)
        shares.append(fracs)
    return shares[0], shares[1]


def test_a_training_bound_pipeline_never_reports_both_sides_idle():
    """verl #6693: its rollouter's idle time was not accumulated, so a run bound by
    training could show the rollouter and the trainer idle together. Timed by state, a
    training-bound pipeline shows the trainer busy and the rollout held by the gate."""
    rollout, trainer = run_pipeline(generate_s=0.002, train_s=0.04)
    assert trainer["time/train_frac"] > 0.6 and trainer["time/wait_data_frac"] < 0.3
    assert rollout["time/idle_frac"] > 0.6
    assert not (trainer["time/wait_data_frac"] > 0.5 and rollout["time/idle_frac"] > 0.5)


def test_a_generation_bound_pipeline_shows_the_trainer_waiting_and_the_rollout_busy():
    rollout, trainer = run_pipeline(generate_s=0.02, train_s=0.002)
    assert trainer["time/wait_data_frac"] > 0.6
    assert rollout["time/generate_frac"] > 0.6 and rollout["time/idle_frac"] < 0.3


def test_a_states_share_counts_a_span_still_open():
    clock = Clock()
    timer = timer_with(clock, states=("idle",))
    assert timer.share("idle") == 0.0  # no time yet
    clock.advance(1.0)
    timer.enter("idle")
    clock.advance(3.0)  # idle still: a ratio that waited for the span to end would say 0
    assert timer.share("idle") == 0.75
