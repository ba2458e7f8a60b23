"""GSPO and CISPO, the policy objectives beside decoupled PPO, and what all three share.

Every objective here takes one :class:`sluice.engines.rl.loss_inputs.LossInputs` and the
``trainer.loss`` config as keywords, as :func:`sluice.engines.rl.loss.decoupled_ppo_loss`
does, and returns ``(loss, metrics)`` the same way, so ``trainer.loss.name`` swaps them without
the trainer knowing (they are registered in :data:`sluice.engines.rl.loss.POLICY_LOSSES`).
The three policies are those of loss.py: π_behav sampled the tokens, π_prox is the
trust-region anchor recomputed before the update, π_θ is optimised. With
``decoupled=False`` the anchor is π_behav and the behaviour weight is 1.

- **GSPO** (Zheng et al. 2025, arXiv 2507.18071), its GSPO-token form (§4.3): one
  importance ratio per *sequence*, the geometric mean of the token ratios, clipped as a
  whole, so a response is kept or dropped together instead of token by token.
- **CISPO** (MiniMax-M1, arXiv 2506.13585, eq. 4): REINFORCE with a clipped,
  stop-gradient importance weight. Clipping bounds the weight but never removes a
  token's gradient, which PPO's clip does to exactly the rare tokens (``Wait``,
  ``However``) whose ratio moves most.

Shared here, and used by loss.py too (loss.py imports this module, never the reverse,
so the registry can hold all three without an import cycle): the per-token log-ratio and behaviour weight (:func:`policy_terms`), and the ratio metrics.
How token losses become one scalar (``token_scale``) lives in
:mod:`sluice.engines.rl.aggregation`; the shape checks, in ``LossInputs`` (made once, so
every objective gets them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sluice.engines.rl.aggregation import aggregate_token_losses
from sluice.engines.rl.loss_inputs import LossInputs

Tensor = torch.Tensor


class PolicyTerms(NamedTuple):
    """The per-token quantities every objective starts from (see :func:`policy_terms`)."""

    dtype: torch.dtype
    mask: Tensor
    """``loss_mask`` in the loss's dtype."""
    valid: Tensor
    """Bool: the token enters the loss."""
    num_valid: Tensor
    """Valid tokens in this call (int tensor, no host sync)."""
    log_ratio: Tensor
    """log π_θ − log π_anchor at valid tokens, 0 elsewhere; carries the gradient."""
    weights: Tensor
    """Behaviour weight w_t (π_prox/π_behav, or the caller's), 1 when not decoupled."""
    advantages: Tensor
    """Detached advantages, 0 at masked tokens."""


def masked_mean(values: Tensor, valid: Tensor, num_valid: Tensor) -> Tensor:
    """Mean of ``values`` over valid tokens (0 when there are none)."""
    return torch.where(valid, values, 0.0).sum() / num_valid.clamp(min=1)


def masked_extreme(values: Tensor, valid: Tensor, largest: bool) -> Tensor:
    """Max (or min) of ``values`` over valid tokens (0 when there are none)."""
    fill = float("-inf") if largest else float("inf")
    filled = torch.where(valid, values, fill)
    extreme = filled.max() if largest else filled.min()
    # No valid token: report 0 rather than ±inf, which would poison averaged logs.
    return torch.where(valid.any(), extreme, torch.zeros_like(extreme))


