"""KL penalty (Schulman 2020 estimators) and entropy bonus: values and gradients by hand."""

import math

import pytest
import torch

from sluice.engines.rl.regularizers import (
    KL_ESTIMATORS,
    entropy_bonus_loss,
    kl_estimate,
    kl_penalty_loss,
    kl_reward_penalty,
)

# log r = ref - logprobs = [-0.5, 1.0, 0.0]
LOGPROBS = [-1.0, -2.0, -0.5]
REF = [-1.5, -1.0, -0.5]


def _logprobs(values=LOGPROBS):
    return torch.tensor(values, requires_grad=True)


def test_k1_is_minus_log_ratio():
    # k1 = -log r = logprobs - ref = [0.5, -1.0, 0.0]
    out = kl_estimate(_logprobs(), torch.tensor(REF), "k1")
    torch.testing.assert_close(out, torch.tensor([0.5, -1.0, 0.0]))


def test_k2_is_half_squared_log_ratio():
    # k2 = (log r)^2 / 2 = [0.25 / 2, 1 / 2, 0] = [0.125, 0.5, 0.0]
    out = kl_estimate(_logprobs(), torch.tensor(REF), "k2")
    torch.testing.assert_close(out, torch.tensor([0.125, 0.5, 0.0]))


def test_k3_is_ratio_minus_one_minus_log_ratio():
    # k3 = (r - 1) - log r: exp(-0.5) - 1 + 0.5 = 0.10653066; e - 1 - 1 = 0.71828183; 0
    out = kl_estimate(_logprobs(), torch.tensor(REF), "k3")
    torch.testing.assert_close(out, torch.tensor([0.10653066, 0.71828183, 0.0]))


def test_k3_is_clamped_at_ten_like_verl_low_var_kl_with_zero_gradient():
    # log r = 5: e^5 - 1 - 5 = 142.41 -> 10. log r = 100 overflows exp in float32 unless the
    # log-ratio is clamped to 20 first; a clamped token has gradient 0, never NaN.
    # log r = 0.5 is untouched: e^0.5 - 1.5 = 0.14872127, gradient 1 - e^0.5 = -0.64872127
    logprobs = torch.tensor([-5.0, -100.0, -1.5], requires_grad=True)
    out = kl_estimate(logprobs, torch.tensor([0.0, 0.0, -1.0]), "k3")
    torch.testing.assert_close(out.detach(), torch.tensor([10.0, 10.0, 0.14872127]))
    out.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.0, 0.0, -0.64872127]))


def test_k3_is_never_negative_on_random_inputs():
    torch.manual_seed(0)
    logprobs = -5.0 * torch.rand(2000)
    ref = logprobs + 3.0 * torch.randn(2000)
    assert bool((kl_estimate(logprobs, ref, "k3") >= 0).all())


def test_reference_logprobs_get_no_gradient():
    ref = torch.tensor(REF, requires_grad=True)
    kl_estimate(_logprobs(), ref, "k3").sum().backward()
    assert ref.grad is None


# The fourth token is a prompt position holding -inf: it must not produce NaN or inf.
MASKED_LOGPROBS = [-1.0, -2.0, -0.5, -math.inf]
MASKED_REF = [-1.5, -1.0, -0.5, -3.0]
MASK = torch.tensor([True, True, True, False])


def test_kl_penalty_loss_k3_value_and_metrics():
    logprobs = _logprobs(MASKED_LOGPROBS)
    loss, metrics = kl_penalty_loss(
        logprobs, torch.tensor(MASKED_REF), MASK, 6, kind="k3", coef=0.1
    )
    # sum k3 over valid tokens = 0.10653066 + 0.71828183 + 0 = 0.82481249
    # L = 0.1 * 0.82481249 / 6 = 0.013746875; kl_ref = 0.82481249 / 3 = 0.27493750
    torch.testing.assert_close(loss, torch.tensor(0.013746875))
    torch.testing.assert_close(metrics["loss/kl_ref"], torch.tensor(0.2749375))
    torch.testing.assert_close(metrics["loss/kl_loss"], torch.tensor(0.013746875))
    for value in metrics.values():
        assert value.dim() == 0 and not value.requires_grad


