"""Regularizers added to the policy loss: a KL penalty to a reference policy and an entropy bonus.

Both are pure functions over named per-token tensors, in the layout of
:mod:`sluice.engines.rl.loss` (flat 1-D over the tokens of a packed micro-batch), and
both are normalised by ``num_global_tokens`` like the policy loss, so summing the
micro-batch terms gives exactly the full-batch term and gradient.

**KL to the reference policy.** The tokens were sampled from the policy being trained,
so KL(π_θ ‖ π_ref) is estimated per token from samples of π_θ with Schulman's
estimators ("Approximating KL Divergence", 2020). With the log-ratio
log r = log π_ref − log π_θ = ``ref_logprobs`` − ``logprobs``:

======  ======================  ==========================================================
kind    per-token estimate      notes
======  ======================  ==========================================================
``k1``  −log r                  unbiased, high variance, negative on many tokens
``k2``  ½ (log r)²              biased (low for small KL), never negative
``k3``  (r − 1) − log r         unbiased and never negative; verl's ``low_var_kl``
======  ======================  ==========================================================

Departures, on purpose:

- ``k3`` follows verl's ``low_var_kl``: the log-ratio is clamped to [−20, 20] before
  the exponential and the estimate to [−10, 10]. The lower clamp never binds (k3 ≥ 0);
  the upper one binds once log r ≳ 2.53 (π_ref more than ~12x as likely as π_θ on the
  token) and gives such tokens zero gradient, so one collapsed token cannot dominate the
  penalty. The log-ratio clamp keeps exp() finite, so a clamped token's gradient is 0,
  not 0 · inf = NaN.
- ``ref_logprobs`` is a constant (detached): only π_θ is regularised.

Two ways to use the penalty, as verl does: in the loss (``use_kl_loss``,
:func:`kl_penalty_loss`) or subtracted from each response's reward before advantages
are computed (``use_kl_in_reward``, :func:`kl_reward_penalty`).

**Entropy bonus.** :func:`entropy_bonus_loss` adds −coef · mean token entropy (verl's
``entropy_coeff``), which pushes the policy towards higher entropy for a positive coef.

Metrics are detached 0-d tensors (no host sync), named ``loss/*`` like the policy loss's.
``loss/kl_loss`` and ``loss/entropy_bonus`` are already divided by the global token
count: across micro-batches they add up, while ``loss/kl_ref`` is a mean over this
call's valid tokens (token-weighted when merged).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sluice.engines.rl.loss_inputs import check_num_global_tokens, check_same_shape
from sluice.engines.rl.rollout_correction import Segments

Tensor = torch.Tensor

_K3_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0


def _k1(log_ratio: Tensor) -> Tensor:
    return -log_ratio


def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio * log_ratio


def _k3(log_ratio: Tensor) -> Tensor:
    log_ratio = log_ratio.clamp(-_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
    return (torch.exp(log_ratio) - 1.0 - log_ratio).clamp(-_K3_CLAMP, _K3_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
}
"""Per-token KL(π_θ ‖ π_ref) estimators (Schulman 2020) as functions of
log r = ref_logprobs − logprobs, by the names the config accepts."""


def _check_kind(kind: str) -> Callable[[Tensor], Tensor]:
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator '{kind}'; known: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind]


def _aggregate(
    token_values: Tensor,
    valid: Tensor,
    num_global_tokens: int | float | Tensor,
    token_scale: Tensor | None,
) -> Tensor:
    """Σ_valid values / num_global_tokens, or Σ_valid values · token_scale."""
    if token_scale is None:
        return torch.where(valid, token_values, 0.0).sum() / num_global_tokens
    # Zeroed on masked tokens first: a non-finite scale there must not reach the sum,
    # nor (as 0 * inf) the gradient.
    scale = torch.where(
        valid, token_scale.detach().to(token_values.device, token_values.dtype), 0.0
    )
    return (torch.where(valid, token_values, 0.0) * scale).sum()


def _masked_mean(values: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, values, 0.0).sum() / valid.sum().clamp(min=1)


def _masked_log_ratio(logprobs: Tensor, ref_logprobs: Tensor, valid: Tensor) -> Tensor:
    # Prompt and padding positions may hold arbitrary log-probs (even ±inf); a zero
    # log-ratio there keeps every estimator, and its gradient, finite.
    return torch.where(valid, ref_logprobs.detach().to(logprobs.dtype) - logprobs, 0.0)


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from tokens sampled from π_θ (Schulman 2020).

    Args:
        logprobs: log π_θ of each token (may carry grad).
        ref_logprobs: log π_ref of each token; treated as a constant.
        kind: ``k1`` (logprobs − ref), ``k2`` (½ (ref − logprobs)²) or ``k3``
            (exp(ref − logprobs) − 1 − (ref − logprobs), clamped as verl's
            ``low_var_kl``: see the module docstring).

    Returns:
        The estimate per token, same shape and dtype as ``logprobs``, differentiable in
        ``logprobs``. No masking: see :func:`kl_penalty_loss` for masked positions.
    """
    estimator = _check_kind(kind)
    check_same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs)
    return estimator(ref_logprobs.detach().to(logprobs.dtype) - logprobs)


