"""Shared-prompt packing: a group's prompt laid out once with its responses as branches,
the same log-probs, loss and update as one sequence per sample, in fewer tokens."""

import numpy as np
import pytest
import torch

from sluice.engines.rl.batching import branch_mask
from sluice.engines.rl.lora import LoraSettings
from sluice.engines.rl.loss import make_policy_loss
from sluice.engines.rl.prompt_sharing import (
    pack_shared_prompts,
    prompt_groups,
    shared_prompt_micro_batches,
)
from sluice.engines.rl.rollout_correction import make_rollout_correction
from sluice.engines.rl.train_batch import TrainerSettings, TrainingSample
from sluice.engines.rl.trainer import PolicyTrainer
from sluice.infra.config.trainer import TrainerConfig
from tests.unit.test_free_proximal import assert_same_parameters
from tests.unit.test_trainer import make_trainer


def t(*values):
    return torch.tensor(values, dtype=torch.int64)


def test_pack_lays_each_prompt_out_once_and_reads_its_responses_in_sample_order():
    # Samples 0 and 2 share the prompt [1, 2]; sample 1 has its own, [3].
    packed = pack_shared_prompts([t(1, 2), t(3), t(1, 2)], [t(5, 6), t(8, 9), t(7)])
    # Block 0: prompt [1, 2] at rows 0-1, sample 0's branch at 2-3, sample 2's at 4.
    # Block 1: prompt [3] at row 5, sample 1's branch at 6-7.
    assert packed.input_ids.tolist() == [[1, 2, 5, 6, 7, 3, 8, 9]]
    # Branch positions continue from the prompt's length (2, then 1).
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2]]
    assert packed.branch_ids.tolist() == [-1, -1, 0, 0, 1, -1, 0, 0]
    assert packed.cu_seqlens.tolist() == [0, 5, 8]
    # Targets in sample order: sample 0 -> 2, 3; sample 1 -> 6, 7; sample 2 -> 4.
    assert packed.target_positions.tolist() == [2, 3, 6, 7, 4]
    # A branch's first token is predicted at its prompt's last row (1 or 5), the rest
    # at the branch's previous token.
    assert packed.logit_rows.tolist() == [1, 2, 5, 6, 1]


def test_branch_mask_lets_a_token_see_the_prompt_and_its_own_branch_only():
    mask = branch_mask(t(-1, -1, 0, 0, 1))
    assert mask.int().tolist() == [
        [1, 0, 0, 0, 0],  # prompt tokens: causal among themselves
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # branch 0
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],  # branch 1 skips branch 0's tokens
    ]


def test_groups_stay_whole_in_a_micro_batch_and_are_cut_only_past_the_budget():
    prompts = [t(1, 2, 3), t(4, 5), t(1, 2, 3), t(4, 5), t(1, 2, 3)]
    lens = [4, 2, 4, 2, 4]
    assert prompt_groups(prompts) == [[0, 2, 4], [1, 3]]
    # Group [0, 2, 4] costs 3 + 12 = 15 tokens, group [1, 3] 2 + 4 = 6: a budget of 21
    # holds both in one micro-batch.
    assert [sorted(mb) for mb in shared_prompt_micro_batches(prompts, lens, 21)] == [
        [0, 1, 2, 3, 4]
    ]
    # A budget of 13: group 0 is cut after two samples (3 + 4 + 4 = 11; a third would
    # make 15), its third (3 + 4 = 7) goes apart with its prompt again, and best fit puts
    # group 1 (6) beside that one (room 6), not beside the first chunk (room 2).
    plan = shared_prompt_micro_batches(prompts, lens, 13)
    assert sorted(sorted(mb) for mb in plan) == [[0, 2], [1, 3, 4]]
    # min_micro_batches counts micro-batches: the two groups at the full budget split.
    assert len(shared_prompt_micro_batches(prompts, lens, 100, min_micro_batches=2)) == 2


def test_pack_refuses_mismatched_or_empty_samples():
    with pytest.raises(ValueError, match="as many responses as prompts"):
        pack_shared_prompts([t(1)], [t(2), t(3)])
    with pytest.raises(ValueError, match="a prompt and a response token"):
        pack_shared_prompts([t(1), t(1)], [t(2), torch.empty(0, dtype=torch.int64)])


