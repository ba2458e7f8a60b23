"""The policy losses of Sluice: decoupled PPO (AReaL eq. 3) as a pure function over named tensors.

Three policies meet here (docs/design.md §1): π_behav produced the tokens and recorded
``behaviour_logprobs``; π_prox is the trainer's weights just before this update,
recomputed over the batch as ``proximal_logprobs``; π_θ is being optimised and gives
``logprobs`` (with grad). Per valid response token t::

    u_t = exp(logprobs_t - proximal_logprobs_t)            trust-region ratio
    w_t = exp(proximal_logprobs_t - behaviour_logprobs_t)  behaviour weight, no grad
    L   = - sum_t mask_t * w_t * min(u_t A_t, clip(u_t, 1 - eps_low, 1 + eps_high) A_t)
          / num_global_tokens

Tensor convention: every per-token input is a flat 1-D tensor over the tokens of a
padding-free packed micro-batch (the layout :func:`sluice.engines.rl.batching.pack_sequences`
produces), all of one shape. The loss is elementwise followed by one sum, so a
``[B, T]`` layout works identically; only the rollout correction needs sequence
boundaries, and it takes them explicitly.

Departures from the paper, on purpose:

- The denominator is ``num_global_tokens``, the number of valid tokens in the whole
  global batch (counted before rollout correction), not per micro-batch: summing the
  micro-batch losses then gives exactly the full-batch loss and gradient.
- ``behaviour_weights`` may replace ``w_t`` (truncated or masked by
  :mod:`sluice.engines.rl.rollout_correction`); masked tokens leave the numerator only.
- Optional dual clip (Ye et al. 2020) caps the loss of negative-advantage tokens at
  ``dual_clip_c * |A|`` so a huge ratio on a bad token cannot dominate the batch.
- ``token_scale`` (from :func:`sluice.engines.rl.aggregation.aggregation_scale`) swaps
  the token mean for a per-sequence mean, ``L = Σ_t mask_t w_t l_t scale_t``; without it
  the loss is the token mean above, to the bit.

Configs pick functions, never branches: :func:`make_policy_loss` binds the
``trainer.loss`` section to a loss from :data:`POLICY_LOSSES`: decoupled PPO here, GSPO
and CISPO in :mod:`sluice.engines.rl.objectives` (which also holds the input checks and
metrics all three share). Two protocols type them,
so the type checker holds every loss to the signature the trainer calls:
:class:`ConfigurablePolicyLoss` (a registered loss, the config's knobs as keywords) and
:class:`PolicyLoss` (one bound to its config, as the trainer holds it).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Protocol

import torch

from sluice.engines.rl.aggregation import aggregate_token_losses
from sluice.engines.rl.objectives import (
    WITHOUT_DUAL_CLIP,
    cispo_loss,
    dual_clip_refusal,
    gspo_loss,
    masked_mean,
    policy_terms,
    ratio_metrics,
)

Tensor = torch.Tensor


class PolicyLoss(Protocol):
    """A policy loss bound to its config, as the trainer calls it once per micro-batch.

    The per-token inputs share one layout (see the module); ``num_global_tokens`` is the
    minibatch's valid-token count, the denominator of every micro-batch's loss;
    ``behaviour_weights`` replaces exp(proximal - behaviour) when rollout correction
    computed them. ``token_scale`` is the per-token aggregation factor of a
    sequence-level mode (None: token mean over ``num_global_tokens``); ``sequence_ids``
    the sequence index of each token within the micro-batch (needed by GSPO, ignored by
    the others). Returns the scalar loss and detached scalar metrics named ``loss/*``
    (tensors: reading them would sync the device; :func:`merge_micro_batch_metrics`
    turns them into floats once per minibatch).
    """

    def __call__(
        self,
        logprobs: Tensor,
        proximal_logprobs: Tensor | None,
        behaviour_logprobs: Tensor,
        advantages: Tensor,
        loss_mask: Tensor,
        num_global_tokens: int | float | Tensor,
        *,
        behaviour_weights: Tensor | None = None,
        token_scale: Tensor | None = None,
        sequence_ids: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


class ConfigurablePolicyLoss(Protocol):
    """A loss in :data:`POLICY_LOSSES`: :class:`PolicyLoss`'s arguments, plus the fields of
    the ``trainer.loss`` config as keywords (what :func:`make_policy_loss` binds)."""

    def __call__(
        self,
        logprobs: Tensor,
        proximal_logprobs: Tensor | None,
        behaviour_logprobs: Tensor,
        advantages: Tensor,
        loss_mask: Tensor,
        num_global_tokens: int | float | Tensor,
        *,
        eps_clip_low: float = ...,
        eps_clip_high: float = ...,
        dual_clip_c: float | None = ...,
        decoupled: bool = ...,
        behaviour_weights: Tensor | None = None,
        token_scale: Tensor | None = None,
        sequence_ids: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


def decoupled_ppo_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor | None,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    num_global_tokens: int | float | Tensor,
    *,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    decoupled: bool = True,
    behaviour_weights: Tensor | None = None,
    token_scale: Tensor | None = None,
    sequence_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO loss (AReaL eq. 3) of one micro-batch, normalised by the global token count.

    Args:
        logprobs: log π_θ of each token under the weights being optimised (carries grad).
        proximal_logprobs: log π_prox of each token, recomputed by the trainer before this
            update (no grad). May be None only when ``decoupled=False``.
        behaviour_logprobs: log π_behav recorded by the inference engine when sampling.
        advantages: advantage of each token (the sample's advantage broadcast over its
            response tokens).
        loss_mask: 1/True for response tokens that enter the loss, 0/False for prompt
            tokens, padding and tokens rejected by rollout correction.
        num_global_tokens: valid tokens in the whole global batch (all micro-batches),
            counted from the mask *before* rollout correction. Must be positive.
        eps_clip_low: the ratio is clipped below at ``1 - eps_clip_low`` (in [0, 1]).
        eps_clip_high: the ratio is clipped above at ``1 + eps_clip_high`` (>= 0;
            clip-higher when larger than ``eps_clip_low``).
        dual_clip_c: for negative advantages the per-token loss is capped at
            ``dual_clip_c * |A|``; None disables it. Must exceed 1.

        The bounds are checked once, where the user sets them: the ``trainer.loss``
        config (``sluice.infra.trainer_config.LossConfig``), not on every micro-batch.
        decoupled: True uses π_prox as the trust-region anchor with behaviour weight
            π_prox/π_behav; False is standard PPO with π_old = π_behav (u = π_θ/π_behav,
            w = 1), for which no proximal forward pass is needed.
        behaviour_weights: precomputed w per token (from rollout correction), used instead
            of exp(proximal - behaviour). Treated as constants. Only with ``decoupled=True``.
        token_scale: per-token aggregation factor
            (:func:`sluice.engines.rl.aggregation.aggregation_scale`); the loss becomes
            ``Σ_t mask_t w_t l_t token_scale_t`` instead of ``Σ_t mask_t w_t l_t /
            num_global_tokens``. None keeps the token mean. Treated as a constant.
        sequence_ids: sequence index of each token; ignored here (the signature is shared
            with GSPO, which needs it).

    Returns:
        ``(loss, metrics)``: a scalar loss to call ``backward()`` on, and detached scalar
        tensors (no host sync) named ``loss/*``. Means in ``metrics`` are over this call's
        valid tokens; combine micro-batches with :func:`merge_micro_batch_metrics`.

    Raises:
        ValueError: on mismatched shapes, a non-positive ``num_global_tokens``, or an
            inconsistent combination of options (not on out-of-range bounds: see above).
    """
    terms = policy_terms(
        logprobs,
        proximal_logprobs,
        behaviour_logprobs,
        advantages,
        loss_mask,
        num_global_tokens,
        decoupled=decoupled,
        behaviour_weights=behaviour_weights,
        token_scale=token_scale,
        sequence_ids=sequence_ids,
    )
    dtype, mask, valid, num_valid = terms.dtype, terms.mask, terms.valid, terms.num_valid
    log_ratio, weights, advantages = terms.log_ratio, terms.weights, terms.advantages
    ratio = torch.exp(log_ratio)

    unclipped_loss = -advantages * ratio
    clipped_ratio = ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high)
    clipped_loss = -advantages * clipped_ratio
    token_loss = torch.maximum(unclipped_loss, clipped_loss)
    clip_active = clipped_loss > unclipped_loss
    if dual_clip_c is not None:
        dual_cap = -dual_clip_c * advantages
        dual_active = (advantages < 0) & (token_loss > dual_cap)
        token_loss = torch.where(dual_active, dual_cap, token_loss)
    else:
        dual_active = torch.zeros_like(valid)

    weighted = torch.where(valid, mask * weights * token_loss, 0.0)
    loss = aggregate_token_losses(weighted, num_global_tokens, token_scale)

    with torch.no_grad():
        low = (ratio < 1.0 - eps_clip_low) & (advantages < 0)
        high = (ratio > 1.0 + eps_clip_high) & (advantages > 0)
        metrics = {
            "loss/policy_loss": loss.detach(),
            "loss/valid_tokens": num_valid.to(dtype),
            "loss/clip_fraction": masked_mean(clip_active.to(dtype), valid, num_valid),
            "loss/clip_low_fraction": masked_mean(low.to(dtype), valid, num_valid),
            "loss/clip_high_fraction": masked_mean(high.to(dtype), valid, num_valid),
            "loss/dual_clip_fraction": masked_mean(dual_active.to(dtype), valid, num_valid),
            **ratio_metrics(ratio, log_ratio, terms),
        }
    return loss, metrics


POLICY_LOSSES: dict[str, ConfigurablePolicyLoss] = {
    "decoupled_ppo": decoupled_ppo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}
"""Policy losses by config name; every entry takes the arguments of :func:`decoupled_ppo_loss`."""


def make_policy_loss(
    name: str = "decoupled_ppo",
    *,
    decoupled: bool = True,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    dual_clip_c: float | None = None,
) -> PolicyLoss:
    """Bind a loss config (fields of ``trainer.loss``) to a loss function.

    ``make_policy_loss(loss.objective, decoupled=loss.decoupled, eps_clip_low=...,
    eps_clip_high=..., dual_clip_c=...)`` gives a callable ``fn(logprobs,
    proximal_logprobs, behaviour_logprobs, advantages, loss_mask, num_global_tokens,
    behaviour_weights=None, token_scale=None, sequence_ids=None)``; the trainer calls it
    without knowing which algorithm it is. The bounds arrive validated by the config
    (``LossConfig``); combinations that make no sense for the chosen loss (dual clip with
    GSPO or CISPO) are refused here, once.
    """
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss '{name}'; known: {', '.join(sorted(POLICY_LOSSES))}")
    if dual_clip_c is not None and name in WITHOUT_DUAL_CLIP:
        raise ValueError(dual_clip_refusal(name, dual_clip_c))
    return functools.partial(
        POLICY_LOSSES[name],
        decoupled=decoupled,
        eps_clip_low=eps_clip_low,
        eps_clip_high=eps_clip_high,
        dual_clip_c=dual_clip_c,
    )


SUMMED_LOSSES = ("loss/policy_loss", "loss/kl_loss", "loss/entropy_bonus")
"""Loss metrics that add up over micro-batches (each is already a share of its
minibatch's loss); the trainer averages them over a step's optimizer steps."""
_SUMMED_METRICS = (*SUMMED_LOSSES, "loss/valid_tokens")


def merge_micro_batch_metrics(per_micro_batch: Iterable[Mapping[str, Tensor]]) -> dict[str, float]:
    """Combine the metrics of several micro-batches of one global batch into plain floats.

    The loss and the token count add up (each micro-batch loss is already divided by the
    global token count); ``*_max`` / ``*_min`` take the extreme; everything else is a
    token-weighted mean using ``loss/valid_tokens``.
    """
    parts = [dict(m) for m in per_micro_batch]
    if not parts:
        raise ValueError("merge_micro_batch_metrics needs at least one micro-batch's metrics")
    counts = [float(p["loss/valid_tokens"]) for p in parts]
    total = sum(counts)
    merged: dict[str, float] = {}
    for key in parts[0]:
        values = [float(p[key]) for p in parts]
        if key in _SUMMED_METRICS:
            merged[key] = sum(values)
        elif key.endswith("_max"):
            merged[key] = max(v for v, c in zip(values, counts, strict=True) if c > 0 or total == 0)
        elif key.endswith("_min"):
            merged[key] = min(v for v, c in zip(values, counts, strict=True) if c > 0 or total == 0)
        else:
            merged[key] = (
                sum(v * c for v, c in zip(values, counts, strict=True)) / total if total else 0.0
            )
    return merged
