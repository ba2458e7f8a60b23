"""The trainer step's objectives beyond decoupled PPO: PPO epochs, the learning-rate
schedule, a KL penalty to version 0, the entropy bonus, sequence-level loss aggregation,
GSPO and CISPO, and what samples_from_table hands them (version lags, shaped rewards)."""

import dataclasses

import numpy as np
import pytest
import torch

from sluice.engines.rl.advantages import make_advantage_fn
from sluice.engines.rl.lora import LoraSettings
from sluice.engines.rl.loss import make_policy_loss
from sluice.engines.rl.rollout_correction import make_rollout_correction
from sluice.engines.rl.samples import samples_from_table
from sluice.engines.rl.schedules import lr_multiplier
from sluice.engines.rl.train_batch import TrainerSettings
from sluice.engines.rl.trainer import PolicyTrainer
from sluice.infra.streams.schema import table_from_rows
from tests.unit.test_trainer import make_trainer, random_samples


def flat_weights(trainer):
    return torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])


def adam_steps(trainer):
    """How many optimizer steps AdamW took on each trained parameter."""
    return {int(state["step"]) for state in trainer.optimizer.state.values()}


# ------------------------------------------------------------------ epochs, schedule


@pytest.mark.parametrize("ppo_minibatches", [1, 2])
def test_two_ppo_epochs_take_two_optimizer_steps_per_minibatch(tiny_dir, ppo_minibatches):
    trainer = make_trainer(tiny_dir, ppo_epochs=2, ppo_minibatches=ppo_minibatches)
    metrics = trainer.train_step(random_samples(trainer))
    assert metrics["train/optimizer_steps"] == 2 * ppo_minibatches
    assert metrics["train/applied_minibatches"] == 2 * ppo_minibatches
    assert adam_steps(trainer) == {2 * ppo_minibatches}
    assert trainer.steps_done == 1  # one policy version, however many optimizer steps


def test_the_learning_rate_warms_up_then_decays_step_by_step(tiny_dir):
    schedule = {"lr_warmup_steps": 2, "total_steps": 4, "lr_decay": "linear", "lr_min_ratio": 0.1}
    trainer = make_trainer(tiny_dir, **schedule)
    samples = random_samples(trainer)
    rates = []
    for _ in range(4):
        before = flat_weights(trainer)
        rates.append(trainer.train_step(samples)["train/lr"])
        if len(rates) == 1:
            # AdamW's first step moves each weight by lr · g / (|g| + eps) <= lr: the
            # warmed-up rate is the one applied, not only the one reported.
            moved = (flat_weights(trainer) - before).abs().max()
            assert 0.4 * rates[0] < moved <= rates[0] * (1 + 1e-5)
    # W = 2, T = 4, m = 0.1: s = 0, 1 warm up as (s + 1) / 2 = 0.5, 1; s = 2 starts the
    # decay at p = 0 (1.0); s = 3 is p = 1/2: 1 - 0.9 · 0.5 = 0.55.
    assert rates == pytest.approx([0.5e-3, 1e-3, 1e-3, 0.55e-3])
    expected = [
        1e-3 * lr_multiplier(s, warmup_steps=2, total_steps=4, decay="linear", min_ratio=0.1)
        for s in range(4)
    ]
    assert rates == pytest.approx(expected)


def test_a_refused_step_does_not_advance_the_schedule(tiny_dir):
    trainer = make_trainer(tiny_dir, lr_warmup_steps=3, total_steps=3)
    samples = random_samples(trainer)
    refused = trainer.train_step(samples, guard=lambda m: False)
    applied = trainer.train_step(samples)
    assert refused["train/applied_minibatches"] == 0
    assert refused["train/lr"] == applied["train/lr"] == pytest.approx(1e-3 / 3)
    assert trainer.train_step(samples)["train/lr"] == pytest.approx(2e-3 / 3)


# ------------------------------------------------------------------ KL to version 0


def kl_trainer(model_dir, **kwargs):
    return PolicyTrainer(
        model_dir,
        TrainerSettings(lr=3e-2, kl_coef=0.1, kl_estimator="k3"),
        make_policy_loss(),
        make_rollout_correction("token_tis", threshold=2.0),
        **kwargs,
    )


