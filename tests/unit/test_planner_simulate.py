"""The pipeline simulator: hand-worked timelines, invariants over random configs, bad input."""

import dataclasses
import random
import time

import numpy as np
import pytest

from sluice.engines.planner.costs import CostModel, Layout, Workload
from sluice.engines.planner.draws import draw_block
from sluice.engines.planner.simulate import simulate


def costs(**overrides: float) -> CostModel:
    """Every cost zero unless given."""
    base = dict(
        decode_step_s=0.0,
        decode_row_s=0.0,
        decode_context_s=0.0,
        prefill_token_s=0.0,
        weight_load_s=0.0,
        train_token_s=0.0,
    )
    return CostModel(**{**base, **overrides})


def fixed(lengths: tuple[int, ...], group_size: int, prompt: int = 0, **kw) -> Workload:
    """A workload whose response lengths are exactly ``lengths``, cycled in sample order."""
    return Workload(
        response_lengths=(1,),
        prompt_lengths=(prompt,),
        group_size=group_size,
        fixed_response_lengths=lengths,
        **kw,
    )


def sync(devices: int = 1, **kw) -> Layout:
    return Layout(mode="sync", devices=devices, rollout_devices=devices, prompts_per_batch=1, **kw)


def one_server_async(**kw) -> Layout:
    """One rollout device, one train device."""
    return Layout(**{"mode": "async", "devices": 2, "rollout_devices": 1, **kw})


def spread(seed: int, count: int, low: int, high: int) -> tuple[int, ...]:
    """Long-tailed lengths: log-uniform between low and high."""
    rng = random.Random(seed)
    return tuple(int(low * (high / low) ** rng.random()) for _ in range(count))


# ---------------------------------------------------------------- sync, by hand


def test_sync_step_waits_for_the_longest_response():
    # One group of responses 1 and 10, 1 s per decode step: generation ends after 10
    # steps (10 s), then training 5 s -> 15 s per step; the trainer waits 10 of 15.
    result = simulate(
        fixed((1, 10), 2), costs(decode_step_s=1.0, train_step_s=5.0), sync(), steps=3
    )
    assert result.seconds_per_step == pytest.approx(15.0)
    assert result.trainer_idle_ratio == pytest.approx(10 / 15)
    assert result.rollout_idle_ratio is None
    assert result.staleness_max == 0
    # reward 2 s after the last token, publish 1 s, reload 3 s: 15 + 2 + 1 + 3 = 21,
    # of which the trainer works 5.
    slower = simulate(
        fixed((1, 10), 2),
        costs(decode_step_s=1.0, train_step_s=5.0, reward_s=2.0, publish_s=1.0, weight_load_s=3.0),
        sync(),
        steps=3,
    )
    assert slower.seconds_per_step == pytest.approx(21.0)
    assert slower.trainer_idle_ratio == pytest.approx(16 / 21)


def test_dropped_groups_cost_the_trainer_nothing():
    # Responses 10 and 10 after a 0-token prompt: 20 tokens a step at 1 s/token, 10 s
    # of generation at 1 s a step. Keeping half the tokens trains 10 of them (10 s):
    # 20 s a step against 30 s, and 10 trained tokens per 20 s.
    full = simulate(
        fixed((10, 10), 2), costs(decode_step_s=1.0, train_token_s=1.0), sync(), steps=3
    )
    half = simulate(
        fixed((10, 10), 2, trained_fraction=0.5),
        costs(decode_step_s=1.0, train_token_s=1.0),
        sync(),
        steps=3,
    )
    assert full.seconds_per_step == pytest.approx(30.0)
    assert half.seconds_per_step == pytest.approx(20.0)
    assert half.trained_tokens_per_s == pytest.approx(10 / 20)
    with pytest.raises(ValueError, match="trained_fraction"):
        fixed((10,), 1, trained_fraction=0.0)


