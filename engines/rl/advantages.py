"""Group-relative advantages (GRPO family), one number per sampled response.

A prompt group holds the G responses sampled for one prompt. With rewards r and group
statistics over the G responses of each group:

- ``grpo``:   A_i = (r_i − mean_g) / (std_g + eps)
- ``drgrpo``: A_i = r_i − mean_g (Dr. GRPO: no std, which would up-weight easy and
  hard prompts whose rewards barely vary)
- ``rloo``:   A_i = r_i − mean_{j≠i} r_j = G/(G−1) · (r_i − mean_g) (leave-one-out
  baseline; a group of one has no baseline and gets 0)
- ``batch``:  A_i = (r_i − mean_g) / (std_batch + eps): centred per group, scaled by the
  population std of the centred rewards over the whole batch (all samples, including
  the zeros of all-equal groups). Prompt difficulty is removed by the group mean, while
  the scale is shared, so a group with tiny reward spread is not blown up to unit scale.

Std is the *population* std (divide by G, not G − 1): it is defined for G = 1 and makes
the advantages of a group have unit population variance. γ = λ = 1 and there is no
critic, so a response's advantage is broadcast to all of its tokens
(:func:`broadcast_to_tokens`).

A group whose rewards are all equal carries no learning signal: its advantages are
exactly 0 in every mode, and it is reported in ``zero_variance_groups`` so the data
side can filter it (``drop_zero_variance_groups``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class GroupStats:
    """Per-group reward statistics, indexed by dense group index."""

    group_index: Tensor
    """Dense group index of each sample (int64, [num_samples])."""
    num_groups: int
    """Number of distinct groups."""
    size: Tensor
    """Samples per group (float64, [num_groups])."""
    mean: Tensor
    """Mean reward per group."""
    std: Tensor
    """Population std of the reward per group."""
    zero_variance: Tensor
    """Bool per group: every reward in the group is identical."""


@dataclass(frozen=True)
class AdvantageResult:
    """Advantages of a batch of sampled responses."""

    advantages: Tensor
    """Advantage per sample (float32, [num_samples]), in the order the rewards were given."""
    group_index: Tensor
    """Dense group index (0..num_groups-1) of each sample."""
    zero_variance_groups: Tensor
    """Bool per dense group: all of its rewards were equal (its advantages are 0)."""
    keep_samples: Tensor
    """Bool per sample: False for samples of dropped zero-variance groups, else True."""

    @property
    def num_zero_variance_groups(self) -> int:
        """How many groups carry no signal."""
        return int(self.zero_variance_groups.sum())


AdvantageEstimator = Callable[[Tensor, GroupStats, float], Tensor]


def group_stats(rewards: Tensor, group_ids: Tensor) -> GroupStats:
    """Mean, population std, size and zero-variance flag of every group (float64)."""
    unique, group_index = torch.unique(group_ids, return_inverse=True)
    num_groups = unique.numel()
    r = rewards.to(torch.float64)
    size = torch.zeros(num_groups, dtype=torch.float64).index_add_(
        0, group_index, torch.ones_like(r)
    )
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, r) / size
    centred = r - mean[group_index]
    var = (
        torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, centred * centred)
        / size
    )
    group_max = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(
        0, group_index, r, reduce="amax"
    )
    group_min = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(
        0, group_index, r, reduce="amin"
    )
    return GroupStats(group_index, num_groups, size, mean, var.sqrt(), group_max == group_min)


def _centred(rewards: Tensor, stats: GroupStats) -> Tensor:
    return rewards.to(torch.float64) - stats.mean[stats.group_index]


def _grpo(rewards: Tensor, stats: GroupStats, eps: float) -> Tensor:
    return _centred(rewards, stats) / (stats.std[stats.group_index] + eps)


def _drgrpo(rewards: Tensor, stats: GroupStats, eps: float) -> Tensor:
    return _centred(rewards, stats)


def _rloo(rewards: Tensor, stats: GroupStats, eps: float) -> Tensor:
    size = stats.size[stats.group_index]
    # r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean_g); a singleton has no baseline.
    scale = torch.where(size > 1, size / (size - 1).clamp(min=1), 0.0)
    return scale * _centred(rewards, stats)


def _batch(rewards: Tensor, stats: GroupStats, eps: float) -> Tensor:
    centred = _centred(rewards, stats)
    return centred / (centred.std(correction=0) + eps)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": _grpo,
    "drgrpo": _drgrpo,
    "rloo": _rloo,
    "batch": _batch,
}
"""Advantage estimators by the names ``trainer.advantage.mode`` accepts."""


def compute_advantages(
    rewards: Tensor | Sequence[float],
    *,
    group_ids: Tensor | Sequence[int] | None = None,
    group_size: int | None = None,
    mode: str = "grpo",
    eps: float = 1e-6,
    drop_zero_variance_groups: bool = False,
) -> AdvantageResult:
    """Advantages of sampled responses from their rewards and prompt groups.

    Args:
        rewards: one scalar reward per response ([num_samples]); all must be finite.
        group_ids: integer group label of each response (any values, any order); or
        group_size: G, when the responses arrive as consecutive groups of G.
        mode: one of :data:`ADVANTAGE_ESTIMATORS`.
        eps: added to the std so an all-equal group stays finite.
        drop_zero_variance_groups: mark samples of all-equal groups as not kept.

    Raises:
        ValueError: unknown mode, non-finite rewards (e.g. an unscored sample), or
            missing/inconsistent grouping.
    """
    if mode not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage mode '{mode}'; known: {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    if eps < 0:
        raise ValueError(f"advantage eps must be >= 0, got {eps}")
    r = torch.as_tensor(rewards).detach().cpu()
    if r.dim() != 1 or r.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D sequence, got shape {tuple(r.shape)}")
    if not r.is_floating_point():
        r = r.to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        bad = torch.nonzero(~torch.isfinite(r)).flatten()[:5].tolist()
        raise ValueError(f"rewards must be finite (unscored sample?); bad indices {bad}")
    if (group_ids is None) == (group_size is None):
        raise ValueError("pass exactly one of group_ids or group_size")
    if group_size is not None:
        if group_size < 1 or r.numel() % group_size:
            raise ValueError(
                f"group_size {group_size} does not divide the {r.numel()} rewards into whole groups"
            )
        ids = torch.arange(r.numel()) // group_size
    else:
        ids = torch.as_tensor(group_ids).detach().cpu()
        if ids.shape != r.shape:
            raise ValueError(f"group_ids has shape {tuple(ids.shape)}, rewards {tuple(r.shape)}")
        if ids.is_floating_point():
            raise ValueError("group_ids must be integers")

    stats = group_stats(r, ids)
    advantages = ADVANTAGE_ESTIMATORS[mode](r, stats, eps)
    zero_per_sample = stats.zero_variance[stats.group_index]
    # Exactly 0, not (r - mean)/eps rounding noise, for groups without signal.
    advantages = torch.where(zero_per_sample, 0.0, advantages)
    keep = ~zero_per_sample if drop_zero_variance_groups else torch.ones_like(zero_per_sample)
    return AdvantageResult(
        advantages=advantages.to(torch.float32),
        group_index=stats.group_index,
        zero_variance_groups=stats.zero_variance,
        keep_samples=keep,
    )


AdvantageFn = Callable[..., AdvantageResult]
"""Signature of a configured estimator: ``fn(rewards, *, group_ids=None, group_size=None)``."""


def make_advantage_fn(
    mode: str = "grpo", eps: float = 1e-6, drop_zero_variance_groups: bool = False
) -> AdvantageFn:
    """Bind an advantage config (the fields of ``trainer.advantage``) to a function."""
    if mode not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage mode '{mode}'; known: {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    return functools.partial(
        compute_advantages, mode=mode, eps=eps, drop_zero_variance_groups=drop_zero_variance_groups
    )


def broadcast_to_tokens(
    sample_values: Tensor,
    response_lengths: Tensor | Sequence[int],
    prompt_lengths: Tensor | Sequence[int] | None = None,
) -> Tensor:
    """Copy one value per sample onto each of its response tokens, as one flat tensor.

    Without ``prompt_lengths`` the result is ``[Σ response_lengths]``. With them, each
    sample contributes ``prompt_length`` zeros followed by its response tokens, matching
    a packed prompt+response row.
    """
    values = torch.as_tensor(sample_values)
    lengths = torch.as_tensor(response_lengths, dtype=torch.int64, device=values.device)
    if lengths.shape != values.shape or values.dim() != 1:
        raise ValueError(
            f"response_lengths has shape {tuple(lengths.shape)}, values {tuple(values.shape)}; "
            "need one length per sample"
        )
    if bool((lengths < 0).any()):
        raise ValueError("response_lengths must be non-negative")
    if prompt_lengths is None:
        return torch.repeat_interleave(values, lengths)
    prompts = torch.as_tensor(prompt_lengths, dtype=torch.int64, device=values.device)
    if prompts.shape != lengths.shape:
        raise ValueError("prompt_lengths needs one length per sample")
    if bool((prompts < 0).any()):
        raise ValueError("prompt_lengths must be non-negative")
    # Interleave (0 for the prompt, value for the response) per sample.
    per_segment = torch.stack([torch.zeros_like(values), values], dim=1).flatten()
    segment_lengths = torch.stack([prompts, lengths], dim=1).flatten()
    return torch.repeat_interleave(per_segment, segment_lengths)