def assert_kl_grows_from_zero(trainer):
    samples = random_samples(trainer)
    steps = [trainer.train_step(samples) for _ in range(4)]
    first = steps[0]
    # The first step starts at version 0: π_θ is π_ref, so every k3 term is 0.
    assert first["loss/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert first["loss/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert first["train/reference_pass_tokens"] == first["train/response_tokens"]
    assert first["train/reference_time_s"] > 0
    kl = [m["loss/kl_ref"] for m in steps]
    assert kl[-1] > 1e-3, kl
    assert steps[-1]["loss/kl_loss"] == pytest.approx(0.1 * kl[-1], rel=1e-4)


def test_kl_to_version_zero_with_full_fine_tuning_starts_at_zero_and_grows(tiny_dir):
    trainer = kl_trainer(tiny_dir, reference_dir=tiny_dir)
    assert trainer.reference is not None
    assert_kl_grows_from_zero(trainer)
    # The reference stayed version 0 while the policy moved.
    fresh = make_trainer(tiny_dir)
    for p, q in zip(trainer.reference.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_kl_under_lora_takes_the_base_as_reference(tiny_dir):
    trainer = kl_trainer(tiny_dir, lora=LoraSettings(rank=4, alpha=8))
    assert trainer.reference is None  # the base with its adapters off, not a copy
    assert_kl_grows_from_zero(trainer)


def test_kl_with_full_fine_tuning_needs_the_reference_dir(tiny_dir):
    with pytest.raises(ValueError, match="reference_dir"):
        kl_trainer(tiny_dir)


def test_no_kl_runs_no_reference_pass(tiny_dir):
    trainer = make_trainer(tiny_dir)
    metrics = trainer.train_step(random_samples(trainer))
    assert metrics["train/reference_pass_tokens"] == 0
    assert "loss/kl_ref" not in metrics and trainer.reference is None


# ------------------------------------------------------------------ entropy bonus


def without_advantages(samples):
    return [dataclasses.replace(s, advantage=0.0) for s in samples]


def test_the_entropy_bonus_alone_raises_the_policy_entropy(tiny_dir):
    trainer = make_trainer(tiny_dir, lr=1e-2, entropy_coef=1.0)
    samples = without_advantages(random_samples(trainer))
    steps = [trainer.train_step(samples) for _ in range(4)]
    # policy/entropy is read under π_prox: each step's value is its starting weights'.
    entropy = [m["policy/entropy"] for m in steps]
    assert all(a < b for a, b in zip(entropy, entropy[1:], strict=False)), entropy
    assert steps[0]["loss/entropy_bonus"] == pytest.approx(-entropy[0], rel=1e-4)


def test_zero_advantages_without_the_bonus_leave_the_weights_unchanged(tiny_dir):
    trainer = make_trainer(tiny_dir, lr=1e-2, entropy_coef=0.0)
    samples = without_advantages(random_samples(trainer))
    before = flat_weights(trainer)
    metrics = trainer.train_step(samples)
    assert metrics["train/grad_norm"] == 0.0
    assert "loss/entropy_bonus" not in metrics
    assert torch.equal(flat_weights(trainer), before)


# ------------------------------------------------------------------ loss aggregation


def expected_on_policy_loss(samples, mode):
    """On-policy every ratio and weight is 1, so each token's loss is −A of its sample:
    token-mean −Σ n_i A_i / N; seq-mean-token-mean −(1/G) Σ A_i; seq-mean-token-sum
    −(1/G) Σ n_i A_i."""
    n = np.array([len(s.response_token_ids) for s in samples], dtype=np.float64)
    a = np.array([s.advantage for s in samples])
    return {
        "token-mean": -(n * a).sum() / n.sum(),
        "seq-mean-token-mean": -a.mean(),
        "seq-mean-token-sum": -(n * a).sum() / len(samples),
    }[mode]


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_sequence_mean_modes_do_not_depend_on_the_micro_batch_budget(tiny_dir, mode):
    results = []
    for budget in (4096, 40):
        trainer = make_trainer(tiny_dir, max_tokens_per_micro_batch=budget, loss_agg_mode=mode)
        samples = random_samples(trainer)
        # Advantages that differ by sample, so the modes give different losses.
        samples = [dataclasses.replace(s, advantage=(i % 3) - 0.7) for i, s in enumerate(samples)]
        metrics = trainer.train_step(samples)
        assert metrics["loss/policy_loss"] == pytest.approx(
            expected_on_policy_loss(samples, mode), abs=1e-5
        )
        results.append((metrics, flat_weights(trainer)))
    (one, weights_one), (many, weights_many) = results
    assert many["train/micro_batches"] > one["train/micro_batches"] == 1
    assert expected_on_policy_loss(samples, mode) != pytest.approx(
        expected_on_policy_loss(samples, "token-mean"), abs=1e-3
    )
    torch.testing.assert_close(weights_one, weights_many, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ GSPO, CISPO


@pytest.mark.parametrize("objective", ["gspo", "cispo", "decoupled_ppo"])
def test_each_objective_raises_positive_and_lowers_negative_advantages(tiny_dir, objective):
    trainer = PolicyTrainer(
        tiny_dir,
        TrainerSettings(lr=1e-3),
        make_policy_loss(objective),
        make_rollout_correction("token_tis", threshold=2.0),
    )
    samples = random_samples(trainer)  # odd samples advantage +1, even −1
    before = trainer.response_logprobs(samples)
    trainer.train_step(samples)
    after = trainer.response_logprobs(samples)
    change = [float((b - a).mean()) for a, b in zip(before, after, strict=True)]
    assert all(c > 0 for c in change[1::2]), change
    assert all(c < 0 for c in change[0::2]), change


# ------------------------------------------------------------------ from the scored table


def scored_rows(rewards, responses, token_versions):
    """One prompt group's scored rows."""
    return [
        {
            "sample_id": f"g0-{k:03d}",
            "group_id": "g0",
            "prompt_id": "p0",
            "prompt_token_ids": [1, 2],
            "response_token_ids": response,
            "behaviour_logprobs": [-0.5] * len(response),
            "token_versions": versions,
            "finish_reason": "stop",
            "reward": reward,
            "task": "t",
            "worker": "w",
        }
        for k, (reward, response, versions) in enumerate(
            zip(rewards, responses, token_versions, strict=True)
        )
    ]


def test_samples_carry_each_tokens_version_lag_behind_the_trainer():
    # One response sampled across an update (versions 3, 3, 4), one by version 4 and 5.
    table = table_from_rows(scored_rows((0.0, 1.0), ([3, 4, 5], [6, 7]), ([3, 3, 4], [4, 5])))
    samples, _ = samples_from_table(table, make_advantage_fn(), policy_version=5)
    # lag = 5 − v per token.
    assert [list(s.version_lag) for s in samples] == [[2, 2, 1], [1, 0]]
    # Without per-token versions, every token lags as its response's first one did.
    coarse, _ = samples_from_table(
        table.drop_columns(["token_versions"]), make_advantage_fn(), policy_version=5
    )
    assert [list(s.version_lag) for s in coarse] == [[2, 2, 2], [1, 1]]
    # Without the trainer's version: on-policy, no lag recorded.
    unversioned, _ = samples_from_table(table, make_advantage_fn())
    assert all(s.version_lag is None for s in unversioned)


def test_reward_shaping_enters_the_advantages_and_is_reported():
    # Both responses right (reward 1); the shaping docks 0.1 per token.
    table = table_from_rows(scored_rows((1.0, 1.0), ([3], [4, 5, 6]), ([0], [0, 0, 0])))
    advantages = make_advantage_fn(mode="drgrpo")
    plain, plain_stats = samples_from_table(table, advantages)
    shaped, stats = samples_from_table(
        table, advantages, shape_rewards=lambda lengths: -0.1 * lengths.double()
    )
    # Unshaped the group is all-equal: no signal. Shaped: 0.9 and 0.7, mean 0.8, so
    # Dr. GRPO's advantages are r − mean = +0.1 and −0.1.
    assert [s.advantage for s in plain] == [0.0, 0.0]
    assert [s.advantage for s in shaped] == pytest.approx([0.1, -0.1])
    assert stats["reward/shaping_mean"] == pytest.approx(-0.2)  # (−0.1 − 0.3) / 2
    assert stats["reward/mean"] == plain_stats["reward/mean"] == 1.0  # the verifier's
    assert "reward/shaping_mean" not in plain_stats