def test_a_prefill_pass_costs_its_fixed_part_once():
    # One group of 2 responses of 3 tokens after a 10-token prompt, prefilled once per
    # group: the first step costs 2 s (pass) + 10 tokens × 0.1 s + 1 s (decode) = 4 s,
    # then 2 more decode steps of 1 s: 6 s of generation, no training cost.
    result = simulate(
        fixed((3, 3), 2, prompt=10),
        costs(decode_step_s=1.0, prefill_token_s=0.1, prefill_call_s=2.0),
        sync(),
        steps=3,
    )
    assert result.seconds_per_step == pytest.approx(6.0)


def test_decode_steps_cost_rows_and_context():
    # a=1, r=0.5, d=0.1; prompt 3, responses 2 and 4:
    # step 1: b=2, c=3+3=6 -> 1 + 1 + 0.6 = 2.6
    # step 2: b=2, c=8     -> 1 + 1 + 0.8 = 2.8   (the 2-token response is done)
    # step 3: b=1, c=3+2=5 -> 1 + 0.5 + 0.5 = 2.0
    # step 4: b=1, c=6     -> 1 + 0.5 + 0.6 = 2.1  -> generation 9.5 s
    # prefill 0.2 s/token, prompt shared by the group: 3 * 0.2 = 0.6 on step 1
    # training 0.5 s -> 9.5 + 0.6 + 0.5 = 10.6 s per step
    decode = dict(decode_step_s=1.0, decode_row_s=0.5, decode_context_s=0.1)
    c = costs(**decode, prefill_token_s=0.2, train_step_s=0.5)
    assert simulate(fixed((2, 4), 2, prompt=3), c, sync()).seconds_per_step == pytest.approx(10.6)
    # the prompt prefilled per sample: 6 * 0.2 = 1.2 -> 9.5 + 1.2 + 0.5 = 11.2
    unshared = fixed((2, 4), 2, prompt=3, prefill_shared_by_group=False)
    assert simulate(unshared, c, sync()).seconds_per_step == pytest.approx(11.2)
    # one server on 2 devices, linear scaling: decode (9.5 + 0.6) / 2 = 5.05, training
    # on 2 devices 0.5 / 2 = 0.25 -> 5.3
    two = sync(devices=2, devices_per_server=2)
    assert simulate(fixed((2, 4), 2, prompt=3), c, two).seconds_per_step == pytest.approx(5.3)


def test_training_counts_tokens_and_micro_batches():
    # three responses of 10 tokens (prompt 0), budget 20: best fit gives [10, 10] and
    # [10] -> 2 micro-batches. Train 1 + 2 * 1 + 30 * 0.1 = 6 s; generation 10 s -> 16.
    c = costs(decode_step_s=1.0, train_step_s=1.0, train_micro_batch_s=1.0, train_token_s=0.1)
    layout = sync(max_tokens_per_micro_batch=20)
    result = simulate(fixed((10,), 3), c, layout)
    assert result.seconds_per_step == pytest.approx(16.0)
    assert result.train_s_per_step == pytest.approx(6.0)
    assert result.trained_tokens_per_s == pytest.approx(30 / 16)


def test_one_slot_serialises_the_samples_that_continuous_batching_overlaps():
    # slots=1: responses 3, 5, 7 run one after another: 15 steps of 1 s.
    c = costs(decode_step_s=1.0)
    serial = simulate(fixed((3, 5, 7), 3), c, sync(slots_per_server=1))
    assert serial.seconds_per_step == pytest.approx(3 + 5 + 7)
    # three slots: all three at once, the longest sets the pace.
    batched = simulate(fixed((3, 5, 7), 3), c, sync(slots_per_server=3))
    assert batched.seconds_per_step == pytest.approx(7.0)


# ---------------------------------------------------------------- async, by hand


