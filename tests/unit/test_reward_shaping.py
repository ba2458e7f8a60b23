"""DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13) at and between its boundaries."""

import pytest
import torch

from sluice.engines.rl.reward_shaping import overlong_penalty

# L_max = 20, L_cache = 4: no penalty up to 16, a linear ramp to -1 at 20, -1 past it.
LENGTHS = torch.tensor([0, 16, 17, 18, 20, 21])


def test_overlong_penalty_follows_eq_13_at_the_boundaries():
    out = overlong_penalty(LENGTHS, 20, 4)
    # 0, 0 (L = L_max - L_cache), (16 - 17) / 4 = -0.25, (16 - 18) / 4 = -0.5,
    # (16 - 20) / 4 = -1 (L = L_max, still the ramp), -1 (L > L_max)
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0], dtype=torch.float64)
    torch.testing.assert_close(out, expected)
    assert out.dtype == torch.float64


def test_penalty_factor_scales_the_whole_curve():
    out = overlong_penalty(LENGTHS, 20, 4, penalty_factor=0.5)
    expected = torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5], dtype=torch.float64)
    torch.testing.assert_close(out, expected)


def test_one_token_buffer_is_a_step_at_the_limit():
    # L_cache = 1: 0 up to 19, (19 - 20) / 1 = -1 at 20
    out = overlong_penalty(torch.tensor([18, 19, 20]), 20, 1)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -1.0], dtype=torch.float64))


def test_shape_is_preserved():
    out = overlong_penalty(torch.tensor([[16, 18], [20, 0]]), 20, 4)
    torch.testing.assert_close(out, torch.tensor([[0.0, -0.5], [-1.0, 0.0]], dtype=torch.float64))


def test_zero_factor_disables_the_penalty():
    assert bool((overlong_penalty(LENGTHS, 20, 4, penalty_factor=0.0) == 0).all())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"buffer_tokens": 0}, "buffer_tokens must be in"),
        ({"buffer_tokens": 20}, "buffer_tokens must be in"),
        ({"penalty_factor": -1.0}, "penalty_factor must be non-negative"),
    ],
)
def test_bad_settings_raise_one_clear_error(kwargs, message):
    settings = {"max_response_tokens": 20, "buffer_tokens": 4} | kwargs
    with pytest.raises(ValueError, match=message):
        overlong_penalty(LENGTHS, **settings)


def test_negative_lengths_are_rejected():
    with pytest.raises(ValueError, match="non-negative"):
        overlong_penalty(torch.tensor([3, -1]), 20, 4)
