"""Measured runs and step profiles built by hand, for the planner's tests."""

from __future__ import annotations

from dataclasses import replace

from sluice.engines.inference.profile import StepProfile
from sluice.engines.planner.calibrate import RunMeasurements, TrainStep


def measured_profile(a: float, r: float, d: float, points: list[tuple[int, int]]) -> StepProfile:
    """A profile of decode steps that took exactly a + r*rows + d*context each."""
    profile = StepProfile()
    for rows, context in points:
        profile.add_decode(rows, context, a + r * rows + d * context)
    return profile


def measured_run(mode: str, threads: int, a: float, k: float, **changes: object) -> RunMeasurements:
    """A run on `threads` per role whose decode steps cost `a` each and whose trainer
    costs `k` seconds a token (nothing else), with `changes` on top."""
    profile = measured_profile(a, 0.0, 0.0, [(4, 100), (8, 200), (16, 400)] * 10)
    base = RunMeasurements(
        run_id=f"{mode}{threads}",
        mode=mode,
        rollout_threads=threads,
        train_threads=threads,
        prompts_per_batch=4,
        group_size=2,
        max_staleness=1,
        interruptible=True,
        publish_every=1,
        slots_per_server=16,
        max_tokens_per_micro_batch=4096,
        response_lengths=(5, 10),
        prompt_lengths=(3,),
        profile=profile,
        train_steps=tuple(TrainStep(k * n, n, 1) for n in (1000, 2000, 3000)),
        steps=3,
        wall_s=3.0,
        trainer_idle_ratio=0.5,
        trained_tokens_per_s=1000.0,
        rollout_busy_s=a * profile.decode_steps,  # no serving overhead
        weight_updates=2,
        update_time_s=0.2,
        commit_s=0.02,
        rollout_poll_s=0.5,
        reward_poll_s=0.25,
        trainer_poll_s=0.05,
    )
    return replace(base, **changes)
