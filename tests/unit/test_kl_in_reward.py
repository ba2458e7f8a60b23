"""A KL penalty in the reward: each response's reward loses β Σ_t k_t (between the log-probs
it was sampled with and version 0's), and the advantages are computed again from that."""

import numpy as np
import pytest
import torch

from sluice.engines.rl.advantages import make_advantage_fn
from sluice.engines.rl.loss import make_policy_loss
from sluice.engines.rl.rollout_correction import make_rollout_correction
from sluice.engines.rl.train_batch import TrainerSettings, TrainingSample
from sluice.engines.rl.trainer import PolicyTrainer

BETA = 0.5


def trainer(model_dir, **settings):
    return PolicyTrainer(
        model_dir,
        TrainerSettings(lr=1e-3, **settings),
        make_policy_loss(),
        make_rollout_correction("token_tis", threshold=2.0),
        reference_dir=model_dir if settings.get("kl_coef") else None,
        advantage_fn=make_advantage_fn("grpo"),
    )


def test_the_penalty_moves_the_advantages_exactly_as_a_shifted_reward_would(tiny_dir):
    rng = np.random.default_rng(0)
    with_kl = trainer(tiny_dir, kl_coef=BETA, kl_estimator="k1", kl_in_reward=True)
    vocab = with_kl.model.config.vocab_size
    raw = [
        (rng.integers(4, vocab, size=5), rng.integers(4, vocab, size=n), reward, group)
        for n, reward, group in [(3, 1.0, 7), (4, 0.0, 7), (2, 1.0, 9), (5, 1.0, 9)]
    ]
    reference = with_kl.response_logprobs(
        [TrainingSample(p, r, np.zeros(len(r)), 0.0) for p, r, _, _ in raw]
    )
    # The sampler was log π_ref + d per token: k1 = d, so response i loses β Σ d.
    shifts = [np.full(len(r), 0.1 * (i + 1)) for i, (_, r, _, _) in enumerate(raw)]
    penalties = [BETA * float(d.sum()) for d in shifts]  # 0.15, 0.4, 0.3, 1.0
    samples = [
        TrainingSample(p, r, ref + d, 0.0, reward=reward, group=group)
        for (p, r, reward, group), ref, d in zip(raw, reference, shifts, strict=True)
    ]
    metrics = with_kl.train_step(samples)
    assert metrics["reward/kl_penalty_mean"] == pytest.approx(np.mean(penalties), rel=1e-5)
    assert metrics["train/reference_pass_tokens"] == 14

    # The same step without a penalty, fed the advantages of the shifted rewards.
    shifted = torch.tensor(
        [reward - pen for (_, _, reward, _), pen in zip(raw, penalties, strict=True)]
    )
    advantages = make_advantage_fn("grpo")(shifted, group_ids=torch.tensor([0, 0, 1, 1]))
    plain = trainer(tiny_dir)
    plain.train_step(
        [
            TrainingSample(s.prompt_token_ids, s.response_token_ids, s.behaviour_logprobs, float(a))
            for s, a in zip(samples, advantages.advantages, strict=True)
        ]
    )
    for a, b in zip(with_kl.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    # Group 9 had equal rewards: only the penalty gave it an advantage, and a real one.
    assert abs(float(advantages.advantages[2])) > 0.5


def test_a_sample_without_its_reward_is_refused_in_one_line(tiny_dir):
    with_kl = trainer(tiny_dir, kl_coef=BETA, kl_in_reward=True)
    sample = TrainingSample([5, 6, 7], [8, 9], [-1.0, -1.0], 1.0)
    with pytest.raises(ValueError, match="needs every sample's reward and group"):
        with_kl.train_step([sample])
