"""The trainer step: it moves log-probs the way the advantages say, micro-batching does not
change the update, and its log-probs agree with the inference engine's for the same weights."""

import dataclasses

import numpy as np
import pytest
import torch

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.types import GenerationRequest, SamplingParams
from sluice.engines.rl.batching import pack_sequences
from sluice.engines.rl.loss import make_policy_loss
from sluice.engines.rl.loss_inputs import LossInputs
from sluice.engines.rl.rollout_correction import make_rollout_correction
from sluice.engines.rl.train_batch import TrainerSettings, TrainingSample
from sluice.engines.rl.trainer import PolicyTrainer


def make_trainer(model_dir, **settings):
    return PolicyTrainer(
        model_dir,
        TrainerSettings(**{"lr": 1e-3, **settings}),
        make_policy_loss(),
        make_rollout_correction("token_tis", threshold=2.0),
    )


def random_samples(trainer, n=8, seed=0):
    rng = np.random.default_rng(seed)
    vocab = trainer.model.config.vocab_size
    raw = []
    for i in range(n):
        prompt = rng.integers(4, vocab, size=int(rng.integers(3, 9)))
        response = rng.integers(4, vocab, size=int(rng.integers(1, 30)))
        raw.append((prompt, response, 1.0 if i % 2 else -1.0))
    # Behaviour log-probs = the current policy's, as if sampled on-policy.
    probes = [TrainingSample(p, r, np.zeros(len(r)), 0.0) for p, r, _ in raw]
    logprobs = trainer.response_logprobs(probes)
    return [TrainingSample(p, r, lp, a) for (p, r, a), lp in zip(raw, logprobs, strict=True)]


