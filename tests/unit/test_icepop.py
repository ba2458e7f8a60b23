"""IcePop rollout correction: tokens outside [lower, upper] are masked, on both sides, one by one."""

import math

import pytest
import torch

from sluice.engines.rl.loss import decoupled_ppo_loss
from sluice.engines.rl.loss_inputs import LossInputs
from sluice.engines.rl.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    correct_behaviour_weights,
    make_rollout_correction,
)


def _from_delta(delta, mask=None):
    """Log-probs with proximal - behaviour = delta."""
    delta = torch.tensor(delta)
    behav = torch.full_like(delta, -1.5)
    mask = torch.ones_like(delta, dtype=torch.bool) if mask is None else torch.tensor(mask)
    return behav + delta, behav, mask


# ratios 0.4, 0.6, 1, 4, 6 against the default bounds [0.5, 5]
RATIOS = [0.4, 0.6, 1.0, 4.0, 6.0]


def test_icepop_masks_tokens_below_lower_and_above_upper():
    prox, behav, mask = _from_delta([math.log(r) for r in RATIOS])
    out = correct_behaviour_weights(prox, behav, mask, mode="icepop")
    # 0.4 < 0.5 and 6 > 5 are masked; the rest keep their plain weight exp(delta)
    torch.testing.assert_close(out.behaviour_weights, torch.tensor([0.0, 0.6, 1.0, 4.0, 0.0]))
    assert out.loss_mask.tolist() == [False, True, True, True, False]


def test_token_mis_keeps_the_collapsed_token_that_icepop_masks():
    prox, behav, mask = _from_delta([math.log(r) for r in RATIOS])
    out = correct_behaviour_weights(prox, behav, mask, mode="token_mis", threshold=5.0)
    # token_mis only rejects above C: the 0.4 token survives there
    assert out.loss_mask.tolist() == [True, True, True, True, False]


def test_bounds_are_inclusive():
    prox, behav, mask = _from_delta([0.0, 0.0])
    out = correct_behaviour_weights(
        prox, behav, mask, mode="icepop", icepop_lower=1.0, icepop_upper=1.0
    )
    # exp(0) = 1 lies in [1, 1]
    assert out.loss_mask.tolist() == [True, True]
    torch.testing.assert_close(out.behaviour_weights, torch.tensor([1.0, 1.0]))


def test_icepop_never_masks_a_whole_response_for_one_bad_token():
    # response 0: ratios [0.3, 1.1, 0.9]; response 1: [8, 1.0]; one outlier each
    delta = [math.log(r) for r in (0.3, 1.1, 0.9, 8.0, 1.0)]
    ids = torch.tensor([0, 0, 0, 1, 1])
    prox, behav, mask = _from_delta(delta)
    out = correct_behaviour_weights(prox, behav, mask, sequence_ids=ids, mode="icepop")
    assert out.loss_mask.tolist() == [False, True, True, False, True]
    torch.testing.assert_close(out.behaviour_weights, torch.tensor([0.0, 1.1, 0.9, 0.0, 1.0]))
    # geometric_rs with the same band keeps both responses whole, outliers included
    geo = correct_behaviour_weights(
        prox,
        behav,
        mask,
        sequence_ids=ids,
        mode="geometric_rs",
        geometric_lower=0.5,
        geometric_upper=5.0,
    )
    # geometric means (0.3 * 1.1 * 0.9)^(1/3) = 0.667 and 8^(1/2) = 2.83 both lie in
    # [0.5, 5]: the whole-response rule cannot see either outlier token
    assert geo.loss_mask.tolist() == [True, True, True, True, True]


def test_icepop_decides_each_token_alone_whatever_the_grouping():
    torch.manual_seed(0)
    prox = -torch.rand(40)
    behav = prox - torch.randn(40)
    mask = torch.rand(40) > 0.2
    alone = correct_behaviour_weights(prox, behav, mask, mode="icepop")
    for cu in ([0, 40], [0, 3, 17, 40], list(range(41))):
        grouped = correct_behaviour_weights(
            prox, behav, mask, cu_seqlens=torch.tensor(cu), mode="icepop"
        )
        assert torch.equal(grouped.loss_mask, alone.loss_mask)
        assert torch.equal(grouped.behaviour_weights, alone.behaviour_weights)
    delta = (prox - behav)[mask]
    in_band = (delta >= math.log(0.5)) & (delta <= math.log(5.0))
    assert bool((delta < math.log(0.5)).any()) and bool((delta > math.log(5.0)).any())
    assert torch.equal(alone.loss_mask[mask], in_band)
    assert not bool(alone.loss_mask[~mask].any())


def test_prompt_tokens_with_huge_delta_stay_masked_and_finite():
    prox, behav, mask = _from_delta([500.0, -500.0, 0.1], [False, False, True])
    out = correct_behaviour_weights(prox, behav, mask, mode="icepop")
    torch.testing.assert_close(out.behaviour_weights, torch.tensor([0.0, 0.0, 1.10517092]))
    assert out.loss_mask.tolist() == [False, False, True]


def test_icepop_masked_tokens_stay_in_the_denominator():
    # u = 1, A = 1: each token costs -w. Ratios 0.25 (masked), 1, 2, 8 (masked); N = 4.
    prox, behav, mask = _from_delta([math.log(0.25), 0.0, math.log(2.0), math.log(8.0)])
    out = correct_behaviour_weights(prox, behav, mask, mode="icepop")
    loss, _ = decoupled_ppo_loss(
        LossInputs(
            logprobs=prox.clone(),
            proximal_logprobs=prox,
            behaviour_logprobs=behav,
            advantages=torch.ones(4),
            loss_mask=out.loss_mask,
            num_global_tokens=4,
            behaviour_weights=out.behaviour_weights,
        )
    )
    # L = -(0 + 1 + 2 + 0) / 4 = -0.75
    torch.testing.assert_close(loss, torch.tensor(-0.75))


def test_make_rollout_correction_binds_icepop_bounds():
    fn = make_rollout_correction(mode="icepop", icepop_lower=0.8, icepop_upper=1.5)
    prox, behav, mask = _from_delta([math.log(r) for r in (0.7, 0.9, 1.4, 1.6)])
    assert fn(prox, behav, mask).loss_mask.tolist() == [False, True, True, False]


def test_icepop_bounds_leave_other_modes_bit_identical():
    torch.manual_seed(1)
    prox = -torch.rand(9)
    behav = prox - 0.3 * torch.randn(9)
    mask = torch.rand(9) > 0.2
    cu = torch.tensor([0, 3, 4, 9])
    for mode in ROLLOUT_CORRECTIONS:
        if mode == "icepop":
            continue
        a = correct_behaviour_weights(prox, behav, mask, cu_seqlens=cu, mode=mode)
        b = correct_behaviour_weights(
            prox, behav, mask, cu_seqlens=cu, mode=mode, icepop_lower=0.9, icepop_upper=1.1
        )
        assert torch.equal(a.behaviour_weights, b.behaviour_weights)
        assert torch.equal(a.loss_mask, b.loss_mask)


@pytest.mark.parametrize(
    ("lower", "upper"),
    [(0.0, 5.0), (-0.5, 5.0), (1.2, 5.0), (0.5, 0.9)],
)
def test_bad_icepop_bounds_raise_one_clear_error(lower, upper):
    with pytest.raises(ValueError, match="0 < icepop_lower <= 1 <= icepop_upper"):
        make_rollout_correction(mode="icepop", icepop_lower=lower, icepop_upper=upper)
