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
and CISPO in :mod:`sluice.engines.rl.objectives` (which also holds the per-token terms
and metrics all three share). Every loss takes its tensors as one named, frozen
:class:`~sluice.engines.rl.loss_inputs.LossInputs` (shapes checked when it is made) and
its config as keywords; bound to its config it is a
:class:`~sluice.engines.rl.loss_inputs.PolicyLoss`, ``fn(inputs) -> (loss, metrics)``,
as the trainer holds it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping

import torch

from sluice.engines.rl.aggregation import aggregate_token_losses
from sluice.engines.rl.loss_inputs import LossInputs, PolicyLoss
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


def decoupled_ppo_loss(
    inputs: LossInputs,
    *,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    decoupled: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO loss (AReaL eq. 3) of one micro-batch, normalised by the global token count.

    Args:
        inputs: the micro-batch's tensors by name (:class:`LossInputs`, shapes already
            checked): log π_θ (with grad), log π_prox (None only when
            ``decoupled=False``), log π_behav, advantages, the loss mask, the global token
            count, and optionally the corrected behaviour weights (only with
            ``decoupled=True``; used instead of exp(proximal - behaviour)) and the
            aggregation scale (``Σ_t mask_t w_t l_t token_scale_t`` instead of
            ``Σ_t mask_t w_t l_t / num_global_tokens``). ``sequence_ids`` is ignored here.
        eps_clip_low: the ratio is clipped below at ``1 - eps_clip_low`` (in [0, 1]).
        eps_clip_high: the ratio is clipped above at ``1 + eps_clip_high`` (>= 0;
            clip-higher when larger than ``eps_clip_low``).
        dual_clip_c: for negative advantages the per-token loss is capped at
            ``dual_clip_c * |A|``; None disables it. Must exceed 1.

        The bounds are checked once, where the user sets them: the ``trainer.loss``
        config (``sluice.infra.config.trainer.LossConfig``), not on every micro-batch.
        decoupled: True uses π_prox as the trust-region anchor with behaviour weight
            π_prox/π_behav; False is standard PPO with π_old = π_behav (u = π_θ/π_behav,
            w = 1), for which no proximal forward pass is needed.

    Returns:
        ``(loss, metrics)``: a scalar loss to call ``backward()`` on, and detached scalar
        tensors (no host sync) named ``loss/*``. Means in ``metrics`` are over this call's
        valid tokens; combine micro-batches with :func:`merge_micro_batch_metrics`.

    Raises:
        ValueError: on an inconsistent combination of inputs and options (not on
            out-of-range bounds: see above; shapes were checked by ``LossInputs``).
    """
    terms = policy_terms(inputs, decoupled=decoupled)
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
    loss = aggregate_token_losses(weighted, inputs.num_global_tokens, inputs.token_scale)

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


LossResult = tuple[Tensor, dict[str, Tensor]]
"""``(loss, metrics)``: what every policy loss returns (see :class:`PolicyLoss`)."""

POLICY_LOSSES: dict[str, Callable[..., LossResult]] = {
    "decoupled_ppo": decoupled_ppo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}
"""Policy losses by config name. Every entry is ``fn(inputs: LossInputs, *, eps_clip_low,
eps_clip_high, dual_clip_c, decoupled)``, as :func:`decoupled_ppo_loss`: bound to its
config by :func:`make_policy_loss`, it is a :class:`PolicyLoss` (the registry's entries
are checked against that form by tests/unit/test_objectives.py)."""


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
    eps_clip_high=..., dual_clip_c=...)`` gives a :class:`PolicyLoss`, ``fn(inputs)``
    with ``inputs`` a :class:`LossInputs`; the trainer calls it without knowing which
    algorithm it is. The bounds arrive validated by the config
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
