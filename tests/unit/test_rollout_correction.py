"""Rollout correction of the behaviour weight: every mode by hand, and the denominator policy."""

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


def test_none_gives_exp_delta():
    prox, behav, mask = _from_delta([-1.0, 0.5])
    out = correct_behaviour_weights(prox, behav, mask, mode="none")
    # exp(-1) = 0.3679, exp(0.5) = 1.6487
    torch.testing.assert_close(out.behaviour_weights, torch.tensor([0.36787944, 1.64872127]))
    assert out.loss_mask.tolist() == [True, True]


def test_token_tis_truncates_each_token_at_c():
    prox, behav, mask = _from_delta([-1.0, 0.5, 1.0])
    out = correct_behaviour_weights(prox, behav, mask, mode="token_tis", threshold=1.5)
    # [exp(-1), min(1.6487, 1.5), min(2.7183, 1.5)] = [0.3679, 1.5, 1.5]
    torch.testing.assert_close(out.behaviour_weights, torch.tensor([0.36787944, 1.5, 1.5]))
    assert out.loss_mask.all()


# Two responses: the first has product ratio 1.5 * 2 = 3, the second exp(0.1 - 0.3) = 0.8187.
SEQ_DELTA = [math.log(1.5), math.log(2.0), 0.1, -0.3]
CU = torch.tensor([0, 2, 4])


def test_sequence_tis_truncates_product_ratio_of_three_to_two():
    prox, behav, mask = _from_delta(SEQ_DELTA)
    out = correct_behaviour_weights(
        prox, behav, mask, cu_seqlens=CU, mode="sequence_tis", threshold=2.0
    )
    # response 0: min(3, 2) = 2 on both tokens; response 1: exp(-0.2) = 0.81873
    torch.testing.assert_close(
        out.behaviour_weights, torch.tensor([2.0, 2.0, 0.81873075, 0.81873075])
    )
    assert out.loss_mask.all()


def test_sequence_mis_masks_the_response_with_product_ratio_three():
    prox, behav, mask = _from_delta(SEQ_DELTA)
    out = correct_behaviour_weights(
        prox, behav, mask, cu_seqlens=CU, mode="sequence_mis", threshold=2.0
    )
    # response 0: 3 > 2, rejected; response 1 keeps its sequence weight exp(-0.2)
    torch.testing.assert_close(
        out.behaviour_weights, torch.tensor([0.0, 0.0, 0.81873075, 0.81873075])
    )
    assert out.loss_mask.tolist() == [False, False, True, True]


def test_token_mis_masks_only_tokens_above_c():
    prox, behav, mask = _from_delta([-1.0, 0.5, 1.0])
    out = correct_behaviour_weights(prox, behav, mask, mode="token_mis", threshold=2.0)
    # exp(1) = 2.718 > 2 is masked; the others keep exp(delta)
    torch.testing.assert_close(out.behaviour_weights, torch.tensor([0.36787944, 1.64872127, 0.0]))
    assert out.loss_mask.tolist() == [True, True, False]


def test_geometric_rs_masks_responses_whose_geometric_mean_ratio_leaves_the_band():
    # response A: mean(0.3, -0.1) = 0.1 -> exp 1.105 > 1.1, rejected
    # response B: mean(0.05, -0.05, 0) = 0 -> 1.0, kept with w = exp(delta_t)
    # response C: mean(-0.2) -> 0.8187 < 0.9, rejected
    prox, behav, mask = _from_delta([0.3, -0.1, 0.05, -0.05, 0.0, -0.2])
    out = correct_behaviour_weights(
        prox,
        behav,
        mask,
        sequence_ids=torch.tensor([0, 0, 1, 1, 1, 2]),
        mode="geometric_rs",
        geometric_lower=0.9,
        geometric_upper=1.1,
    )
    expected = torch.tensor([0.0, 0.0, 1.05127110, 0.95122942, 1.0, 0.0])
    torch.testing.assert_close(out.behaviour_weights, expected)
    assert out.loss_mask.tolist() == [False, False, True, True, True, False]


