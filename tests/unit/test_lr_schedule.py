"""Learning-rate multiplier: warm-up, the three decays, endpoints and monotonicity."""

import pytest

from sluice.engines.rl.schedules import LR_DECAYS, lr_multiplier

# W = 4 warm-up steps, decay to m = 0.1 at T = 12.
SCHEDULE = {"warmup_steps": 4, "total_steps": 12, "min_ratio": 0.1}


@pytest.mark.parametrize("decay", LR_DECAYS)
def test_warmup_rises_linearly_and_the_first_step_is_not_zero(decay):
    # (s + 1) / W for s = 0..3
    got = [lr_multiplier(s, decay=decay, **SCHEDULE) for s in range(4)]
    assert got == pytest.approx([0.25, 0.5, 0.75, 1.0])


@pytest.mark.parametrize(
    ("decay", "expected"),
    [
        # steps 4, 6, 8, 12, 20
        ("constant", [1.0, 1.0, 1.0, 1.0, 1.0]),
        # p = (s - 4) / 8 = 0, 0.25, 0.5, 1, -: 1 - 0.9 p = 1, 0.775, 0.55, 0.1, then m
        ("linear", [1.0, 0.775, 0.55, 0.1, 0.1]),
        # 0.1 + 0.45 (1 + cos pi p): 1, 0.1 + 0.45 * 1.70710678 = 0.86819805, 0.55, 0.1, m
        ("cosine", [1.0, 0.86819805, 0.55, 0.1, 0.1]),
    ],
)
def test_decay_values_by_hand(decay, expected):
    got = [lr_multiplier(s, decay=decay, **SCHEDULE) for s in (4, 6, 8, 12, 20)]
    assert got == pytest.approx(expected)


@pytest.mark.parametrize("decay", LR_DECAYS)
def test_schedule_rises_then_falls_and_stays_in_range(decay):
    values = [lr_multiplier(s, decay=decay, **SCHEDULE) for s in range(30)]
    warmup, rest = values[:4], values[4:]
    assert all(a < b for a, b in zip(warmup, warmup[1:], strict=False))
    assert all(a >= b for a, b in zip(rest, rest[1:], strict=False))
    assert all(0.1 <= v <= 1.0 for v in rest)


def test_no_warmup_starts_at_the_base_rate():
    assert lr_multiplier(0, warmup_steps=0, total_steps=10, decay="cosine", min_ratio=0.0) == 1.0


def test_decay_to_zero_reaches_zero_at_total_steps():
    kwargs = {"warmup_steps": 0, "total_steps": 10, "min_ratio": 0.0}
    assert lr_multiplier(10, decay="linear", **kwargs) == 0.0
    assert lr_multiplier(10, decay="cosine", **kwargs) == pytest.approx(0.0)
    # the last step of a 10-step run is just above 0: linear 1 - 9/10
    assert lr_multiplier(9, decay="linear", **kwargs) == pytest.approx(0.1)


def test_warmup_over_the_whole_run():
    kwargs = {"warmup_steps": 5, "total_steps": 5, "decay": "linear", "min_ratio": 0.2}
    assert lr_multiplier(4, **kwargs) == 1.0
    assert lr_multiplier(5, **kwargs) == 0.2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"decay": "step"}, "unknown learning-rate decay 'step'"),
        ({"step": -1}, "must be >= 0"),
        ({"total_steps": 0, "warmup_steps": 0}, "total_steps must be positive"),
        ({"warmup_steps": 13}, "warmup_steps must be in"),
        ({"warmup_steps": -1}, "warmup_steps must be in"),
        ({"min_ratio": 1.5}, r"min_ratio must be in \[0, 1\]"),
    ],
)
def test_bad_arguments_raise_one_clear_error(kwargs, message):
    arguments = {"step": 0, "decay": "cosine"} | SCHEDULE | kwargs
    step = arguments.pop("step")
    with pytest.raises(ValueError, match=message):
        lr_multiplier(step, **arguments)
