"""The planner's calibration, datasheet costs and recommendation, on hand-worked numbers."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from sluice.engines.inference.profile import StepProfile
from sluice.engines.planner.calibrate import (
    TrainStep,
    calibrate,
    fit_decode,
    fit_prefill,
    fit_train,
    layout_of,
)
from sluice.engines.planner.costs import CostModel, Layout, Workload
from sluice.engines.planner.hardware import (
    GPUS,
    MODELS,
    Efficiency,
    gpu_costs,
    kv_slots,
    with_efficiency,
)
from sluice.engines.planner.search import Candidate, async_layouts, recommend
from sluice.engines.planner.simulate import simulate
from tests.unit.planner_runs import measured_profile, measured_run


def test_decode_fit_recovers_the_line_it_was_given() -> None:
    # t = 1 ms + 20 µs/row + 5 ns/context token, at three independent points.
    profile = measured_profile(1e-3, 2e-5, 5e-9, [(1, 100), (8, 400), (32, 9000), (16, 1000)])
    a, r, d = fit_decode(profile)
    assert (a, r, d) == pytest.approx((1e-3, 2e-5, 5e-9), rel=1e-6)


def test_decode_fit_drops_a_term_that_would_be_negative() -> None:
    # Context proportional to rows (collinear) with a falling cost per context token:
    # the unconstrained fit tips d below zero; the constrained one keeps a, r >= 0.
    profile = StepProfile()
    for rows, seconds in [(1, 0.0010), (2, 0.0011), (4, 0.0013), (8, 0.0017)]:
        profile.add_decode(rows, rows * 10 + (1 if rows == 8 else 0), seconds)
    a, r, d = fit_decode(profile)
    assert min(a, r, d) >= 0
    # Without d: t = 0.9 ms + 0.1 ms/row exactly.
    assert (a, r) == pytest.approx((0.0009, 0.0001), rel=1e-3)


def test_prefill_fit_separates_the_pass_from_its_tokens() -> None:
    # t = 0.5 ms a pass + 40 µs a token: 20 tokens 1.3 ms, 2,000 tokens 80.5 ms; a pass
    # that only copies cached prompts (0 tokens) 0.5 ms.
    profile = StepProfile()
    for tokens in (20, 2000, 0, 20):
        profile.add_prefill(tokens, 0.0005 + 4e-5 * tokens)
    assert fit_prefill(profile) == pytest.approx((0.0005, 4e-5))
    # A profile without the per-pass sums (an older run) gives the mean per token.
    old = StepProfile.from_dict({**profile.as_dict(), "prefill_xx": [0.0, 0.0]})
    assert fit_prefill(old) == pytest.approx((0.0, old.prefill_s / old.prefill_tokens))
    assert fit_prefill(StepProfile()) == (0.0, 0.0)


def test_train_fit_separates_per_step_and_per_token_costs() -> None:
    # t = 0.1 s + 2 µs/token at 10k and 30k tokens: 0.12 and 0.16 s.
    steps = [TrainStep(0.12, 10_000, 1), TrainStep(0.16, 30_000, 1), TrainStep(0.14, 20_000, 1)]
    assert fit_train(steps) == pytest.approx((0.1, 0.0, 2e-6))
    # One token count: only the mean per token is known.
    assert fit_train([TrainStep(0.2, 1000, 1)] * 3) == pytest.approx((0.0, 0.0, 2e-4))


def test_runs_on_one_and_two_devices_fit_the_scaling_exponents() -> None:
    # Async on 1 thread: 1 ms a decode step, 4 µs a token. Sync on 2 threads: decode
    # 1/2**0.5 as long (exponent 0.5), training half as long (exponent 1).
    one = measured_run("async", 1, 1e-3, 4e-6)
    two = measured_run("sync", 2, 1e-3 / math.sqrt(2), 2e-6, generate_s_per_step=0.1)
    costs = calibrate([one, two]).costs
    assert costs.decode_scaling == pytest.approx(0.5)
    assert costs.train_scaling == pytest.approx(1.0)
    # Per-device costs come from the one-thread run.
    assert costs.decode_step_s == pytest.approx(1e-3)
    assert costs.train_token_s == pytest.approx(4e-6)
    # 2 updates in 0.2 s; commit 20 ms + half of a 0.5 s poll; half of 0.25 + 0.05.
    assert costs.weight_load_s == pytest.approx(0.1)
    assert costs.publish_s == pytest.approx(0.27)
    assert costs.reward_s == pytest.approx(0.15)


def test_one_run_keeps_the_assumed_exponents_and_says_so() -> None:
    calibration = calibrate([measured_run("async", 1, 1e-3, 4e-6)], decode_scaling=0.7)
    assert calibration.costs.decode_scaling == 0.7
    assert any("assumed" in note for note in calibration.notes)


def test_serving_overhead_is_charged_per_decode_step() -> None:
    run = measured_run("async", 1, 1e-3, 4e-6)
    busy = run.rollout_busy_s + 0.3  # 0.3 s outside the profiled steps
    costs = calibrate([replace(run, rollout_busy_s=busy)]).costs
    assert costs.decode_step_s == pytest.approx(1e-3 + 0.3 / run.profile.decode_steps)


def test_a_runs_layout_puts_its_threads_in_one_server() -> None:
    sync = layout_of(measured_run("sync", 2, 1e-3, 4e-6))
    assert (sync.mode, sync.devices, sync.servers) == ("sync", 2, 1)
    run = layout_of(measured_run("async", 1, 1e-3, 4e-6))
    assert (run.devices, run.rollout_devices, run.train_devices, run.max_staleness) == (2, 1, 1, 1)


def test_datasheet_costs_follow_the_roofline() -> None:
    eff = with_efficiency(Efficiency(), step_overhead_s=0.0)
    costs = gpu_costs(GPUS["h100"], MODELS["qwen2.5-1.5b"], eff)
    # 1.54e9 params × 2 bytes over 3.35 TB/s × 0.6 = 1.532 ms a step.
    assert costs.decode_step_s == pytest.approx(3.08e9 / (3.35e12 * 0.6))
    # K/V per token: 2 × 28 layers × 2 heads × 128 × 2 bytes = 28,672 bytes.
    assert MODELS["qwen2.5-1.5b"].kv_bytes_per_token == 28_672
    assert costs.decode_context_s == pytest.approx(28_672 / (3.35e12 * 0.6))
    # A trained token: 8 × 1.54e9 FLOPs over 989 TFLOPS × 0.35.
    assert costs.train_token_s == pytest.approx(8 * 1.54e9 / (989e12 * 0.35))
    # 80 GiB × 0.85 - 3.08 GB of weights, over 28,672 bytes × 4,000 tokens each.
    expected = int((80 * 2**30 * 0.85 - 3.08e9) / (28_672 * 4000))
    assert kv_slots(GPUS["h100"], MODELS["qwen2.5-1.5b"], 4000) == expected
    with pytest.raises(ValueError, match="unknown efficiency field"):
        with_efficiency(Efficiency(), mfu=0.5)


def test_recommend_takes_the_freshest_layout_within_two_percent_of_the_best() -> None:
    costs = CostModel(1e-3, 1e-5, 0.0, 1e-5, 0.01, 1e-5)
    workload = Workload((20, 40, 80), (10,), 4)
    base = Layout("async", 4, 1, 4, slots_per_server=32)
    layouts = async_layouts(base, etas=[0, 1, 4], batch_sizes=[4])
    assert sorted({(x.rollout_devices, x.max_staleness) for x in layouts}) == [
        (r, e) for r in (1, 2, 3) for e in (0, 1, 4)
    ]
    result = simulate(workload, costs, layouts[0], steps=4)
    fake = [
        Candidate(
            replace(base, rollout_devices=2, max_staleness=4),
            replace(result, trained_tokens_per_s=100.0),
        ),
        Candidate(
            replace(base, rollout_devices=3, max_staleness=1),
            replace(result, trained_tokens_per_s=99.0),
        ),
        Candidate(
            replace(base, rollout_devices=1, max_staleness=0),
            replace(result, trained_tokens_per_s=90.0),
        ),
    ]
    assert recommend(fake).layout.max_staleness == 1  # 99 is within 2% of 100
    assert recommend(fake, staleness_cap=0).layout.rollout_devices == 1
    with pytest.raises(ValueError, match="no async candidate"):
        recommend([c for c in fake if c.layout.max_staleness > 0], staleness_cap=0)


def test_a_cost_too_small_to_fit_leaves_its_exponent_assumed() -> None:
    # The sync run's training fit to zero per token (too few steps to separate it): no
    # exponent can be read from it, so the assumed one stays; decode still fits.
    one = measured_run("async", 1, 1e-3, 4e-6)
    two = measured_run("sync", 2, 1e-3 / 2, 0.0, generate_s_per_step=0.1)
    costs = calibrate([one, two], train_scaling=0.8).costs
    assert costs.train_scaling == 0.8
    assert costs.decode_scaling == pytest.approx(1.0)