def test_kl_penalty_loss_k1_gradient_is_coef_over_n_per_valid_token():
    logprobs = _logprobs(MASKED_LOGPROBS)
    loss, _ = kl_penalty_loss(logprobs, torch.tensor(MASKED_REF), MASK, 6, kind="k1", coef=0.1)
    loss.backward()
    # d/dlogprobs (logprobs - ref) = 1, times coef / N = 0.1 / 6; 0 on the masked token
    torch.testing.assert_close(logprobs.grad, torch.tensor([1 / 60, 1 / 60, 1 / 60, 0.0]))


def test_kl_penalty_loss_k2_gradient_is_the_log_ratio():
    logprobs = _logprobs(MASKED_LOGPROBS)
    loss, _ = kl_penalty_loss(logprobs, torch.tensor(MASKED_REF), MASK, 6, kind="k2", coef=0.1)
    loss.backward()
    # d/dlogprobs (ref - logprobs)^2 / 2 = logprobs - ref = [0.5, -1.0, 0.0], times 0.1 / 6
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.5, -1.0, 0.0, 0.0]) / 60)


def test_kl_penalty_loss_k3_gradient_is_one_minus_ratio():
    logprobs = _logprobs(MASKED_LOGPROBS)
    loss, _ = kl_penalty_loss(logprobs, torch.tensor(MASKED_REF), MASK, 6, kind="k3", coef=0.1)
    loss.backward()
    # d/dlogprobs (r - 1 - log r) = 1 - exp(ref - logprobs):
    # [1 - exp(-0.5), 1 - e, 0] / 60 = [0.39346934, -1.71828183, 0] / 60
    expected = torch.tensor([0.39346934, -1.71828183, 0.0, 0.0]) / 60
    torch.testing.assert_close(logprobs.grad, expected)


def test_kl_penalty_loss_token_scale_replaces_the_global_denominator():
    logprobs = _logprobs(MASKED_LOGPROBS)
    scale = torch.tensor([0.5, 0.25, 0.25, math.inf])  # inf on the masked token is ignored
    loss, _ = kl_penalty_loss(
        logprobs, torch.tensor(MASKED_REF), MASK, 1000, kind="k2", coef=2.0, token_scale=scale
    )
    # k2 = [0.125, 0.5, 0.0]: 2 * (0.125 * 0.5 + 0.5 * 0.25 + 0) = 2 * 0.1875 = 0.375
    torch.testing.assert_close(loss, torch.tensor(0.375))
    loss.backward()
    # 2 * scale * (logprobs - ref) = 2 * [0.5 * 0.5, 0.25 * -1.0, 0] = [0.5, -0.5, 0]
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.5, -0.5, 0.0, 0.0]))


