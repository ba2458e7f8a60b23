"""Mismatch metrics against hand-worked values."""

import math

import pytest
import torch

from sluice.engines.rl.metrics import effective_sample_size, mismatch_metrics
from sluice.engines.rl.rollout_correction import correct_behaviour_weights

LN2 = math.log(2.0)
# Packed row: response 0 = [prompt token, t0, t1], response 1 = [t2].
# Valid tokens: behaviour b = [-1, -2, -0.5], proximal p = [-1, -2 + ln2, -0.5 - ln2],
# so delta = p - b = [0, ln2, -ln2] and the weights exp(delta) = [1, 2, 0.5].
# The prompt token carries junk that must not count.
BEHAV = torch.tensor([-9.0, -1.0, -2.0, -0.5])
PROX = torch.tensor([3.0, -1.0, -2.0 + LN2, -0.5 - LN2])
MASK = torch.tensor([False, True, True, True])
CU = torch.tensor([0, 3, 4])


def test_mismatch_metrics_match_hand_worked_values():
    m = mismatch_metrics(PROX, BEHAV, MASK, cu_seqlens=CU)
    assert m["mismatch/valid_tokens"] == 3
    assert m["mismatch/num_sequences"] == 2
    # k3 per token exp(d) - d - 1: [0, 2 - ln2 - 1, 0.5 + ln2 - 1] = [0, 0.306853, 0.193147]
    assert m["mismatch/kl_k3"] == pytest.approx(0.5 / 3)
    # k1 = mean(-d) = (0 - ln2 + ln2) / 3 = 0
    assert m["mismatch/kl_k1"] == pytest.approx(0.0, abs=1e-7)
    # chi2 token = mean(w^2) - 1 = (1 + 4 + 0.25) / 3 - 1 = 0.75
    assert m["mismatch/chi2_token"] == pytest.approx(0.75)
    # sequence weights: exp(0 + ln2) = 2 and exp(-ln2) = 0.5; chi2 = (4 + 0.25) / 2 - 1
    assert m["mismatch/chi2_sequence"] == pytest.approx(1.125)
    assert m["is/token_weight_mean"] == pytest.approx(3.5 / 3)
    assert m["is/token_weight_max"] == pytest.approx(2.0)
    assert m["is/token_weight_min"] == pytest.approx(0.5)
    # ESS = (sum w)^2 / (N sum w^2) = 3.5^2 / (3 * 5.25) = 0.777778
    assert m["is/ess_token"] == pytest.approx(12.25 / 15.75)
    # sequences: 2.5^2 / (2 * 4.25) = 0.735294
    assert m["is/ess_sequence"] == pytest.approx(6.25 / 8.5)
    # rollout ppl: exp(1.5) = 4.481689 and exp(0.5) = 1.648721 -> mean 3.065205
    assert m["mismatch/rollout_ppl"] == pytest.approx((math.exp(1.5) + math.exp(0.5)) / 2)
    # training ppl: exp(1.5 - ln2/2) = 3.169022 and exp(0.5 + ln2) = 3.297443 -> mean 3.233233
    assert m["mismatch/training_ppl"] == pytest.approx(
        (math.exp(1.5 - LN2 / 2) + math.exp(0.5 + LN2)) / 2
    )
    # log ppl_train - log ppl_rollout per response = -mean(d): [-ln2/2, ln2]
    assert m["mismatch/log_ppl_diff"] == pytest.approx((-LN2 / 2 + LN2) / 2)
    assert m["mismatch/log_ppl_abs_diff"] == pytest.approx((LN2 / 2 + LN2) / 2)
    assert "is/masked_fraction" not in m and "policy/entropy" not in m


def test_k3_sign_convention_is_kl_of_behaviour_from_proximal():
    # KL(pi_behav || pi_prox) on a two-token vocabulary, sampled exhaustively:
    # behav = [0.5, 0.5], prox = [0.8, 0.2]. Weighting each token by its behaviour
    # probability turns the sample mean of k3 into the exact KL.
    behav = torch.log(torch.tensor([0.5, 0.5]))
    prox = torch.log(torch.tensor([0.8, 0.2]))
    m = mismatch_metrics(
        prox, behav, torch.ones(2, dtype=torch.bool), cu_seqlens=torch.tensor([0, 1, 2])
    )
    exact = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    assert m["mismatch/kl_k3"] == pytest.approx(exact)
    assert m["mismatch/kl_k1"] == pytest.approx(exact)


def test_correction_metrics_count_rejected_tokens_as_zero_weight():
    out = correct_behaviour_weights(PROX, BEHAV, MASK, mode="token_mis", threshold=1.5)
    m = mismatch_metrics(
        PROX,
        BEHAV,
        MASK,
        cu_seqlens=CU,
        behaviour_weights=out.behaviour_weights,
        corrected_loss_mask=out.loss_mask,
    )
    # token t1 (w = 2 > 1.5) is masked: corrected weights over valid tokens = [1, 0, 0.5]
    assert m["is/masked_fraction"] == pytest.approx(1 / 3)
    assert m["is/rejected_sequence_fraction"] == 0.0
    assert m["is/corrected_weight_mean"] == pytest.approx(0.5)
    assert m["is/corrected_weight_max"] == pytest.approx(1.0)
    assert m["is/corrected_weight_min"] == 0.0
    # ESS = 1.5^2 / (3 * 1.25) = 0.6
    assert m["is/ess_corrected"] == pytest.approx(0.6)


def test_entropy_of_valid_tokens_handles_masked_vocabulary():
    inf = float("inf")
    logits = torch.tensor(
        [
            [5.0, -inf, 0.0, 0.0],  # prompt row: ignored
            [0.0, 0.0, 0.0, 0.0],  # uniform over 4: ln 4
            [0.0, 0.0, -inf, -inf],  # uniform over 2: ln 2
            [1.0, 1.0, 1.0, 1.0],  # ln 4
        ]
    )
    m = mismatch_metrics(PROX, BEHAV, MASK, cu_seqlens=CU, logits=logits)
    assert m["policy/entropy"] == pytest.approx((2 * math.log(4) + math.log(2)) / 3)


def test_effective_sample_size_of_uniform_and_degenerate_weights():
    assert effective_sample_size(torch.ones(5)) == pytest.approx(1.0)
    # one weight carries everything: ESS = 1^2 / (4 * 1) = 1/4
    assert effective_sample_size(torch.tensor([0.0, 0.0, 1.0, 0.0])) == pytest.approx(0.25)


def test_runaway_sequence_stays_finite():
    delta = torch.full((400,), 0.5)  # sum 200: exp would overflow float64 when squared
    m = mismatch_metrics(
        delta - 1.0,
        torch.full((400,), -1.0),
        torch.ones(400, dtype=torch.bool),
        cu_seqlens=torch.tensor([0, 400]),
    )
    assert math.isfinite(m["mismatch/chi2_sequence"]) and math.isfinite(m["is/sequence_weight_max"])


def test_missing_boundaries_is_a_clear_error():
    with pytest.raises(ValueError, match="sequence boundaries"):
        mismatch_metrics(PROX, BEHAV, MASK)
    with pytest.raises(ValueError, match="loss_mask has shape"):
        mismatch_metrics(PROX, BEHAV, MASK[:2], cu_seqlens=CU)
