"""Learning-rate schedule of the trainer, as a multiplier of the base learning rate.

``step`` counts the scheduler's steps already taken (0 for the first); the trainer steps it
once per policy version (`train_step`), so every optimizer step of a version shares
its rate and a resume, which restores the version count, goes on where it was.
W = ``warmup_steps``,
T = ``total_steps``, m = ``min_ratio``::

    s < W        (s + 1) / W                          linear warm-up
    W <= s < T   constant: 1
                 linear:   1 - (1 - m) · p            with p = (s - W) / (T - W)
                 cosine:   m + (1 - m) · ½ (1 + cos π p)
    s >= T       constant: 1; linear and cosine: m

The warm-up is (s + 1) / W rather than s / W so the first optimizer step does not get
learning rate 0 (a wasted step; transformers' and verl's schedulers start at 0); it
reaches the base learning rate on step W − 1, the last warm-up step, so step W also runs
at 1 before decay. Decay reaches m at step T, as in transformers' schedulers: a run of T
steps (s = 0 .. T − 1) ends just above m. Every multiplier is in [m, 1] after warm-up;
the warm-up rises monotonically and the decay falls monotonically.

Equivalents elsewhere: verl ``optim.lr_warmup_steps`` (or ``lr_warmup_steps_ratio``),
``optim.lr_scheduler_type`` (formerly ``warmup_style``: ``constant`` | ``cosine``)
and ``min_lr_ratio``; TRL/transformers ``warmup_steps`` / ``warmup_ratio`` and
``lr_scheduler_type`` (``constant_with_warmup`` | ``linear`` | ``cosine``, the latter two
decaying to 0, i.e. m = 0).
"""

from __future__ import annotations

import math

LR_DECAYS = ("constant", "linear", "cosine")
"""The decays :func:`lr_multiplier` accepts after warm-up."""


def lr_multiplier(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay: str,
    min_ratio: float,
) -> float:
    """Multiplier of the base learning rate at scheduler step ``step`` (see the module).

    Args:
        step: scheduler steps already taken (policy versions, in the trainer), 0 for the
            first; non-negative.
        warmup_steps: W, steps of linear warm-up (0 for none); at most ``total_steps``.
        total_steps: T, the step at which the decay reaches ``min_ratio``; positive.
        decay: one of :data:`LR_DECAYS`.
        min_ratio: m, the final multiplier of ``linear`` and ``cosine``, in [0, 1];
            ``constant`` ignores it.
    """
    if decay not in LR_DECAYS:
        raise ValueError(f"unknown learning-rate decay '{decay}'; known: {', '.join(LR_DECAYS)}")
    if step < 0:
        raise ValueError(f"step counts scheduler steps taken and must be >= 0, got {step}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}"
        )
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")

    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    if step >= total_steps:
        return min_ratio
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    if decay == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