def test_async_without_staleness_matches_sync_on_the_same_servers():
    # eta=0: batch k may only start once version k is visible, exactly the sync loop.
    # Sync on 2 devices (2 servers, training on both) vs async with 2 rollout and 2
    # train devices: the same servers and the same training speed.
    workload = Workload(
        response_lengths=spread(0, 200, 20, 2000), prompt_lengths=(50, 100, 200), group_size=4
    )
    c = costs(
        decode_step_s=0.01,
        decode_row_s=1e-4,
        decode_context_s=1e-6,
        prefill_token_s=1e-4,
        weight_load_s=2.0,
        train_token_s=1e-6,
        train_step_s=0.1,
        publish_s=1.0,
        reward_s=0.3,
    )
    both = dict(prompts_per_batch=6, slots_per_server=8)
    synchronous = simulate(workload, c, Layout(mode="sync", devices=2, rollout_devices=2, **both))
    asynchronous = simulate(
        workload, c, Layout(mode="async", devices=4, rollout_devices=2, max_staleness=0, **both)
    )
    assert asynchronous.seconds_per_step == pytest.approx(synchronous.seconds_per_step, rel=1e-6)
    assert asynchronous.trainer_idle_ratio == pytest.approx(synchronous.trainer_idle_ratio)


@pytest.mark.parametrize(
    ("train_step_s", "per_step", "trainer_idle", "rollout_idle"),
    [
        # generation 10 s per batch, training 4 s: the server never waits; the
        # trainer waits 6 of every 10 s.
        (4.0, 10.0, 0.6, 0.0),
        # training 15 s: the trainer sets the pace; each version admits one group that
        # takes 10 s, so the server idles 5 of every 15 s.
        (15.0, 15.0, 0.0, 1 / 3),
    ],
)
def test_staleness_one_overlaps_generation_and_training(
    train_step_s, per_step, trainer_idle, rollout_idle
):
    # One server with one slot, B=1, G=1, every response 10 tokens at 1 s per step, so a
    # batch takes g = 10 s; eta=1 lets batch k+1 generate while batch k trains.
    # Steady state: max(g, t) per step, trainer idle 1 - t / max(g, t).
    layout = one_server_async(prompts_per_batch=1, max_staleness=1, slots_per_server=1)
    c = costs(decode_step_s=1.0, train_step_s=train_step_s)
    result = simulate(fixed((10,), 1), c, layout, steps=4, warmup_steps=2)
    assert result.seconds_per_step == pytest.approx(per_step)
    assert result.trainer_idle_ratio == pytest.approx(trainer_idle)
    assert result.rollout_idle_ratio == pytest.approx(rollout_idle)
    assert result.rollout_update_ratio == pytest.approx(0.0)
    # 10 tokens generated and 10 trained per step.
    assert result.generated_tokens_per_s == pytest.approx(10 / per_step)
    assert result.trained_tokens_per_s == pytest.approx(10 / per_step)


def _update_timeline(interruptible: bool):
    # One server, B=1, G=2, eta=1, prompts of 10 tokens (0.1 s/token), 1 s per step,
    # weight load 3 s, training 5 s. Group 0 = (4, 4), group 1 = (20, 30), group 2 =
    # (4, 4), ... Both groups start at t=0: step 1 carries 2 prompts of prefill
    # (20 * 0.1 = 2 s) so step j ends at 2 + j. Group 0 is done after step 4 (t=6),
    # trains 6..11; version 1 is visible at 11, which is the end of step 9: each of
    # group 1's samples then holds 10 + 9 = 19 tokens of context.
    layout = one_server_async(prompts_per_batch=1, max_staleness=1, interruptible=interruptible)
    c = costs(decode_step_s=1.0, prefill_token_s=0.1, weight_load_s=3.0, train_step_s=5.0)
    return simulate(fixed((4, 4, 20, 30), 2, prompt=10), c, layout, steps=1, warmup_steps=1)


def test_interruptible_update_pauses_for_the_load_and_the_kv_recompute():
    result = _update_timeline(interruptible=True)
    # pause = 3 + 0.1 * (19 + 19) = 6.8 (t = 11 .. 17.8); then group 2 is admitted, its
    # prefill (1 s) rides on the next step: group 1 reaches 10 tokens at 17.8 + 2 =
    # 19.8 and 30 tokens at 39.8; training 39.8 .. 44.8. Window 11 .. 44.8 = 33.8 s.
    assert result.recomputed_tokens_per_update == pytest.approx(38)
    assert result.server_updates == 1
    assert result.seconds_per_step == pytest.approx(33.8)
    assert result.rollout_update_ratio == pytest.approx(6.8 / 33.8)
    assert result.drain_wait_s_per_update == pytest.approx(0.0)


