"""Train–inference mismatch and policy-health metrics, as plain floats ready to log.

Everything is computed over valid (``loss_mask``) tokens in float64, with
δ_t = proximal_logprobs_t − behaviour_logprobs_t = log π_prox − log π_behav. Samples come
from π_behav, so with r = π_prox / π_behav = exp δ:

- ``mismatch/kl_k3`` = mean(exp δ − δ − 1): the k3 estimator of KL(π_behav ‖ π_prox)
  (for KL(p‖q) with x ~ p and r = q/p, k3 = r − 1 − log r; never negative per token).
- ``mismatch/kl_k1`` = mean(−δ): the plain (k1) estimator of the same KL.
- ``mismatch/training_ppl`` / ``mismatch/rollout_ppl``: per response
  exp(−mean_t logprob) under π_prox / π_behav, then the mean over responses.
- ``mismatch/log_ppl_diff`` = mean over responses of (log ppl_train − log ppl_rollout)
  = mean over responses of (−mean_t δ); ``mismatch/log_ppl_abs_diff`` its absolute value.
- ``mismatch/chi2_token`` = E_t[(exp δ_t)²] − 1 and ``mismatch/chi2_sequence`` =
  E_seq[(exp Σδ)²] − 1: χ² divergence estimates; the variance an importance weight adds.
- ``is/token_weight_*`` and ``is/sequence_weight_*``: raw weights exp δ_t and exp Σδ.
- ``is/ess_*``: effective sample size fraction (Σw)² / (N Σw²), 1 = uniform weights.
- ``is/corrected_weight_*``, ``is/ess_corrected``, ``is/masked_fraction``,
  ``is/rejected_sequence_fraction``: the weights after rollout correction, over the
  originally valid tokens (rejected tokens count as weight 0).
- ``policy/entropy``: mean token entropy of the given logits.

Sequence-level log weights are clamped to ±50 before exponentiating, so one runaway
response yields a huge but finite number instead of ``inf`` in the logs. The key set
depends only on which optional inputs are given, never on the data; a value that is
undefined (no valid token) is ``nan``.
"""

from __future__ import annotations

import math

import torch

from sluice.engines.rl.rollout_correction import Segments, sequence_ids_from_cu_seqlens

Tensor = torch.Tensor

_SEQUENCE_LOG_WEIGHT_CLAMP = 50.0
_ENTROPY_CHUNK_TOKENS = 4096


def _mean(values: Tensor) -> float:
    return float(values.mean()) if values.numel() else math.nan


def _max(values: Tensor) -> float:
    return float(values.max()) if values.numel() else math.nan


def _min(values: Tensor) -> float:
    return float(values.min()) if values.numel() else math.nan