def test_one_step_raises_logprobs_of_positive_and_lowers_negative_advantages(tiny_dir):
    trainer = make_trainer(tiny_dir)
    samples = random_samples(trainer)
    before = trainer.response_logprobs(samples)
    metrics = trainer.train_step(samples)
    after = trainer.response_logprobs(samples)
    change = [float((b - a).mean()) for a, b in zip(before, after, strict=True)]
    assert all(c > 0 for c in change[1::2]), change
    assert all(c < 0 for c in change[0::2]), change
    # On-policy data: no mismatch, every behaviour weight is 1.
    assert metrics["mismatch/kl_k3"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["is/token_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["train/response_tokens"] == sum(len(s.response_token_ids) for s in samples)


def test_micro_batch_budget_does_not_change_the_update(tiny_dir):
    # One micro-batch vs many: same loss denominator (global tokens), same gradient.
    results = []
    for budget in (4096, 40):
        torch.manual_seed(0)
        trainer = make_trainer(tiny_dir, max_tokens_per_micro_batch=budget)
        samples = random_samples(trainer)
        metrics = trainer.train_step(samples)
        results.append(
            (metrics, torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
        )
    (one, weights_one), (many, weights_many) = results
    assert many["train/micro_batches"] > one["train/micro_batches"] == 1
    assert one["loss/policy_loss"] == pytest.approx(many["loss/policy_loss"], rel=1e-4, abs=1e-6)
    torch.testing.assert_close(weights_one, weights_many, rtol=1e-4, atol=1e-6)


def test_trainer_and_inference_engine_agree_on_logprobs(tiny_dir):
    engine = InferenceEngine(tiny_dir, max_batch_size=4, seed=0)
    requests = [
        GenerationRequest(
            prompt_token_ids=[1, 10 + i, 20 + i, 30],
            sampling=SamplingParams(max_new_tokens=16, temperature=1.0, seed=i),
        )
        for i in range(4)
    ]
    outputs = engine.generate(requests)
    engine.shutdown()
    trainer = make_trainer(tiny_dir)
    samples = [
        TrainingSample(list(o.prompt_token_ids), o.output_token_ids, o.behaviour_logprobs, 0.0)
        for o in outputs
    ]
    recomputed = np.concatenate(trainer.response_logprobs(samples))
    behaviour = np.concatenate([o.behaviour_logprobs for o in outputs])
    delta = recomputed - behaviour
    k3 = float(np.mean(np.exp(delta) - delta - 1))
    assert np.abs(delta).max() < 1e-4, np.abs(delta).max()
    assert k3 < 1e-8


def test_save_writes_a_loadable_directory_with_optimizer_state(tiny_dir, tmp_path):
    trainer = make_trainer(tiny_dir)
    samples = random_samples(trainer)
    trainer.train_step(samples)
    out = trainer.save(tmp_path / "v1", extra={"policy_version": 1})
    reloaded = make_trainer(out)
    assert reloaded.steps_done == 1
    assert reloaded.optimizer.state_dict()["state"], "AdamW moments were not restored"
    np.testing.assert_allclose(
        np.concatenate(reloaded.response_logprobs(samples)),
        np.concatenate(trainer.response_logprobs(samples)),
        rtol=1e-5,
        atol=1e-6,
    )


def test_bad_samples_give_one_clear_error(tiny_dir):
    trainer = make_trainer(tiny_dir)
    with pytest.raises(ValueError, match="3 response tokens but 2 behaviour log-probs"):
        trainer.train_step([TrainingSample([1, 5], [6, 7, 8], [0.0, 0.0], 1.0)])
    with pytest.raises(ValueError, match="no sample with response tokens"):
        trainer.train_step([TrainingSample([1, 5], [], [], 1.0)])


def test_the_step_reports_the_policy_entropy_where_it_sampled(tiny_dir):
    trainer = make_trainer(tiny_dir)
    samples = random_samples(trainer)
    metrics = trainer.train_step(samples)
    # A random tiny policy is far from decided: its entropy is positive and no more than
    # that of the uniform distribution over the vocabulary.
    assert 0.0 < metrics["policy/entropy"] <= np.log(trainer.model.config.vocab_size) + 1e-6


# ------------------------------------------------------------------ multi-turn episodes


def test_a_masked_token_gets_exactly_zero_gradient_in_the_loss():
    # Three response tokens, the middle one a tool's observation (mask 0). On-policy
    # (all log-probs equal), so u = w = 1 and nothing clips: L = -(A0 + A2) / 2 over
    # the 2 trained tokens, and dL/dlogprobs_t = -mask_t * A_t / 2.
    logprobs = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    same = logprobs.detach().clone()
    advantages = torch.tensor([1.0, 4.0, -3.0])
    mask = torch.tensor([True, False, True])
    loss, _ = make_policy_loss()(
        LossInputs(
            logprobs=logprobs,
            proximal_logprobs=same,
            behaviour_logprobs=same,
            advantages=advantages,
            loss_mask=mask,
            num_global_tokens=2,
        )
    )
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-(1.0 - 3.0) / 2)
    torch.testing.assert_close(logprobs.grad, torch.tensor([-0.5, 0.0, 1.5]))


def episode_sample(trainer, seed=1):
    """A prompt, then 5 generated tokens, 4 observation tokens, 5 more generated."""
    rng = np.random.default_rng(seed)
    vocab = trainer.model.config.vocab_size
    prompt = rng.integers(4, vocab, size=6)
    response = rng.integers(4, vocab, size=14)
    mask = np.array([1] * 5 + [0] * 4 + [1] * 5, dtype=np.uint8)
    (on_policy,) = trainer.response_logprobs([TrainingSample(prompt, response, np.zeros(14), 0.0)])
    return prompt, response, mask, on_policy.astype(np.float32)


def test_observation_tokens_get_zero_gradient_through_the_trainer(tiny_dir):
    trainer = make_trainer(tiny_dir)
    prompt, response, mask, behaviour = episode_sample(trainer)
    batch = trainer.make_batch([TrainingSample(prompt, response, behaviour, 1.0, mask)])
    packed = pack_sequences(batch.sequences)
    logits = trainer._logits(packed).detach().requires_grad_(True)
    logprobs = trainer.packed_logprobs(batch, [0], packed, logits=logits)
    loss, _ = trainer.loss_fn(
        LossInputs(
            logprobs=logprobs,
            proximal_logprobs=logprobs.detach(),
            behaviour_logprobs=batch.behaviour_logprobs,
            advantages=batch.advantages,
            loss_mask=batch.loss_mask,
            num_global_tokens=int(batch.loss_mask.sum()),
        )
    )
    loss.backward()
    # Response token t sits at position len(prompt) + t; the logits before it predict it.
    rows = logits.grad[len(prompt) - 1 : len(prompt) - 1 + len(response)]
    per_token = rows.abs().sum(-1)
    assert torch.all(per_token[torch.from_numpy(mask == 0)] == 0)
    assert torch.all(per_token[torch.from_numpy(mask == 1)] > 0)


def test_what_is_recorded_for_observation_tokens_cannot_change_the_update(tiny_dir):
    weights = []
    for observed_logprob in (0.0, -50.0):
        torch.manual_seed(0)
        trainer = make_trainer(tiny_dir)
        prompt, response, mask, behaviour = episode_sample(trainer)
        behaviour = behaviour.copy()
        behaviour[mask == 0] = observed_logprob  # what a client records for tool output
        metrics = trainer.train_step([TrainingSample(prompt, response, behaviour, 1.0, mask)])
        assert metrics["mismatch/kl_k3"] == pytest.approx(0.0, abs=1e-6)  # masked out
        weights.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)


def test_an_all_ones_mask_trains_exactly_like_no_mask(tiny_dir):
    weights = []
    for with_mask in (False, True):
        torch.manual_seed(0)
        trainer = make_trainer(tiny_dir)
        samples = random_samples(trainer, n=4)
        if with_mask:
            samples = [
                dataclasses.replace(s, loss_mask=np.ones(len(s.response_token_ids), np.uint8))
                for s in samples
            ]
        trainer.train_step(samples)
        weights.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)