def grouped_samples(trainer, groups=3, group_size=4, seed=0):
    """`groups` prompts with `group_size` sampled responses each, behaviour log-probs the
    trainer's own (on-policy), advantages of both signs."""
    rng = np.random.default_rng(seed)
    vocab = trainer.model.config.vocab_size
    raw = []
    for _ in range(groups):
        prompt = rng.integers(4, vocab, size=int(rng.integers(6, 12)))
        for k in range(group_size):
            response = rng.integers(4, vocab, size=int(rng.integers(1, 9)))
            raw.append((prompt, response, 1.0 if k % 2 else -1.0))
    order = rng.permutation(len(raw))  # groups interleaved, as a minibatch split leaves them
    raw = [raw[i] for i in order]
    probes = [TrainingSample(p, r, np.zeros(len(r)), 0.0) for p, r, _ in raw]
    logprobs = trainer.response_logprobs(probes)
    return [TrainingSample(p, r, lp, a) for (p, r, a), lp in zip(raw, logprobs, strict=True)]


def test_shared_packing_gives_the_same_logprobs_in_fewer_tokens(tiny_dir):
    separate, shared = make_trainer(tiny_dir), make_trainer(tiny_dir, shared_prompt=True)
    samples = grouped_samples(separate)
    a, b = separate.response_logprobs(samples), shared.response_logprobs(samples)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    batch = shared.make_batch(samples)
    indices = list(range(len(samples)))
    assert shared._pack(batch, indices).total_tokens < separate._pack(batch, indices).total_tokens


@pytest.mark.parametrize("settings", [{}, {"ppo_minibatches": 2, "max_tokens_per_micro_batch": 40}])
def test_shared_packing_trains_the_same_update(tiny_dir, settings):
    separate = make_trainer(tiny_dir, **settings)
    shared = make_trainer(tiny_dir, shared_prompt=True, **settings)
    for seed in range(2):  # the second step trains off-policy samples of version 0
        samples = grouped_samples(separate if seed == 0 else make_trainer(tiny_dir), seed=seed)
        x, y = separate.train_step(samples), shared.train_step(samples)
        # The gradient's norm as well as the weights: Adam's first steps move a weight
        # by about lr x sign(g), which would hide a gradient wrong in size only.
        for key in ("loss/policy_loss", "train/grad_norm"):
            torch.testing.assert_close(x[key], y[key], rtol=1e-5, atol=1e-7)
        assert x["train/trained_tokens"] == y["train/trained_tokens"]
        assert y["train/packed_tokens"] < x["train/packed_tokens"] == x["train/trained_tokens"]
    assert_same_parameters(separate, shared)


def test_shared_packing_reaches_the_attention_through_lora_adapters(tiny_dir):
    # peft's wrapper passes the model call's keyword arguments on; were `branch_ids`
    # dropped on the way, every branch would attend to the ones before it.
    def lora_trainer(**settings):
        torch.manual_seed(0)  # the adapters' A matrices start random: the same for both
        return PolicyTrainer(
            tiny_dir,
            TrainerSettings(lr=1e-3, **settings),
            make_policy_loss(),
            make_rollout_correction("token_tis", threshold=2.0),
            lora=LoraSettings(rank=4, alpha=8),
        )

    separate, shared = lora_trainer(), lora_trainer(shared_prompt=True)
    samples = grouped_samples(separate)
    x, y = separate.train_step(samples), shared.train_step(samples)
    for key in ("loss/policy_loss", "train/grad_norm"):
        torch.testing.assert_close(x[key], y[key], rtol=1e-5, atol=1e-7)
    assert y["train/packed_tokens"] < x["train/packed_tokens"]
    # After the step (B no longer zero) the adapters' outputs enter the logits.
    a, b = separate.response_logprobs(samples), shared.response_logprobs(samples)
    for u, v in zip(a, b, strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)


def test_config_refuses_shared_prompt_on_megatron():
    with pytest.raises(ValueError, match="shared_prompt needs trainer.backend=torch"):
        TrainerConfig(backend="megatron", shared_prompt=True)