def test_drain_waits_for_the_longest_in_flight_sample():
    result = _update_timeline(interruptible=False)
    # At t=11 group 1's longest sample has 30 - 9 = 21 tokens to go at 1 s each: the
    # drain ends at 32, the load runs 32..35. Group 1 is complete at 32, trains 32..37.
    # Window 11 .. 37 = 26 s, of which the pause is 3.
    assert result.drain_wait_s_per_update == pytest.approx(21.0)
    assert result.recomputed_tokens_per_update == pytest.approx(0.0)
    assert result.seconds_per_step == pytest.approx(26.0)
    assert result.rollout_update_ratio == pytest.approx(3 / 26)


def test_publishing_every_other_step_with_a_delay_holds_the_gate():
    # One server, one slot, B=1, G=1, 10-token responses at 1 s per step, training 2 s,
    # eta=1, publish every 2 steps, 3 s after the step.
    #   groups 0, 1 start at 0 and run 0..10, 10..20; steps 0, 1 train 10..12, 20..22.
    #   version 2 is visible at 22 + 3 = 25: groups 2, 3 run 25..35, 35..45, train
    #   35..37, 45..47; version 4 visible at 50: groups 4, 5 run 50..60, 60..70 and
    #   train 60..62, 70..72. Every 2 steps take 25 s -> 12.5 s per step (it would be
    #   10 s with publish_every=1 and no delay).
    layout = one_server_async(
        prompts_per_batch=1, max_staleness=1, publish_every=2, slots_per_server=1
    )
    c = costs(decode_step_s=1.0, train_step_s=2.0, publish_s=3.0)
    result = simulate(fixed((10,), 1), c, layout, steps=4, warmup_steps=2)
    # window: end of step 1 (22) .. end of step 5 (72) = 50 s
    assert result.elapsed_s == pytest.approx(50.0)
    assert result.seconds_per_step == pytest.approx(12.5)
    # the server idles 22..25, 45..50, 70..72: 10 of 50 s
    assert result.rollout_idle_ratio == pytest.approx(0.2)
    assert result.trainer_idle_ratio == pytest.approx(1 - 4 * 2 / 50)
    # groups 2, 4 started at the version they train at, groups 3, 5 one behind
    assert result.staleness_mean == pytest.approx(0.5)
    assert result.staleness_max == 1
    baseline = simulate(
        fixed((10,), 1),
        costs(decode_step_s=1.0, train_step_s=2.0),
        one_server_async(prompts_per_batch=1, max_staleness=1, slots_per_server=1),
        steps=4,
        warmup_steps=2,
    )
    assert baseline.seconds_per_step == pytest.approx(10.0)


# ---------------------------------------------------------------- invariants


def _random_case(rng: random.Random):
    workload = Workload(
        response_lengths=spread(rng.randrange(1000), 50, 1, 400),
        prompt_lengths=tuple(rng.randint(0, 60) for _ in range(5)),
        group_size=rng.randint(1, 4),
        max_new_tokens=rng.choice([None, 150]),
        prefill_shared_by_group=rng.random() < 0.5,
    )
    c = costs(
        decode_step_s=rng.uniform(0.01, 0.1),
        decode_row_s=rng.uniform(0, 0.01),
        decode_context_s=rng.uniform(0, 1e-4),
        prefill_token_s=rng.uniform(0, 1e-3),
        weight_load_s=rng.uniform(0, 2),
        train_token_s=rng.uniform(0, 1e-3),
        train_step_s=rng.uniform(0, 3),
        publish_s=rng.uniform(0, 2),
        reward_s=rng.uniform(0, 1),
    )
    eta = rng.randint(0, 3)
    dps = rng.choice([1, 2])
    rollout = dps * rng.randint(1, 5)
    layout = Layout(
        mode=rng.choice(["sync", "async", "async"]),
        devices=rollout + rng.randint(1, 3),
        rollout_devices=rollout,
        prompts_per_batch=rng.randint(1, 6),
        max_staleness=eta,
        interruptible=rng.random() < 0.5,
        publish_every=rng.randint(1, eta + 1),
        devices_per_server=dps,
        slots_per_server=rng.choice([1, 3, 16, 256]),
        batch_order=rng.choice(["issue", "finish"]),
    )
    return workload, c, layout


