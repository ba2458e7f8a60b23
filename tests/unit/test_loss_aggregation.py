"""Loss aggregation modes: hand-worked factors, the token_scale path of the loss, and
micro-batch invariance (whole sequences split across micro-batches add up exactly)."""

import math

import pytest
import torch

from sluice.engines.rl.aggregation import LOSS_AGG_MODES, aggregation_scale
from sluice.engines.rl.batching import dynamic_micro_batches
from sluice.engines.rl.loss import decoupled_ppo_loss
from sluice.engines.rl.loss_inputs import LossInputs

# Six tokens of three sequences in one micro-batch; the minibatch has G = 4 trained
# sequences in all (two more live in other micro-batches):
#   sequence ids  [0, 0, 0, 1, 2, 2]
#   loss mask     [1, 1, 0, 1, 0, 0]   -> n_0 = 2, n_1 = 1, n_2 = 0
IDS = torch.tensor([0, 0, 0, 1, 2, 2])
MASK = torch.tensor([True, True, False, True, False, False])


def test_token_mean_keeps_the_global_token_denominator():
    assert aggregation_scale(MASK, IDS, "token-mean", 4) is None


def test_seq_mean_token_mean_scale_is_one_over_sequence_length_times_sequences():
    scale = aggregation_scale(MASK, IDS, "seq-mean-token-mean", 4)
    # sequence 0: 1 / (n_0 G) = 1 / (2 * 4) = 0.125 on all three tokens (the masked one
    # too: the mask zeroes it in the loss); sequence 1: 1 / (1 * 4) = 0.25;
    # sequence 2 has no trained token: 0, not 1 / 0.
    torch.testing.assert_close(
        scale, torch.tensor([0.125, 0.125, 0.125, 0.25, 0.0, 0.0], dtype=torch.float64)
    )


def test_seq_mean_token_sum_scale_is_one_over_sequences():
    scale = aggregation_scale(MASK, IDS, "seq-mean-token-sum", 4)
    # 1 / G = 0.25 for every token of a trained sequence, 0 for sequence 2.
    torch.testing.assert_close(
        scale, torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0, 0.0], dtype=torch.float64)
    )


def test_a_micro_batch_without_trained_tokens_gets_zero_scale_not_nan():
    scale = aggregation_scale(torch.zeros(3), torch.tensor([0, 0, 1]), "seq-mean-token-mean", 2)
    torch.testing.assert_close(scale, torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((MASK, IDS, "sequence-mean", 4), "token-mean, seq-mean-token-mean, seq-mean-token-sum"),
        ((MASK, IDS, "seq-mean-token-sum", 0), "num_global_sequences must be positive"),
        ((MASK, IDS[:5], "seq-mean-token-mean", 4), "sequence_ids has shape"),
        ((MASK, IDS.float(), "seq-mean-token-mean", 4), "integer"),
        ((MASK, -IDS, "seq-mean-token-mean", 4), "non-negative"),
    ],
)
def test_bad_aggregation_arguments_raise_one_clear_error(args, message):
    with pytest.raises(ValueError, match=message):
        aggregation_scale(*args)


# The three tokens of test_loss.py, now as two sequences [0, 0, 1]. Their decoupled-PPO
# token losses mask * w * l (AReaL eq. 3, worked there) are
#   l = [-0.40466739, +1.31897702, -2.4]
PROX = torch.tensor([-1.0, -2.0, -0.5])
U = torch.tensor([1.1, 0.7, 1.3])
DELTA = torch.tensor([-1.0, 0.5, 0.0])
ADV = torch.tensor([1.0, -1.0, 2.0])
PPO_IDS = torch.tensor([0, 0, 1])


def _ppo(mode, loss_mask=None, scale_mask=None):
    mask = torch.ones(3, dtype=torch.bool) if loss_mask is None else loss_mask
    scale_mask = mask if scale_mask is None else scale_mask
    logprobs = (PROX + U.log()).requires_grad_(True)
    scale = aggregation_scale(scale_mask, PPO_IDS, mode, 2)
    loss, metrics = decoupled_ppo_loss(
        LossInputs(
            logprobs=logprobs,
            proximal_logprobs=PROX,
            behaviour_logprobs=PROX - DELTA,
            advantages=ADV,
            loss_mask=mask,
            num_global_tokens=3,
            token_scale=scale,
            sequence_ids=PPO_IDS,
        )
    )
    loss.backward()
    return loss, logprobs.grad, metrics


