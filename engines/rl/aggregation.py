"""Loss aggregation: how per-token losses of a minibatch become one scalar.

A policy objective produces a loss ``l_t`` per trained token (mask_t = 1); the modes
below, named as verl's ``loss_agg_mode`` names them (TRL's ``loss_type`` has the same
three under other names), differ in how those are averaged over a minibatch of G
sequences, sequence i holding n_i trained tokens and N = Σ_i n_i:

=======================  =================================  ================================
mode                     minibatch loss                     factor scale_t of token t in i
=======================  =================================  ================================
``token-mean``           Σ_t l_t / N                        1 / N  (``num_global_tokens``)
``seq-mean-token-mean``  (1/G) Σ_i (1/n_i) Σ_{t∈i} l_t      1 / (n_i · G)
``seq-mean-token-sum``   (1/G) Σ_i Σ_{t∈i} l_t              1 / G
=======================  =================================  ================================

``token-mean`` (DAPO, AReaL, the default) weighs every token alike, so long responses
carry more of the gradient; ``seq-mean-token-mean`` is GRPO's original form and the
one the GSPO paper uses (every response weighs alike, whatever its length);
``seq-mean-token-sum`` (Dr. GRPO's choice up to a constant) drops the length
normalisation inside a response.

Every mode is a per-token factor that depends only on the token's sequence and on
minibatch-wide counts (G or N). A micro-batch that holds whole sequences can therefore
compute its share exactly, and the micro-batch losses add up to the minibatch loss: the
trainer passes the factor as ``token_scale`` to the policy loss. ``token-mean`` keeps
the loss's own division by ``num_global_tokens`` (:func:`aggregation_scale` returns
None for it), so the default path is unchanged to the bit.

The counts n_i, N and G come from the trained-token mask *before* rollout correction,
as ``num_global_tokens`` always has (see :mod:`sluice.engines.rl.rollout_correction`):
rejecting tokens removes them from the numerator, never re-weights the survivors.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
"""Aggregation modes :func:`aggregation_scale` knows, by verl's ``loss_agg_mode`` names."""


def aggregation_scale(
    loss_mask: Tensor, sequence_ids: Tensor, mode: str, num_global_sequences: int
) -> Tensor | None:
    """Per-token factor that turns ``Σ_t mask_t · l_t · scale_t`` into the aggregated loss.

    Args:
        loss_mask: 1/True for the trained tokens of one micro-batch, *before* rollout
            correction; any layout (flat 1-D for a packed micro-batch).
        sequence_ids: int index of each token's sequence within the micro-batch (values
            in [0, S)), same shape as ``loss_mask``. Sequences must be whole: one is
            never split across micro-batches, or its n_i would be counted in parts.
        mode: one of :data:`LOSS_AGG_MODES`.
        num_global_sequences: G, the sequences of the whole minibatch (all its
            micro-batches) with at least one trained token. Must be positive.

    Returns:
        None for ``token-mean`` (the loss divides by ``num_global_tokens`` as before);
        otherwise a float64 tensor of ``loss_mask``'s shape on its device (the loss casts
        it to its own dtype and device, so a float64 loss keeps full precision):
        ``1 / (n_i · G)`` for ``seq-mean-token-mean``, ``1 / G`` for
        ``seq-mean-token-sum``, and 0 on every token of a sequence without trained
        tokens (no 0/0). Masked tokens of a trained sequence share its factor; the
        mask zeroes them in the loss.

    Raises:
        ValueError: on an unknown mode, mismatched shapes, non-integer or negative
            sequence ids, or a non-positive ``num_global_sequences``.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss aggregation mode '{mode}'; known: {', '.join(LOSS_AGG_MODES)}"
        )
    if mode == "token-mean":
        return None
    if sequence_ids.shape != loss_mask.shape:
        raise ValueError(
            f"sequence_ids has shape {tuple(sequence_ids.shape)} but loss_mask has "
            f"{tuple(loss_mask.shape)}; every per-token input must share one layout"
        )
    if sequence_ids.dtype.is_floating_point or sequence_ids.dtype == torch.bool:
        raise ValueError(f"sequence_ids must be an integer tensor, got {sequence_ids.dtype}")
    if num_global_sequences <= 0:
        raise ValueError(
            f"num_global_sequences must be positive, got {num_global_sequences}; "
            "a minibatch without trained sequences has no loss"
        )
    dtype = torch.float64
    ids = sequence_ids.reshape(-1).to(device=loss_mask.device, dtype=torch.int64)
    trained = (loss_mask.reshape(-1) > 0).to(dtype)
    if ids.numel() == 0:
        return torch.zeros(loss_mask.shape, dtype=dtype, device=loss_mask.device)
    if int(ids.min()) < 0:
        raise ValueError("sequence_ids must be non-negative")
    num_sequences = int(ids.max()) + 1
    # n_i per token: the trained-token count of the token's sequence.
    per_sequence = torch.zeros(num_sequences, dtype=dtype, device=trained.device)
    n = per_sequence.index_add_(0, ids, trained)[ids]
    if mode == "seq-mean-token-mean":
        scale = 1.0 / (n.clamp(min=1) * num_global_sequences)
    else:  # seq-mean-token-sum
        scale = torch.full_like(n, 1.0 / num_global_sequences)
    return torch.where(n > 0, scale, 0.0).reshape(loss_mask.shape)


def aggregate_token_losses(
    weighted: Tensor, num_global_tokens: int | float | Tensor, token_scale: Tensor | None
) -> Tensor:
    """The micro-batch's share of the minibatch loss from its masked, weighted token losses.

    ``weighted`` holds mask_t · w_t · l_t (0 at masked tokens). Without ``token_scale``
    this is token-mean, ``Σ weighted / num_global_tokens``; with it, the mode that
    produced the factor (:func:`aggregation_scale`), ``Σ weighted · token_scale``. The
    factor is a constant: no gradient flows into it.
    """
    if token_scale is None:
        return weighted.sum() / num_global_tokens
    return (weighted * token_scale.detach().to(weighted.device, weighted.dtype)).sum()