def test_no_sample_is_lost_or_trained_twice_and_issue_order_keeps_the_bound():
    rng = random.Random(7)
    for case in range(60):
        workload, c, layout = _random_case(rng)
        warmup, steps = rng.randint(0, 3), rng.randint(1, 6)
        r = simulate(
            workload,
            c,
            layout,
            steps=steps,
            warmup_steps=warmup,
            seed=case,
            slice_servers=rng.choice([1, 2, 8]),
        )
        G, B = workload.group_size, r.simulated_prompts_per_batch
        assert r.trained_samples_total == (warmup + steps) * B * G, (case, layout)
        assert r.trained_groups_distinct * G == r.trained_samples_total
        assert r.dispatched_samples_total == r.finished_samples_total + r.in_flight_samples_at_end
        assert r.in_flight_samples_at_end >= 0
        assert r.finished_samples_total >= r.trained_samples_total
        if layout.mode == "sync":
            assert r.staleness_max == 0
            assert r.in_flight_samples_at_end == 0
        elif layout.batch_order == "issue":
            assert r.staleness_max <= layout.max_staleness, (case, layout)
        assert r.elapsed_s > 0
        assert 0 <= r.trainer_idle_ratio <= 1
        if r.rollout_idle_ratio is not None and r.rollout_update_ratio is not None:
            assert r.rollout_idle_ratio >= 0
            assert r.rollout_update_ratio >= 0
            assert r.rollout_idle_ratio + r.rollout_update_ratio <= 1 + 1e-9


def test_finish_order_can_train_past_the_bound_that_issue_order_keeps():
    # Group 0 is 40 tokens long, every other group 1 token: in finish order the short
    # groups fill the first batches and group 0 trains long after it started.
    layout = one_server_async(prompts_per_batch=1, max_staleness=1, batch_order="finish")
    c = costs(decode_step_s=1.0, train_step_s=1.0)
    workload = fixed((40,) + (1,) * 39, 1)
    finish = simulate(workload, c, layout, steps=30, warmup_steps=0)
    issue = simulate(
        workload, c, dataclasses.replace(layout, batch_order="issue"), steps=30, warmup_steps=0
    )
    assert finish.staleness_max > 1
    assert issue.staleness_max <= 1


def test_same_seed_same_result_and_another_seed_differs():
    workload = Workload(
        response_lengths=spread(1, 300, 10, 3000), prompt_lengths=(100, 300), group_size=4
    )
    c = costs(decode_step_s=0.02, decode_context_s=1e-7, train_token_s=1e-4, weight_load_s=1.0)
    layout = Layout(
        mode="async", devices=6, rollout_devices=4, prompts_per_batch=8, max_staleness=2
    )
    first = simulate(workload, c, layout, seed=3)
    assert simulate(workload, c, layout, seed=3) == first
    assert simulate(workload, c, layout, seed=4) != first


# ---------------------------------------------------------------- slicing