def test_ppo_with_seq_mean_token_mean_averages_each_sequence_then_the_sequences():
    loss, grad, metrics = _ppo("seq-mean-token-mean")
    # ((-0.40466739 + 1.31897702) / 2 + (-2.4) / 1) / 2 = 0.22857741 - 1.2 = -0.97142259
    torch.testing.assert_close(loss, torch.tensor(-0.97142259))
    torch.testing.assert_close(metrics["loss/policy_loss"], torch.tensor(-0.97142259))
    # Only token 0 is unclipped: d/dlogprob of -w u A / 4 = -(e^-1 * 1.1 * 1) / 4.
    torch.testing.assert_close(grad, torch.tensor([-math.exp(-1) * 1.1 / 4, 0.0, 0.0]))


def test_ppo_with_seq_mean_token_sum_sums_each_sequence_then_averages():
    loss, _, _ = _ppo("seq-mean-token-sum")
    # ((-0.40466739 + 1.31897702) + (-2.4)) / 2 = -1.48569037 / 2 = -0.74284519
    torch.testing.assert_close(loss, torch.tensor(-0.74284519))


def test_tokens_rejected_by_correction_keep_their_place_in_the_sequence_length():
    # Rollout correction drops token 1; n_0 stays 2 because the scale is counted from the
    # mask before correction: (-0.40466739 + 0) / 2 / 2 + (-2.4) / 2 = -1.30116685
    corrected = torch.tensor([True, False, True])
    loss, _, _ = _ppo("seq-mean-token-mean", loss_mask=corrected, scale_mask=torch.ones(3))
    torch.testing.assert_close(loss, torch.tensor(-0.40466739 / 4 - 1.2))


def test_token_mean_is_the_unscaled_loss_bit_for_bit():
    loss, grad, _ = _ppo("token-mean")
    logprobs = (PROX + U.log()).requires_grad_(True)
    plain, _ = decoupled_ppo_loss(
        LossInputs(
            logprobs=logprobs,
            proximal_logprobs=PROX,
            behaviour_logprobs=PROX - DELTA,
            advantages=ADV,
            loss_mask=torch.ones(3),
            num_global_tokens=3,
        )
    )
    plain.backward()
    assert torch.equal(loss, plain)
    assert torch.equal(grad, logprobs.grad)


def _reference_loss(mode, token_losses, mask, seq_lens):
    """The aggregated loss written out per sequence, straight from the mode's definition."""
    per_sequence = []
    start = 0
    for length in seq_lens:
        l_i, m_i = token_losses[start : start + length], mask[start : start + length]
        start += length
        if m_i.any():
            per_sequence.append((l_i[m_i].mean(), l_i[m_i].sum()))
    g = len(per_sequence)
    if mode == "token-mean":
        return token_losses[mask].sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        return sum(mean for mean, _ in per_sequence) / g
    return sum(total for _, total in per_sequence) / g


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_micro_batch_losses_add_up_to_the_full_batch_loss(mode, seed):
    generator = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, 9, (7,), generator=generator).tolist()
    total = sum(seq_lens)
    token_losses = torch.randn(total, generator=generator, dtype=torch.float64)
    mask = torch.rand(total, generator=generator) > 0.3
    mask[: seq_lens[0]] = False  # one sequence without trained tokens
    seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    num_tokens = int(mask.sum())
    num_sequences = sum(1 for s in range(len(seq_lens)) if mask[seq_of_token == s].any())

    def aggregated(rows, local_ids):
        scale = aggregation_scale(mask[rows], local_ids, mode, num_sequences)
        weighted = torch.where(mask[rows], token_losses[rows], 0.0)
        return weighted.sum() / num_tokens if scale is None else (weighted * scale).sum()

    full = aggregated(torch.arange(total), seq_of_token)
    torch.testing.assert_close(
        full, _reference_loss(mode, token_losses, mask, seq_lens), check_dtype=False
    )

    starts = torch.tensor([0, *seq_lens]).cumsum(0).tolist()
    micro_batches = dynamic_micro_batches(seq_lens, 12, min_micro_batches=2)
    assert len(micro_batches) >= 2
    parts = []
    for mb in micro_batches:
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in mb])
        # Ids restart in every micro-batch: the position of the sequence within it.
        local_ids = torch.cat(
            [torch.full((seq_lens[i],), k, dtype=torch.int64) for k, i in enumerate(mb)]
        )
        parts.append(aggregated(rows, local_ids))
    torch.testing.assert_close(sum(parts), full, check_dtype=False)
