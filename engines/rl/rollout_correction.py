"""Rollout correction: truncate or reject the behaviour weight w = π_prox / π_behav.

The inference engine and the trainer never compute identical probabilities (other
kernels, other precision, a weight update landing mid-response), so the behaviour
weight of decoupled PPO can explode on a few tokens or whole responses. Following
"When Speed Kills Stability" (train–inference mismatch), with
δ_t = proximal_logprobs_t − behaviour_logprobs_t over a response's valid tokens:

================  ==========================================================  =====================
mode              behaviour weight of kept tokens                             what gets masked
================  ==========================================================  =====================
``none``          exp δ_t                                                     nothing
``token_tis``     min(exp δ_t, C)                                             nothing
``sequence_tis``  min(exp Σδ, C), the same for every token of the response    nothing
``token_mis``     exp δ_t                                                     tokens with exp δ_t > C
``sequence_mis``  exp Σδ (the sequence importance weight)                     responses with exp Σδ > C
``geometric_rs``  exp δ_t (the plain decoupled-PPO weight)                    responses with exp(mean δ)
                                                                              outside [lower, upper]
``icepop``        exp δ_t                                                     tokens with exp δ_t
                                                                              outside [lower, upper]
================  ==========================================================  =====================

Masked tokens get weight 0 and ``loss_mask`` False.

``icepop`` is IcePop (Ling team, the Ring-1T report and its "IcePop" blog): a token is
kept, with its plain weight, only while its ratio lies in [``icepop_lower``,
``icepop_upper``] (bounds included). Unlike ``token_mis`` it also masks tokens whose
ratio collapsed (π_prox far below π_behav); unlike ``geometric_rs`` it never masks a
whole response, only the offending tokens. The same rule is NeMo-RL's
``truncated_importance_sampling_type: icepop``, slime's ``icepop_function``, SkyRL's
``token_mask_is_threshold_low/high``, AReaL's token-level ``rejection_sampling``
(``metric: ratio, action: mask``) and verl's ``rollout_rs: token_k1`` with a
``lower_upper`` threshold. The defaults 0.5 and 5.0 are the published ones: NeMo-RL's
ProRL v2 guide and configs use ratio bounds 0.5 and 5.0 ("ref bounds: 0.5–5" in its
loss), and AReaL's ``rejection_sampling`` defaults ``upper`` to 5.0 with 0.5 the
"typical" ``lower``. SkyRL's docs and slime's tests start tighter, at [0.5, 2.0].

**Denominator policy.** Masked tokens leave the loss numerator but stay in the
denominator: the trainer passes ``num_global_tokens`` counted from the mask *before*
correction. Rejection therefore down-weights the batch instead of re-scaling the
survivors: the loss stays the mean over all sampled tokens of an estimator whose
rejected terms contribute zero. Re-normalising by the kept count would multiply the
survivors' gradient by 1 / (1 - rejected fraction) — by 10x when 90% is rejected, which
is exactly when the batch is least trustworthy — and would make the step size depend on
how many tokens the mismatch happened to hit. It also keeps the denominator a number
known before the proximal forward pass, with no extra reduction across micro-batches.

Tensor convention: flat 1-D per-token tensors of a packed batch, with sequence
boundaries given as ``cu_seqlens`` (``[0, l0, l0+l1, ...]``) or per-token
``sequence_ids``. Sequence-level modes need one of them; token-level modes ignore them.
Sums and means over a sequence use only its valid (``loss_mask``) tokens, so the prompt
tokens of a packed prompt+response row do not count.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class CorrectionBounds:
    """Thresholds of a rollout-correction mode."""

    threshold: float = 2.0
    """C: cap of the weight for TIS, rejection bound for MIS. Must be positive."""
    geometric_lower: float = 0.999
    """Geometric RS keeps a response only if exp(mean δ) >= this."""
    geometric_upper: float = 1.001
    """Geometric RS keeps a response only if exp(mean δ) <= this."""
    icepop_lower: float = 0.5
    """IcePop keeps a token only if exp δ_t >= this; in (0, 1]."""
    icepop_upper: float = 5.0
    """IcePop keeps a token only if exp δ_t <= this; at least 1."""

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"rollout correction threshold must be positive, got {self.threshold}")
        if not 0 < self.geometric_lower <= self.geometric_upper:
            raise ValueError(
                "geometric_rs needs 0 < geometric_lower <= geometric_upper, got "
                f"[{self.geometric_lower}, {self.geometric_upper}]"
            )
        if not 0 < self.icepop_lower <= 1 <= self.icepop_upper:
            raise ValueError(
                "icepop needs 0 < icepop_lower <= 1 <= icepop_upper, got "
                f"[{self.icepop_lower}, {self.icepop_upper}]"
            )


@dataclass(frozen=True)
class RolloutCorrection:
    """Result of a rollout correction: what the loss takes as ``behaviour_weights`` and ``loss_mask``."""

    behaviour_weights: Tensor
    """w per token, detached, same shape as the inputs; 0 where the token is masked."""
    loss_mask: Tensor
    """Bool per token: the input mask with rejected tokens removed."""


@dataclass(frozen=True)
class Segments:
    """Sequence membership of the tokens of a packed batch."""

    sequence_ids: Tensor
    """Per-token index of the sequence it belongs to (int64, values in [0, num_sequences))."""
    num_sequences: int
    """Number of sequences (some may have no valid tokens)."""

    def sum(self, values: Tensor) -> Tensor:
        """Per-sequence sum of a per-token tensor, shape [num_sequences]."""
        out = torch.zeros(self.num_sequences, dtype=values.dtype, device=values.device)
        return out.index_add_(0, self.sequence_ids, values)

    def broadcast(self, per_sequence: Tensor) -> Tensor:
        """Per-sequence values copied onto each token of the sequence."""
        return per_sequence[self.sequence_ids]


def sequence_ids_from_cu_seqlens(cu_seqlens: Tensor, num_tokens: int | None = None) -> Tensor:
    """Per-token sequence index from cumulative lengths ``[0, l0, l0+l1, ..., total]``."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D tensor [0, l0, l0+l1, ..., total]")
    cu = cu_seqlens.to(torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    lengths = cu.diff()
    if bool((lengths < 0).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    if num_tokens is not None and int(cu[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but there are {num_tokens} tokens")
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)


def _segments(
    num_tokens: int,
    device: torch.device,
    cu_seqlens: Tensor | None,
    sequence_ids: Tensor | None,
) -> Segments | None:
    if cu_seqlens is not None and sequence_ids is not None:
        raise ValueError("pass sequence boundaries once: cu_seqlens or sequence_ids, not both")
    if cu_seqlens is not None:
        ids = sequence_ids_from_cu_seqlens(cu_seqlens, num_tokens).to(device)
        return Segments(ids, cu_seqlens.numel() - 1)
    if sequence_ids is not None:
        if sequence_ids.shape != (num_tokens,):
            raise ValueError(
                f"sequence_ids has shape {tuple(sequence_ids.shape)}, expected ({num_tokens},)"
            )
        ids = sequence_ids.to(device=device, dtype=torch.int64)
        if num_tokens and int(ids.min()) < 0:
            raise ValueError("sequence_ids must be non-negative")
        return Segments(ids, int(ids.max()) + 1 if num_tokens else 0)
    return None


# A rule maps (δ with zeros at invalid tokens, valid mask, segments, bounds) to
# (weights, keep); weights at tokens that are not kept are ignored.
CorrectionRule = Callable[
    [Tensor, Tensor, Segments | None, CorrectionBounds], tuple[Tensor, Tensor]
]


def _need_segments(mode: str, segments: Segments | None) -> Segments:
    if segments is None:
        raise ValueError(
            f"rollout correction mode '{mode}' works per response and needs sequence "
            "boundaries: pass cu_seqlens or sequence_ids"
        )
    return segments


def _none(
    delta: Tensor, valid: Tensor, seg: Segments | None, b: CorrectionBounds
) -> tuple[Tensor, Tensor]:
    return torch.exp(delta), torch.ones_like(valid)


def _token_tis(
    delta: Tensor, valid: Tensor, seg: Segments | None, b: CorrectionBounds
) -> tuple[Tensor, Tensor]:
    # Clamping in log space keeps a huge δ from overflowing before the cap applies.
    return torch.exp(delta.clamp(max=math.log(b.threshold))), torch.ones_like(valid)


def _sequence_tis(
    delta: Tensor, valid: Tensor, seg: Segments | None, b: CorrectionBounds
) -> tuple[Tensor, Tensor]:
    segments = _need_segments("sequence_tis", seg)
    log_seq_weight = segments.sum(delta).clamp(max=math.log(b.threshold))
    return segments.broadcast(torch.exp(log_seq_weight)), torch.ones_like(valid)


def _token_mis(
    delta: Tensor, valid: Tensor, seg: Segments | None, b: CorrectionBounds
) -> tuple[Tensor, Tensor]:
    keep = delta <= math.log(b.threshold)
    return torch.exp(delta.clamp(max=math.log(b.threshold))), keep


def _sequence_mis(
    delta: Tensor, valid: Tensor, seg: Segments | None, b: CorrectionBounds
) -> tuple[Tensor, Tensor]:
    segments = _need_segments("sequence_mis", seg)
    log_seq_weight = segments.sum(delta)
    keep_sequence = log_seq_weight <= math.log(b.threshold)
    weight = torch.exp(log_seq_weight.clamp(max=math.log(b.threshold)))
    return segments.broadcast(weight), segments.broadcast(keep_sequence)


def _geometric_rs(
    delta: Tensor, valid: Tensor, seg: Segments | None, b: CorrectionBounds
) -> tuple[Tensor, Tensor]:
    segments = _need_segments("geometric_rs", seg)
    counts = segments.sum(valid.to(delta.dtype))
    # A response without valid tokens has mean δ := 0 (ratio 1): kept, though it
    # contributes nothing anyway.
    mean_delta = segments.sum(delta) / counts.clamp(min=1)
    keep_sequence = (mean_delta >= math.log(b.geometric_lower)) & (
        mean_delta <= math.log(b.geometric_upper)
    )
    return torch.exp(delta), segments.broadcast(keep_sequence)


def _icepop(
    delta: Tensor, valid: Tensor, seg: Segments | None, b: CorrectionBounds
) -> tuple[Tensor, Tensor]:
    low, high = math.log(b.icepop_lower), math.log(b.icepop_upper)
    keep = (delta >= low) & (delta <= high)
    # Kept tokens lie inside the bounds, so the clamp changes none of them; it only keeps
    # a huge δ on a masked token from overflowing.
    return torch.exp(delta.clamp(low, high)), keep


ROLLOUT_CORRECTIONS: dict[str, CorrectionRule] = {
    "none": _none,
    "token_tis": _token_tis,
    "sequence_tis": _sequence_tis,
    "token_mis": _token_mis,
    "sequence_mis": _sequence_mis,
    "geometric_rs": _geometric_rs,
    "icepop": _icepop,
}
"""Rollout-correction rules by the names ``trainer.correction.mode`` accepts."""


def correct_behaviour_weights(
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
    sequence_ids: Tensor | None = None,
    mode: str = "token_tis",
    threshold: float = 2.0,
    geometric_lower: float = 0.999,
    geometric_upper: float = 1.001,
    icepop_lower: float = 0.5,
    icepop_upper: float = 5.0,
) -> RolloutCorrection:
    """Behaviour weights and the corrected loss mask for one packed batch (see module docstring).

    Args:
        proximal_logprobs: log π_prox per token (flat 1-D).
        behaviour_logprobs: log π_behav per token, as recorded by the inference engine.
        loss_mask: True/1 for response tokens that enter the loss.
        cu_seqlens: cumulative sequence lengths ``[0, l0, l0+l1, ..., N]``.
        sequence_ids: alternatively, the sequence index of every token.
        mode: one of :data:`ROLLOUT_CORRECTIONS`.
        threshold: C, the TIS cap / MIS rejection bound on the weight.
        geometric_lower: lower bound on exp(mean δ) for ``geometric_rs``.
        geometric_upper: upper bound on exp(mean δ) for ``geometric_rs``.
        icepop_lower: ``icepop`` masks tokens with exp δ_t below this (in (0, 1]).
        icepop_upper: ``icepop`` masks tokens with exp δ_t above this (>= 1).

    Raises:
        ValueError: unknown mode, mismatched shapes, bad boundaries or thresholds, or a
            non-finite log-prob on a valid token (a corrupt rollout must not silently
            become weight 0 or inf).
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(
            f"unknown rollout correction mode '{mode}'; known: {', '.join(ROLLOUT_CORRECTIONS)}"
        )
    bounds = CorrectionBounds(
        threshold, geometric_lower, geometric_upper, icepop_lower, icepop_upper
    )
    if proximal_logprobs.dim() != 1:
        raise ValueError(
            f"rollout correction takes flat 1-D per-token tensors, got proximal_logprobs of "
            f"shape {tuple(proximal_logprobs.shape)}"
        )
    for name, tensor in (("behaviour_logprobs", behaviour_logprobs), ("loss_mask", loss_mask)):
        if tensor.shape != proximal_logprobs.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but proximal_logprobs has "
                f"{tuple(proximal_logprobs.shape)}"
            )
    num_tokens = proximal_logprobs.numel()
    segments = _segments(num_tokens, proximal_logprobs.device, cu_seqlens, sequence_ids)

    with torch.no_grad():
        valid = loss_mask.to(torch.bool)
        raw_delta = proximal_logprobs.detach() - behaviour_logprobs.detach().to(
            proximal_logprobs.dtype
        )
        if not bool(torch.isfinite(raw_delta[valid]).all()):
            raise ValueError(
                "proximal_logprobs or behaviour_logprobs is not finite on a valid token; "
                "refusing to turn a corrupt rollout into an importance weight"
            )
        delta = torch.where(valid, raw_delta, 0.0)
        weights, keep = ROLLOUT_CORRECTIONS[mode](delta, valid, segments, bounds)
        kept = valid & keep
        weights = torch.where(kept, weights, 0.0)
    return RolloutCorrection(behaviour_weights=weights, loss_mask=kept)


RolloutCorrectionFn = Callable[..., RolloutCorrection]
"""Signature of a configured correction: ``fn(proximal_logprobs, behaviour_logprobs,
loss_mask, *, cu_seqlens=None, sequence_ids=None) -> RolloutCorrection``."""


def make_rollout_correction(
    mode: str = "token_tis",
    threshold: float = 2.0,
    geometric_lower: float = 0.999,
    geometric_upper: float = 1.001,
    icepop_lower: float = 0.5,
    icepop_upper: float = 5.0,
) -> RolloutCorrectionFn:
    """Bind a correction config (the fields of ``trainer.correction``) to a function.

    Validates eagerly, so a bad config fails at start-up rather than at the first batch.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(
            f"unknown rollout correction mode '{mode}'; known: {', '.join(ROLLOUT_CORRECTIONS)}"
        )
    CorrectionBounds(threshold, geometric_lower, geometric_upper, icepop_lower, icepop_upper)
    return functools.partial(
        correct_behaviour_weights,
        mode=mode,
        threshold=threshold,
        geometric_lower=geometric_lower,
        geometric_upper=geometric_upper,
        icepop_lower=icepop_lower,
        icepop_upper=icepop_upper,
    )