def kl_penalty_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    loss_mask: Tensor,
    num_global_tokens: int | float | Tensor,
    *,
    kind: str,
    coef: float,
    token_scale: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL penalty to the reference policy, to add to the policy loss (verl ``use_kl_loss``).

    L_KL = coef · Σ_t mask_t · k_t / num_global_tokens, with k_t the estimate of
    :func:`kl_estimate` (Schulman 2020).

    Args:
        logprobs: log π_θ per token (carries grad).
        ref_logprobs: log π_ref per token (no grad).
        loss_mask: 1/True for the tokens that enter the loss.
        num_global_tokens: valid tokens in the whole global batch, the policy loss's
            denominator. Must be positive. Ignored when ``token_scale`` is given.
        kind: the estimator, a key of :data:`KL_ESTIMATORS`.
        coef: the KL coefficient β (verl ``kl_loss_coef``); must be non-negative.
        token_scale: per-token aggregation factor computed elsewhere (for example
            1 / (num_sequences · response_length) for a sequence-mean loss); replaces
            1 / num_global_tokens, giving coef · Σ_t mask_t · k_t · token_scale_t.

    Returns:
        ``(loss, metrics)``: the scalar penalty, and detached 0-d tensors
        ``loss/kl_ref`` (mean estimate over this call's valid tokens) and
        ``loss/kl_loss`` (the penalty itself).
    """
    estimator = _check_kind(kind)
    if coef < 0:
        raise ValueError(f"the KL coefficient must be non-negative, got {coef}")
    check_same_shape(
        "logprobs",
        logprobs,
        ref_logprobs=ref_logprobs,
        loss_mask=loss_mask,
        token_scale=token_scale,
    )
    if token_scale is None:
        check_num_global_tokens(num_global_tokens)

    valid = loss_mask.to(torch.bool)
    kl = estimator(_masked_log_ratio(logprobs, ref_logprobs, valid))
    loss = coef * _aggregate(kl, valid, num_global_tokens, token_scale)
    with torch.no_grad():
        metrics = {
            "loss/kl_ref": _masked_mean(kl.detach(), valid),
            "loss/kl_loss": loss.detach(),
        }
    return loss, metrics


def kl_reward_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    loss_mask: Tensor,
    sequence_ids: Tensor,
    num_sequences: int,
    *,
    kind: str,
    coef: float,
) -> Tensor:
    """The KL penalty to subtract from each response's reward (verl ``use_kl_in_reward``).

    penalty_i = coef · Σ_{t ∈ response i, mask_t} k_t, the token-level penalties of
    :func:`kl_estimate` summed per response, as an outcome-reward estimator (GRPO,
    RLOO, ...) needs one scalar per response: r_i ← r_i − penalty_i.

    Args:
        logprobs: log π_θ per token (the policy that sampled, or the trainer's recompute).
        ref_logprobs: log π_ref per token.
        loss_mask: 1/True for response tokens (prompt tokens do not count).
        sequence_ids: per-token index of the response it belongs to, in
            ``[0, num_sequences)``.
        num_sequences: number of responses (some may have no valid tokens: penalty 0).
        kind: the estimator, a key of :data:`KL_ESTIMATORS`.
        coef: the KL coefficient β (verl ``algorithm.kl_ctrl.kl_coef``); non-negative.

    Returns:
        float64 ``[num_sequences]``, without grad (rewards are constants), on the
        device of ``logprobs``.
    """
    estimator = _check_kind(kind)
    if coef < 0:
        raise ValueError(f"the KL coefficient must be non-negative, got {coef}")
    check_same_shape(
        "logprobs",
        logprobs,
        ref_logprobs=ref_logprobs,
        loss_mask=loss_mask,
        sequence_ids=sequence_ids,
    )
    if num_sequences < 0:
        raise ValueError(f"num_sequences must be non-negative, got {num_sequences}")
    with torch.no_grad():
        ids = sequence_ids.to(device=logprobs.device, dtype=torch.int64)
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < num_sequences:
            raise ValueError(f"sequence_ids must lie in [0, {num_sequences})")
        valid = loss_mask.to(device=logprobs.device, dtype=torch.bool)
        lp = logprobs.detach().to(torch.float64)
        kl = estimator(_masked_log_ratio(lp, ref_logprobs, valid))
        per_sequence = Segments(ids, num_sequences).sum(torch.where(valid, kl, 0.0))
    return coef * per_sequence


def entropy_bonus_loss(
    entropy: Tensor,
    loss_mask: Tensor,
    num_global_tokens: int | float | Tensor,
    *,
    coef: float,
    token_scale: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Entropy bonus, to add to the policy loss (verl ``entropy_coeff``).

    L_H = −coef · Σ_t mask_t · H_t / num_global_tokens: minimising it raises the mean
    token entropy for coef > 0 (a negative coef penalises entropy instead).

    Args:
        entropy: per-token entropy of π_θ WITH grad (H_t = −Σ_v p_v log p_v over the
            vocabulary at position t).
        loss_mask: 1/True for the tokens that enter the loss.
        num_global_tokens: valid tokens in the whole global batch; must be positive.
            Ignored when ``token_scale`` is given.
        coef: the entropy coefficient.
        token_scale: per-token aggregation factor computed elsewhere, replacing
            1 / num_global_tokens (see :func:`kl_penalty_loss`).

    Returns:
        ``(loss, metrics)`` with ``loss/entropy_bonus`` the detached loss.
    """
    check_same_shape("entropy", entropy, loss_mask=loss_mask, token_scale=token_scale)
    if token_scale is None:
        check_num_global_tokens(num_global_tokens)
    valid = loss_mask.to(torch.bool)
    # where() first: a NaN entropy on a padding row must not reach the sum or its grad.
    masked_entropy = torch.where(valid, entropy, 0.0)
    loss = -coef * _aggregate(masked_entropy, valid, num_global_tokens, token_scale)
    return loss, {"loss/entropy_bonus": loss.detach()}