def _random_batch(n=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logprobs = -3.0 * torch.rand(n, generator=gen)
    ref = logprobs + 0.5 * torch.randn(n, generator=gen)
    mask = torch.rand(n, generator=gen) > 0.3
    entropy = 2.0 * torch.rand(n, generator=gen)
    return logprobs, ref, mask, entropy


@pytest.mark.parametrize("kind", list(KL_ESTIMATORS))
def test_kl_penalty_micro_batches_sum_to_the_full_batch(kind):
    logprobs, ref, mask, _ = _random_batch()
    n = int(mask.sum())
    full_lp = logprobs.clone().requires_grad_()
    full, _ = kl_penalty_loss(full_lp, ref, mask, n, kind=kind, coef=0.3)
    full.backward()
    parts_lp = logprobs.clone().requires_grad_()
    total = sum(
        kl_penalty_loss(parts_lp[s], ref[s], mask[s], n, kind=kind, coef=0.3)[0]
        for s in (slice(0, 4), slice(4, 10))
    )
    total.backward()
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(parts_lp.grad, full_lp.grad)


def test_entropy_bonus_micro_batches_sum_to_the_full_batch():
    _, _, mask, entropy = _random_batch()
    n = int(mask.sum())
    full_h = entropy.clone().requires_grad_()
    full, _ = entropy_bonus_loss(full_h, mask, n, coef=0.01)
    full.backward()
    parts_h = entropy.clone().requires_grad_()
    total = sum(
        entropy_bonus_loss(parts_h[s], mask[s], n, coef=0.01)[0]
        for s in (slice(0, 3), slice(3, 7), slice(7, 10))
    )
    total.backward()
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(parts_h.grad, full_h.grad)


def test_entropy_bonus_is_minus_coef_times_mean_entropy():
    entropy = torch.tensor([0.5, 1.0, 2.0, math.nan], requires_grad=True)  # NaN on padding
    loss, metrics = entropy_bonus_loss(entropy, MASK, 4, coef=0.01)
    # -0.01 * (0.5 + 1.0 + 2.0) / 4 = -0.00875
    torch.testing.assert_close(loss, torch.tensor(-0.00875))
    torch.testing.assert_close(metrics["loss/entropy_bonus"], torch.tensor(-0.00875))
    assert not metrics["loss/entropy_bonus"].requires_grad
    loss.backward()
    # d/dH = -coef / N = -0.0025 per valid token; 0 (not NaN) on the padding
    torch.testing.assert_close(entropy.grad, torch.tensor([-0.0025, -0.0025, -0.0025, 0.0]))


def test_entropy_bonus_token_scale():
    entropy = torch.tensor([0.5, 1.0, 2.0, 9.0], requires_grad=True)
    loss, _ = entropy_bonus_loss(
        entropy, MASK, 1, coef=0.1, token_scale=torch.tensor([0.5, 0.5, 0.25, 0.25])
    )
    # -0.1 * (0.5 * 0.5 + 1.0 * 0.5 + 2.0 * 0.25) = -0.1 * 1.25 = -0.125
    torch.testing.assert_close(loss, torch.tensor(-0.125))


def test_kl_reward_penalty_sums_token_penalties_per_response():
    # responses: tokens {0, 1}, {2, 3 (prompt)}, {4}, and an empty fourth response
    logprobs = torch.tensor([-1.0, -2.0, -0.5, -1.0, -3.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5, 7.0, -1.0])
    mask = torch.tensor([True, True, True, False, True])
    ids = torch.tensor([0, 0, 1, 1, 2])
    out = kl_reward_penalty(logprobs, ref, mask, ids, 4, kind="k2", coef=0.5)
    # k2 = (ref - logprobs)^2 / 2 = [0.125, 0.5, 0, (masked), 2.0]
    # per response [0.625, 0, 2.0, 0], times 0.5 -> [0.3125, 0, 1.0, 0]
    torch.testing.assert_close(out, torch.tensor([0.3125, 0.0, 1.0, 0.0], dtype=torch.float64))
    assert out.dtype == torch.float64 and not out.requires_grad


def test_kl_reward_penalty_k1_can_be_a_bonus():
    # k1 = logprobs - ref = [0.5, -1.0] summed = -0.5, times coef 2 -> -1.0
    out = kl_reward_penalty(
        torch.tensor([-1.0, -2.0]),
        torch.tensor([-1.5, -1.0]),
        torch.tensor([True, True]),
        torch.tensor([0, 0]),
        1,
        kind="k1",
        coef=2.0,
    )
    torch.testing.assert_close(out, torch.tensor([-1.0], dtype=torch.float64))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda lp, ref, m: kl_estimate(lp, ref, "k4"), "unknown KL estimator 'k4'"),
        (lambda lp, ref, m: kl_estimate(lp, ref[:2], "k1"), "ref_logprobs has shape"),
        (
            lambda lp, ref, m: kl_penalty_loss(lp, ref, m, 0, kind="k3", coef=0.1),
            "num_global_tokens must be positive",
        ),
        (
            lambda lp, ref, m: kl_penalty_loss(lp, ref, m, 3, kind="k3", coef=-0.1),
            "must be non-negative",
        ),
        (
            lambda lp, ref, m: kl_penalty_loss(lp, ref, m[:2], 3, kind="k3", coef=0.1),
            "loss_mask has shape",
        ),
        (
            lambda lp, ref, m: kl_reward_penalty(
                lp, ref, m, torch.tensor([0, 1, 2]), 2, kind="k1", coef=0.1
            ),
            r"sequence_ids must lie in \[0, 2\)",
        ),
        (
            lambda lp, ref, m: entropy_bonus_loss(lp, m, -1, coef=0.1),
            "num_global_tokens must be positive",
        ),
    ],
)
def test_bad_inputs_raise_one_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.tensor(LOGPROBS), torch.tensor(REF), torch.tensor([True, True, False]))