def effective_sample_size(weights: Tensor) -> float:
    """(Σw)² / (N Σw²) in [0, 1]: the fraction of samples the weighted estimate is worth."""
    if weights.numel() == 0:
        return math.nan
    w = weights.to(torch.float64)
    square_sum = float((w * w).sum())
    if square_sum == 0.0:
        return 0.0
    return float(w.sum()) ** 2 / (w.numel() * square_sum)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per row, computed in chunks so [N, V] never doubles in memory."""
    rows = logits.reshape(-1, logits.shape[-1])
    out = []
    with torch.no_grad():
        for start in range(0, rows.shape[0], _ENTROPY_CHUNK_TOKENS):
            chunk = rows[start : start + _ENTROPY_CHUNK_TOKENS].to(torch.float32)
            probs = torch.softmax(chunk, dim=-1)
            # xlogy gives 0 * log 0 = 0, so -inf logits (masked vocabulary) stay finite.
            out.append(-torch.special.xlogy(probs, probs).sum(-1))
    if not out:
        return torch.zeros(0)
    return torch.cat(out)


def mismatch_metrics(
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
    sequence_ids: Tensor | None = None,
    behaviour_weights: Tensor | None = None,
    corrected_loss_mask: Tensor | None = None,
    logits: Tensor | None = None,
) -> dict[str, float]:
    """Mismatch, importance-weight and health metrics of one batch (see the module docstring).

    Args:
        proximal_logprobs: log π_prox per token (flat 1-D).
        behaviour_logprobs: log π_behav per token.
        loss_mask: valid (response) tokens, before rollout correction.
        cu_seqlens: cumulative sequence lengths of the packed batch; or
        sequence_ids: the sequence index of every token. Exactly one is required.
        behaviour_weights: weights after rollout correction (adds ``is/corrected_*``).
        corrected_loss_mask: mask after rollout correction (adds ``is/masked_fraction``
            and ``is/rejected_sequence_fraction``).
        logits: ``[N, V]`` (or ``[1, N, V]``) logits aligned with the tokens, already
            divided by the sampling temperature (adds ``policy/entropy``).
    """
    if proximal_logprobs.dim() != 1:
        raise ValueError(
            "mismatch_metrics takes flat 1-D per-token tensors, got proximal_logprobs of "
            f"shape {tuple(proximal_logprobs.shape)}"
        )
    num_tokens = proximal_logprobs.numel()
    named = {
        "behaviour_logprobs": behaviour_logprobs,
        "loss_mask": loss_mask,
        "behaviour_weights": behaviour_weights,
        "corrected_loss_mask": corrected_loss_mask,
    }
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != proximal_logprobs.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but proximal_logprobs has "
                f"{tuple(proximal_logprobs.shape)}"
            )
    if (cu_seqlens is None) == (sequence_ids is None):
        raise ValueError("mismatch_metrics needs sequence boundaries: cu_seqlens or sequence_ids")
    if cu_seqlens is not None:
        segments = Segments(
            sequence_ids_from_cu_seqlens(cu_seqlens.cpu(), num_tokens), cu_seqlens.numel() - 1
        )
    else:
        assert sequence_ids is not None
        if sequence_ids.shape != (num_tokens,):
            raise ValueError(
                f"sequence_ids has shape {tuple(sequence_ids.shape)}, expected ({num_tokens},)"
            )
        ids = sequence_ids.detach().cpu().to(torch.int64)
        segments = Segments(ids, int(ids.max()) + 1 if num_tokens else 0)

    valid = loss_mask.detach().cpu().to(torch.bool)
    prox = proximal_logprobs.detach().cpu().to(torch.float64)
    behav = behaviour_logprobs.detach().cpu().to(torch.float64)
    delta = torch.where(valid, prox - behav, 0.0)
    valid_f = valid.to(torch.float64)

    token_delta = delta[valid]
    token_weight = token_delta.exp()
    counts = segments.sum(valid_f)
    has_tokens = counts > 0
    n_seq = counts[has_tokens]
    seq_delta_sum = segments.sum(delta)[has_tokens]
    seq_mean_prox = segments.sum(torch.where(valid, prox, 0.0))[has_tokens] / n_seq
    seq_mean_behav = segments.sum(torch.where(valid, behav, 0.0))[has_tokens] / n_seq
    seq_log_weight = seq_delta_sum.clamp(-_SEQUENCE_LOG_WEIGHT_CLAMP, _SEQUENCE_LOG_WEIGHT_CLAMP)
    seq_weight = seq_log_weight.exp()
    log_ppl_diff = seq_mean_behav - seq_mean_prox

    out: dict[str, float] = {
        "mismatch/valid_tokens": float(token_delta.numel()),
        "mismatch/num_sequences": float(n_seq.numel()),
        "mismatch/kl_k3": _mean(token_weight - token_delta - 1.0),
        "mismatch/kl_k1": _mean(-token_delta),
        "mismatch/training_ppl": _mean((-seq_mean_prox).exp()),
        "mismatch/rollout_ppl": _mean((-seq_mean_behav).exp()),
        "mismatch/log_ppl_diff": _mean(log_ppl_diff),
        "mismatch/log_ppl_abs_diff": _mean(log_ppl_diff.abs()),
        "mismatch/chi2_token": _mean(token_weight * token_weight) - 1.0,
        "mismatch/chi2_sequence": _mean((2.0 * seq_log_weight).exp()) - 1.0,
        "is/token_weight_mean": _mean(token_weight),
        "is/token_weight_max": _max(token_weight),
        "is/token_weight_min": _min(token_weight),
        "is/ess_token": effective_sample_size(token_weight),
        "is/sequence_weight_mean": _mean(seq_weight),
        "is/sequence_weight_max": _max(seq_weight),
        "is/sequence_weight_min": _min(seq_weight),
        "is/ess_sequence": effective_sample_size(seq_weight),
    }
    if behaviour_weights is not None:
        corrected = behaviour_weights.detach().cpu().to(torch.float64)[valid]
        out["is/corrected_weight_mean"] = _mean(corrected)
        out["is/corrected_weight_max"] = _max(corrected)
        out["is/corrected_weight_min"] = _min(corrected)
        out["is/ess_corrected"] = effective_sample_size(corrected)
    if corrected_loss_mask is not None:
        kept = corrected_loss_mask.detach().cpu().to(torch.bool) & valid
        out["is/masked_fraction"] = (
            1.0 - float(kept.sum()) / token_delta.numel() if token_delta.numel() else math.nan
        )
        kept_per_seq = segments.sum(kept.to(torch.float64))[has_tokens]
        out["is/rejected_sequence_fraction"] = _mean((kept_per_seq == 0).to(torch.float64))
    if logits is not None:
        if logits.shape[:-1].numel() != num_tokens:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not align with {num_tokens} tokens"
            )
        rows = logits.detach().reshape(num_tokens, logits.shape[-1])
        # Only response tokens: prompt rows of a packed batch would double the work.
        entropy = token_entropy(rows[valid.to(rows.device)]).cpu().to(torch.float64)
        out["policy/entropy"] = _mean(entropy)
    return out
