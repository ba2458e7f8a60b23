"""π_prox from the first minibatch's own forward: no extra pass where that is exact, the
same update and the same mismatch signals as the pass gives, the pass kept where dropout
makes a training forward another function, and the watchdog still asked before any
weight changes."""

import dataclasses

import numpy as np
import pytest
import torch

from sluice.engines.rl.lora import LoraSettings
from sluice.engines.rl.loss import make_policy_loss
from sluice.engines.rl.rollout_correction import make_rollout_correction
from sluice.engines.rl.train_batch import TrainerSettings
from sluice.engines.rl.trainer import PolicyTrainer
from tests.unit.test_trainer import make_trainer, random_samples


def parameters(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def assert_same_parameters(a, b):
    for (name, p), (_, q) in zip(
        a.model.named_parameters(), b.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(
            p, q, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
        )


def with_the_pass(model_dir, **settings):
    """A trainer that runs the no-grad π_prox pass over the whole batch (as Megatron does)."""
    trainer = make_trainer(model_dir, **settings)
    trainer.free_proximal = False
    return trainer


def response_tokens(samples, indices):
    return sum(len(samples[i].response_token_ids) for i in indices)


def off_policy(samples, seed=0, scale=0.3):
    """`samples` as if sampled by another policy: behaviour log-probs noised."""
    rng = np.random.default_rng(seed)
    return [
        dataclasses.replace(
            s,
            behaviour_logprobs=np.asarray(s.behaviour_logprobs)
            + scale * rng.normal(size=len(s.behaviour_logprobs)),
        )
        for s in samples
    ]


def test_one_minibatch_runs_no_pass_and_updates_as_the_pass_does(tiny_dir):
    free, passed = make_trainer(tiny_dir), with_the_pass(tiny_dir)
    # Three batches behaviour-scored by version 0: steps 2 and 3 train off-policy.
    batches = [random_samples(free, seed=seed) for seed in range(3)]
    for samples in batches:
        a, b = free.train_step(samples), passed.train_step(samples)
        assert a["train/proximal_pass_tokens"] == 0
        assert b["train/proximal_pass_tokens"] == b["train/response_tokens"]
        torch.testing.assert_close(
            a["loss/policy_loss"], b["loss/policy_loss"], rtol=1e-5, atol=1e-7
        )
    assert free.steps_done == passed.steps_done == 3
    assert_same_parameters(free, passed)


def test_two_exact_minibatches_pass_over_the_samples_outside_the_first_only(tiny_dir):
    free = make_trainer(tiny_dir, ppo_minibatches=2)
    passed = with_the_pass(tiny_dir, ppo_minibatches=2)
    for seed in range(2):
        samples = random_samples(free, seed=seed)
        # The step's split: a seeded permutation dealt into 2 minibatches (order[j::2]).
        generator = torch.Generator()
        generator.set_state(free._generator.get_state())
        first = torch.randperm(len(samples), generator=generator).tolist()[0::2]
        outside = [i for i in range(len(samples)) if i not in first]
        a, b = free.train_step(samples), passed.train_step(samples)
        assert a["train/proximal_pass_tokens"] == response_tokens(samples, outside)
        assert 0 < a["train/proximal_pass_tokens"] < a["train/response_tokens"]
        assert b["train/proximal_pass_tokens"] == b["train/response_tokens"]
        assert a["train/applied_minibatches"] == b["train/applied_minibatches"] == 2
        torch.testing.assert_close(
            a["loss/policy_loss"], b["loss/policy_loss"], rtol=1e-5, atol=1e-7
        )
    assert_same_parameters(free, passed)


def lora_trainer(model_dir, dropout):
    return PolicyTrainer(
        model_dir,
        TrainerSettings(lr=1e-3),
        make_policy_loss(),
        make_rollout_correction("token_tis", threshold=2.0),
        lora=LoraSettings(rank=4, alpha=8, dropout=dropout),
    )


def test_a_model_with_dropout_runs_the_whole_pass(tiny_dir):
    # A training forward with dropout is not the function π_prox is: the pass stays.
    with_dropout = lora_trainer(tiny_dir, dropout=0.1)
    samples = random_samples(with_dropout)
    metrics = with_dropout.train_step(samples)
    assert metrics["train/proximal_pass_tokens"] == metrics["train/response_tokens"]
    # The same adapters without dropout need none.
    without = lora_trainer(tiny_dir, dropout=0.0)
    assert without.train_step(samples)["train/proximal_pass_tokens"] == 0


def test_loglinear_runs_no_pass_and_still_takes_every_optimizer_step(tiny_dir):
    trainer = make_trainer(tiny_dir, ppo_minibatches=2, proximal="loglinear")
    samples = random_samples(trainer)
    before = parameters(trainer)
    metrics = trainer.train_step(samples)
    assert metrics["train/proximal_pass_tokens"] == 0
    assert metrics["train/optimizer_steps"] == metrics["train/applied_minibatches"] == 2
    # AdamW counted two steps on every parameter, and the weights moved.
    steps = {int(state["step"]) for state in trainer.optimizer.state.values()}
    assert steps == {2}
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_on_fresh_data_loglinear_updates_as_the_exact_proximal_does(tiny_dir):
    # Lag 0 after the first step: π_prox is taken to be π_behav, which for samples the
    # step's starting weights scored is the exact π_prox (up to packing round-off).
    exact = make_trainer(tiny_dir, ppo_minibatches=2)
    loglinear = make_trainer(tiny_dir, ppo_minibatches=2, proximal="loglinear")
    samples = random_samples(exact)
    a, b = exact.train_step(samples), loglinear.train_step(samples)
    assert a["train/proximal_pass_tokens"] > 0 == b["train/proximal_pass_tokens"]
    torch.testing.assert_close(a["loss/policy_loss"], b["loss/policy_loss"], rtol=1e-5, atol=1e-7)
    assert_same_parameters(exact, loglinear)


def recording(loss_fn, calls):
    """`loss_fn`, noting the log π_θ, log π_prox and log π_behav of every call."""

    def loss(inputs):
        named = (inputs.logprobs, inputs.proximal_logprobs, inputs.behaviour_logprobs)
        calls.append([t.detach().cpu().clone() for t in named])
        return loss_fn(inputs)

    return loss


def test_loglinear_interpolates_each_token_by_its_own_lag(tiny_dir):
    calls = []
    trainer = PolicyTrainer(
        tiny_dir,
        TrainerSettings(lr=1e-2, ppo_minibatches=2, proximal="loglinear"),
        recording(make_policy_loss(), calls),
        make_rollout_correction("token_tis", threshold=2.0),
    )
    samples = random_samples(trainer)
    # Lags 0, 1, 2 by token; each token is found again by its behaviour log-prob.
    samples = [
        dataclasses.replace(s, version_lag=(np.arange(len(s.response_token_ids)) + i) % 3)
        for i, s in enumerate(samples)
    ]
    lag_of = {
        float(b): int(lag)
        for s in samples
        for b, lag in zip(np.float32(s.behaviour_logprobs), s.version_lag, strict=True)
    }
    assert len(lag_of) == sum(len(s.response_token_ids) for s in samples)
    trainer.train_step(samples)
    (first, first_prox, _), (second, second_prox, behaviour) = calls  # one micro-batch each
    # Step 0 of 2: the weights being trained are π_prox, exactly.
    assert torch.equal(first_prox, first)
    # Step 1 of 2 (j/k = 1/2): α = lag / (lag + 1/2) = 0, 2/3, 4/5 for lags 0, 1, 2.
    alpha = torch.tensor([[0.0, 2 / 3, 4 / 5][lag_of[float(b)]] for b in behaviour])
    torch.testing.assert_close(second_prox, behaviour + alpha * (second - behaviour))
    assert not torch.allclose(second, behaviour, atol=1e-3), "the first step moved nothing"


def test_a_refusal_with_one_minibatch_leaves_the_weights_unchanged(tiny_dir):
    trainer = make_trainer(tiny_dir)
    samples = off_policy(random_samples(trainer))
    before = parameters(trainer)
    seen = []
    metrics = trainer.train_step(samples, guard=lambda m: seen.append(dict(m)) or False)
    after = parameters(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert trainer.optimizer.state == {}, "AdamW took a step"
    assert metrics["train/applied_minibatches"] == 0 and trainer.steps_done == 0
    # Asked once, with the mismatch signals of π_prox, and refused before any step.
    assert len(seen) == 1 and seen[0]["mismatch/kl_k3"] > 0
    assert "train/grad_norm" not in seen[0]
    assert metrics["mismatch/kl_k3"] == seen[0]["mismatch/kl_k3"]


MISMATCH_PREFIXES = ("mismatch/", "is/")


@pytest.mark.parametrize("ppo_minibatches", [1, 2])
def test_off_policy_samples_give_the_same_mismatch_signals_either_way(tiny_dir, ppo_minibatches):
    free = make_trainer(tiny_dir, ppo_minibatches=ppo_minibatches)
    passed = with_the_pass(tiny_dir, ppo_minibatches=ppo_minibatches)
    samples = off_policy(random_samples(free))
    judged = {}
    results = {}
    for name, trainer in (("free", free), ("pass", passed)):
        seen = []
        results[name] = trainer.train_step(samples, guard=lambda m, seen=seen: not seen.append(m))
        judged[name] = seen[0]  # the first question: the mismatch signals
    a, b = results["free"], results["pass"]
    assert a["mismatch/kl_k3"] > 1e-3  # the noise is a real mismatch
    assert a["is/token_weight_max"] > 1.0  # and the correction weighs tokens
    keys = sorted(k for k in b if k.startswith(MISMATCH_PREFIXES))
    assert keys and keys == sorted(k for k in a if k.startswith(MISMATCH_PREFIXES))
    torch.testing.assert_close(
        {k: a[k] for k in keys}, {k: b[k] for k in keys}, rtol=1e-5, atol=1e-6
    )
    assert set(judged["free"]) == set(judged["pass"]) >= {"mismatch/kl_k3"}
    torch.testing.assert_close(judged["free"], judged["pass"], rtol=1e-5, atol=1e-6)
    # The corrected update is the same too.
    torch.testing.assert_close(a["loss/policy_loss"], b["loss/policy_loss"], rtol=1e-5, atol=1e-7)
    assert_same_parameters(free, passed)