def policy_terms(inputs: LossInputs, *, decoupled: bool) -> PolicyTerms:
    """Check the inputs against ``decoupled`` and compute the per-token log-ratio and weights.

    The anchor is π_prox when ``decoupled`` (weight exp(prox − behav) or
    ``behaviour_weights``), π_behav otherwise (weight 1). Masked positions (prompts,
    padding) may hold arbitrary log-probs; their log-ratios are zeroed so exp() stays
    finite and 0 * inf can never turn a loss into NaN.

    Raises:
        ValueError: ``decoupled`` without ``proximal_logprobs``, or ``behaviour_weights``
            without ``decoupled`` (shapes and ``num_global_tokens`` were checked when
            ``inputs`` was made).
    """
    if decoupled and inputs.proximal_logprobs is None:
        raise ValueError(
            "proximal_logprobs is None but decoupled=True needs π_prox; "
            "pass the recomputed log-probs or set decoupled=False"
        )
    if not decoupled and inputs.behaviour_weights is not None:
        raise ValueError(
            "behaviour_weights were given with decoupled=False: standard PPO anchors the "
            "ratio at π_behav, so its behaviour weight is 1 by construction"
        )
    logprobs, proximal_logprobs = inputs.logprobs, inputs.proximal_logprobs
    behaviour_weights = inputs.behaviour_weights
    dtype = logprobs.dtype
    mask = inputs.loss_mask.to(dtype)
    valid = mask > 0
    num_valid = valid.sum()
    behaviour = inputs.behaviour_logprobs.detach().to(dtype)
    if decoupled:
        assert proximal_logprobs is not None
        anchor = proximal_logprobs.detach().to(dtype)
        log_ratio = torch.where(valid, logprobs - anchor, 0.0)
        if behaviour_weights is None:
            weights = torch.exp(torch.where(valid, anchor - behaviour, 0.0))
        else:
            weights = behaviour_weights.detach().to(dtype)
    else:
        log_ratio = torch.where(valid, logprobs - behaviour, 0.0)
        weights = torch.ones_like(logprobs)
    advantages = torch.where(valid, inputs.advantages.detach().to(dtype), 0.0)
    return PolicyTerms(dtype, mask, valid, num_valid, log_ratio, weights, advantages)


def ratio_metrics(ratio: Tensor, token_log_ratio: Tensor, terms: PolicyTerms) -> dict[str, Tensor]:
    """The metrics every objective reports about its ratio and behaviour weight (detached).

    ``ratio`` is the ratio the objective clips (per token; GSPO's is the sequence ratio);
    ``approx_kl`` is the k3 estimator of KL(π_anchor ‖ π_θ) from the *token* log-ratio
    (r − 1 − log r >= 0), comparable across objectives.
    """
    valid, num_valid = terms.valid, terms.num_valid
    ratio = ratio.detach()
    token_log_ratio = token_log_ratio.detach()
    approx_kl = torch.exp(token_log_ratio) - 1.0 - token_log_ratio
    return {
        "loss/approx_kl": masked_mean(approx_kl, valid, num_valid),
        "loss/ratio_mean": masked_mean(ratio, valid, num_valid),
        "loss/ratio_max": masked_extreme(ratio, valid, largest=True),
        "loss/ratio_min": masked_extreme(ratio, valid, largest=False),
        "loss/behaviour_weight_mean": masked_mean(terms.weights, valid, num_valid),
        "loss/behaviour_weight_max": masked_extreme(terms.weights, valid, largest=True),
    }


WITHOUT_DUAL_CLIP = {
    "gspo": "GSPO clips the sequence ratio and defines no dual clip, so it would be ignored",
    "cispo": "CISPO's weight is already capped at 1 + eps_clip_high, there is no unbounded "
    "ratio to cap",
}
"""Objectives that refuse ``dual_clip_c``, and why (one line for the error)."""


def dual_clip_refusal(objective: str, dual_clip_c: float) -> str:
    """The one-line error for ``dual_clip_c`` given to an objective without a dual clip."""
    return (
        f"dual_clip_c={dual_clip_c} does not apply to policy loss '{objective}': "
        f"{WITHOUT_DUAL_CLIP[objective]}; set dual_clip_c to None"
    )