def test_a_slice_of_servers_stands_for_the_fleet():
    # 16 servers, B=32: a 4-server slice simulates round(32 * 4 / 16) = 8 groups per
    # batch and, averaged over three seeds, lands within a few percent of the full
    # simulation (independent draws for the slice were ~8% fast here: see draws.py).
    workload = Workload(
        response_lengths=spread(2, 500, 50, 4000), prompt_lengths=(200, 400), group_size=4
    )
    c = costs(
        decode_step_s=0.02,
        decode_row_s=2e-4,
        decode_context_s=2e-7,
        prefill_token_s=1e-5,
        weight_load_s=1.0,
        train_token_s=2e-5,
        train_step_s=2.0,
        publish_s=1.0,
    )
    layout = Layout(
        mode="async",
        devices=20,
        rollout_devices=16,
        prompts_per_batch=32,
        max_staleness=2,
        slots_per_server=16,
    )
    full = [simulate(workload, c, layout, steps=30, slice_servers=16, seed=s) for s in range(3)]
    part = [simulate(workload, c, layout, steps=30, slice_servers=4, seed=s) for s in range(3)]
    assert full[0].simulated_servers == 16
    assert (part[0].simulated_servers, part[0].simulated_prompts_per_batch) == (4, 8)
    assert part[0].batch_scale == pytest.approx(1.0)

    def mean(results, field):
        return sum(getattr(r, field) for r in results) / len(results)

    for field in ("seconds_per_step", "trained_tokens_per_s"):
        assert mean(part, field) == pytest.approx(mean(full, field), rel=0.05)


def test_a_slice_keeps_the_batch_longest_group():
    # The same generator state drawn as the whole batch (32 groups) and thinned to 4.
    workload = Workload(response_lengths=spread(5, 200, 1, 5000), prompt_lengths=(7,), group_size=3)
    _, whole = draw_block(np.random.default_rng(11), workload, 32, 32, 0)
    prompts, thinned = draw_block(np.random.default_rng(11), workload, 32, 4, 0)
    assert (len(prompts), len(thinned)) == (4, 12)
    assert max(thinned) == max(whole)
    assert set(thinned) <= set(whole)


def test_slice_rounding_is_reported():
    # 96 servers in slices of 8 with B=512: round(512 * 8 / 96) = round(42.67) = 43
    # groups stand for 43 * 96 / 8 = 516 -> batch_scale 516 / 512.
    layout = Layout(mode="async", devices=128, rollout_devices=96, prompts_per_batch=512)
    result = simulate(fixed((5,), 1), costs(decode_step_s=1.0), layout, steps=2, warmup_steps=0)
    assert (result.servers, result.simulated_servers) == (96, 8)
    assert result.simulated_prompts_per_batch == 43
    assert result.batch_scale == pytest.approx(516 / 512)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (
            lambda: Layout(mode="sync", devices=1, rollout_devices=1, prompts_per_batch=0),
            "prompts_per_batch",
        ),
        (
            lambda: Layout(mode="async", devices=4, rollout_devices=4, prompts_per_batch=1),
            "rollout_devices",
        ),
        (
            lambda: Layout(mode="colocated", devices=4, rollout_devices=2, prompts_per_batch=1),
            "mode",
        ),
        (
            lambda: Workload(response_lengths=(), prompt_lengths=(1,), group_size=1),
            "response_lengths",
        ),
        (lambda: Workload(response_lengths=(5,), prompt_lengths=(1,), group_size=0), "group_size"),
        (lambda: costs(decode_step_s=-1.0), "decode_step_s"),
        (
            lambda: one_server_async(prompts_per_batch=1, max_staleness=0, publish_every=2),
            "max_staleness",
        ),
        (lambda: one_server_async(prompts_per_batch=1, batch_order="random"), "batch_order"),
    ],
)
def test_bad_input_names_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def test_bad_run_length_names_the_argument():
    with pytest.raises(ValueError, match="steps"):
        simulate(fixed((1,), 1), costs(decode_step_s=1.0), sync(), steps=0)


def test_small_config_time_is_printed_not_asserted():
    # B=16, G=8, 20 steps on 4 rollout servers: prints the simulator's own run time.
    workload = Workload(
        response_lengths=spread(3, 500, 50, 4000), prompt_lengths=(200, 400), group_size=8
    )
    c = costs(decode_step_s=0.02, decode_row_s=1e-4, decode_context_s=1e-7, train_token_s=1e-4)
    layout = Layout(
        mode="async", devices=8, rollout_devices=4, prompts_per_batch=16, max_staleness=1
    )
    start = time.perf_counter()
    simulate(workload, c, layout, steps=20)
    print(f"simulate B=16 G=8 20 steps: {(time.perf_counter() - start) * 1e3:.1f} ms")