def test_prompt_tokens_do_not_enter_sequence_sums():
    # Response 0 is [prompt, prompt, r, r]; the prompt positions carry a huge fake delta.
    prox, behav, mask = _from_delta(
        [40.0, -40.0, math.log(1.5), math.log(2.0), 0.1, -0.3],
        [False, False, True, True, True, True],
    )
    out = correct_behaviour_weights(
        prox, behav, mask, cu_seqlens=torch.tensor([0, 4, 6]), mode="sequence_tis", threshold=2.0
    )
    torch.testing.assert_close(
        out.behaviour_weights, torch.tensor([0.0, 0.0, 2.0, 2.0, 0.81873075, 0.81873075])
    )
    assert out.loss_mask.tolist() == [False, False, True, True, True, True]


def test_cu_seqlens_and_sequence_ids_agree():
    torch.manual_seed(0)
    prox = -torch.rand(9)
    behav = prox - 0.2 * torch.randn(9)
    mask = torch.rand(9) > 0.2
    for mode in ROLLOUT_CORRECTIONS:
        a = correct_behaviour_weights(
            prox, behav, mask, cu_seqlens=torch.tensor([0, 3, 4, 9]), mode=mode, threshold=1.1
        )
        b = correct_behaviour_weights(
            prox,
            behav,
            mask,
            sequence_ids=torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 2]),
            mode=mode,
            threshold=1.1,
        )
        torch.testing.assert_close(a.behaviour_weights, b.behaviour_weights)
        assert torch.equal(a.loss_mask, b.loss_mask)


def test_masked_tokens_leave_the_numerator_but_stay_in_the_denominator():
    # Four valid tokens with u = 1 and A = 1, so each costs -w. Token 2 has ratio 4 > C = 2.
    prox, behav, mask = _from_delta([0.0, 0.0, math.log(4.0), 0.0])
    num_global_tokens = int(mask.sum())  # counted before correction
    out = correct_behaviour_weights(prox, behav, mask, mode="token_mis", threshold=2.0)
    loss, _ = decoupled_ppo_loss(
        LossInputs(
            logprobs=prox.clone(),
            proximal_logprobs=prox,
            behaviour_logprobs=behav,
            advantages=torch.ones(4),
            loss_mask=out.loss_mask,
            num_global_tokens=num_global_tokens,
            behaviour_weights=out.behaviour_weights,
        )
    )
    # L = -(1 + 1 + 0 + 1) / 4 = -0.75, not -(1 + 1 + 1) / 3 = -1 (re-normalised survivors)
    torch.testing.assert_close(loss, torch.tensor(-0.75))


def test_make_rollout_correction_binds_config():
    fn = make_rollout_correction(mode="sequence_tis", threshold=2.0)
    prox, behav, mask = _from_delta(SEQ_DELTA)
    out = fn(prox, behav, mask, cu_seqlens=CU)
    torch.testing.assert_close(out.behaviour_weights[:2], torch.tensor([2.0, 2.0]))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda p, b, m: make_rollout_correction(mode="seq_tis"),
            "unknown rollout correction mode",
        ),
        (lambda p, b, m: make_rollout_correction(threshold=0.0), "threshold must be positive"),
        (
            lambda p, b, m: make_rollout_correction(geometric_lower=1.1, geometric_upper=0.9),
            "geometric_lower <= geometric_upper",
        ),
        (
            lambda p, b, m: correct_behaviour_weights(p, b, m, mode="sequence_mis"),
            "needs sequence boundaries",
        ),
        (
            lambda p, b, m: correct_behaviour_weights(
                p, b, m, cu_seqlens=torch.tensor([0, 2, 5]), mode="sequence_mis"
            ),
            "cu_seqlens ends at 5",
        ),
        (
            lambda p, b, m: correct_behaviour_weights(p, b[:3], m, mode="none"),
            "behaviour_logprobs has shape",
        ),
        (
            lambda p, b, m: correct_behaviour_weights(
                p, torch.tensor([0.0, float("nan"), 0.0, 0.0]), m, mode="none"
            ),
            "not finite on a valid token",
        ),
    ],
)
def test_bad_inputs_raise_one_clear_error(call, message):
    prox, behav, mask = _from_delta(SEQ_DELTA)
    with pytest.raises(ValueError, match=message):
        call(prox, behav, mask)