def gspo_loss(
    inputs: LossInputs,
    *,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    decoupled: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token loss (Zheng et al. 2025, §4.3) of one micro-batch.

    Per sequence i, over its valid tokens (``loss_mask``), the sequence ratio is the
    geometric mean of the token ratios against the anchor (π_prox when decoupled,
    π_behav otherwise)::

        s_i     = exp( mean_{t∈i} (logprobs_t - anchor_t) )
        s_{i,t} = sg[s_i] · exp(logprobs_t - sg[logprobs_t])     value s_i, grad s_i ∇log π_t
        L       = - Σ_t mask_t w_t min(s_{i,t} A_t, clip(s_{i,t}, 1 - eps_low, 1 + eps_high) A_t)

    aggregated as :func:`~sluice.engines.rl.loss.decoupled_ppo_loss` does: ``/
    num_global_tokens`` or ``Σ · token_scale``. Every token of a sequence carries the same
    ratio value, so one clip decision covers the whole response (per sign of A); each
    token keeps the gradient of its own log-prob, so per-token advantages still work,
    and with one advantage per response the gradient equals sequence-level GSPO's.
    ``w_t`` is the behaviour weight of decoupled PPO (exp(prox − behav) or
    ``behaviour_weights``), 1 with ``decoupled=False``.

    Where it departs from the paper, and what to configure to match it:

    - The paper's clip ranges are ~1000x narrower than PPO's, ``eps_clip_low`` ≈ 3e-4
      and ``eps_clip_high`` ≈ 4e-4 (§5.1): a sequence ratio is a mean of log-ratios and
      moves far less than a token's. The defaults here (0.2) are PPO's.
    - The paper averages per sequence, then over sequences (``seq-mean-token-mean``,
      pass that mode's ``token_scale``); without ``token_scale`` this is token-mean.
    - Tokens rejected by rollout correction (``loss_mask`` False) are left out of s_i.

    Args: those of ``decoupled_ppo_loss``, and
        inputs.sequence_ids: int index of each token's sequence (whole sequences only).
            Required.
        dual_clip_c: must be None (GSPO has no dual clip).

    Returns:
        ``(loss, metrics)`` as ``decoupled_ppo_loss``, without ``loss/dual_clip_fraction``;
        ``loss/ratio_*`` describe s_i (per token), ``loss/approx_kl`` the token ratios.

    Raises:
        ValueError: no ``sequence_ids``, a ``dual_clip_c``, or what ``decoupled_ppo_loss``
            refuses.
    """
    if dual_clip_c is not None:
        raise ValueError(dual_clip_refusal("gspo", dual_clip_c))
    logprobs, sequence_ids = inputs.logprobs, inputs.sequence_ids
    if sequence_ids is None:
        raise ValueError("gspo needs sequence_ids: its ratio is a mean over each sequence's tokens")
    if sequence_ids.dtype.is_floating_point or sequence_ids.dtype == torch.bool:
        raise ValueError(f"sequence_ids must be an integer tensor, got {sequence_ids.dtype}")
    terms = policy_terms(inputs, decoupled=decoupled)
    valid, dtype, advantages = terms.valid, terms.dtype, terms.advantages

    # s_i as a constant: sum and count the valid log-ratios of each sequence.
    ids = sequence_ids.reshape(-1).to(device=logprobs.device, dtype=torch.int64)
    num_sequences = 0
    if ids.numel():
        lowest, highest = torch.stack(ids.aminmax()).tolist()  # one host sync
        if lowest < 0:
            raise ValueError("sequence_ids must be non-negative")
        num_sequences = highest + 1
    # At least float32: a bfloat16 count stops being exact past 256 tokens.
    accumulate = torch.promote_types(dtype, torch.float32)
    per_sequence = torch.zeros(num_sequences, dtype=accumulate, device=logprobs.device)
    log_ratio = terms.log_ratio.detach().reshape(-1).to(accumulate)
    log_ratio_sum = per_sequence.index_add(0, ids, log_ratio)
    count = per_sequence.index_add(0, ids, valid.reshape(-1).to(accumulate))
    sequence_log_ratio = (log_ratio_sum / count.clamp(min=1))[ids].reshape(logprobs.shape)
    sequence_ratio = torch.exp(sequence_log_ratio).to(dtype)
    # exp(x - sg[x]) is exactly 1 in value and carries ∇x; masked positions get 0 so a
    # garbage log-prob there (inf) cannot produce inf - inf.
    own_grad = torch.exp(torch.where(valid, logprobs - logprobs.detach(), 0.0))
    ratio = sequence_ratio * own_grad

    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high)
    token_loss = torch.maximum(unclipped_loss, clipped_loss)
    clip_active = clipped_loss > unclipped_loss

    weighted = torch.where(valid, terms.mask * terms.weights * token_loss, 0.0)
    loss = aggregate_token_losses(weighted, inputs.num_global_tokens, inputs.token_scale)

    with torch.no_grad():
        num_valid = terms.num_valid
        low = (ratio < 1.0 - eps_clip_low) & (advantages < 0)
        high = (ratio > 1.0 + eps_clip_high) & (advantages > 0)
        metrics = {
            "loss/policy_loss": loss.detach(),
            "loss/valid_tokens": num_valid.to(dtype),
            "loss/clip_fraction": masked_mean(clip_active.to(dtype), valid, num_valid),
            "loss/clip_low_fraction": masked_mean(low.to(dtype), valid, num_valid),
            "loss/clip_high_fraction": masked_mean(high.to(dtype), valid, num_valid),
            **ratio_metrics(ratio, terms.log_ratio, terms),
        }
    return loss, metrics


def cispo_loss(
    inputs: LossInputs,
    *,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    decoupled: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO loss (MiniMax-M1, arXiv 2506.13585, eq. 4) of one micro-batch.

    With r_t = exp(logprobs_t − anchor_t) (anchor π_prox when decoupled, else π_behav)::

        L = - Σ_t mask_t w_t sg[clip(r_t, 1 - eps_low, 1 + eps_high)] A_t logprobs_t

    aggregated as :func:`~sluice.engines.rl.loss.decoupled_ppo_loss` does (the paper's
    eq. 4 is token-mean, ``/ num_global_tokens``). ``w_t`` is decoupled PPO's behaviour
    weight, 1 with ``decoupled=False``.

    The gradient is ``-Σ_t mask_t w_t sg[clip(r_t)] A_t ∇log π_θ(t)`` (aggregated): the
    clip bounds each token's *weight* but every token keeps a gradient, whereas PPO's
    clip zeroes the gradient of a token whose ratio left the trust region in the
    direction its advantage pushes. The loss *value* is a log-prob-weighted surrogate,
    not comparable with PPO's (it is not near -mean(A) at r = 1, and it moves with the
    log-probs themselves); read the gradient, not ``loss/policy_loss``, across objectives.

    The paper sets no lower bound in practice (eps_low large) and tunes eps_high only;
    ``eps_clip_low=1.0`` clips below at 0, i.e. not at all.

    Args: those of ``decoupled_ppo_loss``; ``inputs.sequence_ids`` is ignored and ``dual_clip_c``
        must be None (the loss of a token is linear in its log-prob, there is no
        unbounded ratio term to cap).

    Returns:
        ``(loss, metrics)`` as ``decoupled_ppo_loss``, without ``loss/dual_clip_fraction``.
        ``loss/clip_fraction`` is the fraction of valid tokens whose weight was truncated
        (``clip_low``: r < 1 − eps_low, ``clip_high``: r > 1 + eps_high, whatever the
        sign of A); unlike PPO's, those tokens still train.
    """
    if dual_clip_c is not None:
        raise ValueError(dual_clip_refusal("cispo", dual_clip_c))
    terms = policy_terms(inputs, decoupled=decoupled)
    valid, dtype = terms.valid, terms.dtype
    ratio = torch.exp(terms.log_ratio.detach())
    clipped_ratio = ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high)
    # Masked log-probs may be garbage (-inf for a padded position): keep them out.
    own_logprobs = torch.where(valid, inputs.logprobs, 0.0)
    token_loss = -clipped_ratio * terms.advantages * own_logprobs

    weighted = torch.where(valid, terms.mask * terms.weights * token_loss, 0.0)
    loss = aggregate_token_losses(weighted, inputs.num_global_tokens, inputs.token_scale)

    with torch.no_grad():
        num_valid = terms.num_valid
        low = ratio < 1.0 - eps_clip_low
        high = ratio > 1.0 + eps_clip_high
        metrics = {
            "loss/policy_loss": loss.detach(),
            "loss/valid_tokens": num_valid.to(dtype),
            "loss/clip_fraction": masked_mean((low | high).to(dtype), valid, num_valid),
            "loss/clip_low_fraction": masked_mean(low.to(dtype), valid, num_valid),
            "loss/clip_high_fraction": masked_mean(high.to(dtype), valid, num_valid),
            **ratio_metrics(ratio, terms.log_ratio, terms),
        }
    return loss, metrics
