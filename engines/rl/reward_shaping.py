"""Reward shaping applied to a response's outcome reward before advantages are computed.

:func:`overlong_penalty` is DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An
Open-Source LLM Reinforcement Learning System at Scale", arXiv 2503.14476, eq. 13). With
L the response length, L_max the generation limit and L_cache the buffer before it::

    R_length(L) = 0                               if L <= L_max - L_cache
                  ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
                  -1                              if L > L_max

The penalty grows linearly from 0 to −1 across the buffer, so a response that is merely
long is punished a little and one cut off at the limit fully, instead of every truncated
response getting the same reward as a wrong answer. DAPO adds R_length to the
rule-based correctness reward. verl exposes it as
``reward_model.overlong_buffer.{enable,len,penalty_factor}``; ``penalty_factor``
scales R_length (the paper's formula is factor 1).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def overlong_penalty(
    response_lengths: Tensor,
    max_response_tokens: int,
    buffer_tokens: int,
    penalty_factor: float = 1.0,
) -> Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13) per response, to add to its reward.

    Args:
        response_lengths: generated tokens of each response (any shape, non-negative).
        max_response_tokens: L_max, the generation limit.
        buffer_tokens: L_cache, the length of the punishment buffer just below L_max; in
            [1, max_response_tokens).
        penalty_factor: scale of the penalty (verl ``penalty_factor``); non-negative.

    Returns:
        float64 tensor of the shape of ``response_lengths``, in [−penalty_factor, 0]:
        0 up to L_max − L_cache, ((L_max − L_cache) − L) / L_cache · factor inside the
        buffer (reaching −factor at L = L_max), −factor beyond L_max.
    """
    if not 1 <= buffer_tokens < max_response_tokens:
        raise ValueError(
            f"overlong buffer_tokens must be in [1, max_response_tokens={max_response_tokens}), "
            f"got {buffer_tokens}"
        )
    if not penalty_factor >= 0:
        raise ValueError(f"overlong penalty_factor must be non-negative, got {penalty_factor}")
    lengths = response_lengths.to(torch.float64)
    if lengths.numel() and bool((lengths < 0).any()):
        raise ValueError("response_lengths must be non-negative")
    expected = float(max_response_tokens - buffer_tokens)
    # Inside the buffer this is eq. 13's linear ramp; clamping at 0 gives the flat part
    # below the buffer and clamping at −1 the full punishment past L_max.
    ramp = ((expected - lengths) / buffer_tokens).clamp(min=-1.0, max=0.0)
    return penalty_factor * ramp
