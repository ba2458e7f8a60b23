"""Group-relative advantages against hand-worked values."""

import math

import pytest
import torch

from sluice.engines.rl.advantages import broadcast_to_tokens, compute_advantages, make_advantage_fn

EPS = 1e-6


def test_grpo_normalises_by_group_population_std():
    # group 0: [1, 0, 0, 1] mean 0.5, population std 0.5 -> +-0.5 / (0.5 + eps)
    # group 1: [3, 1, 2, 2] mean 2, population std sqrt(2/4) = 0.707107
    out = compute_advantages([1, 0, 0, 1, 3, 1, 2, 2], group_size=4, mode="grpo", eps=EPS)
    s0 = 0.5 / (0.5 + EPS)
    s1 = 1 / (math.sqrt(0.5) + EPS)
    expected = torch.tensor([s0, -s0, -s0, s0, s1, -s1, 0.0, 0.0])
    torch.testing.assert_close(out.advantages, expected)
    assert out.num_zero_variance_groups == 0


def test_all_equal_group_gets_exactly_zero_and_is_counted():
    out = compute_advantages([1.0, 1.0, 1.0, 0.0, 1.0, 0.0], group_size=3, mode="grpo")
    assert out.advantages[:3].tolist() == [0.0, 0.0, 0.0]
    assert out.num_zero_variance_groups == 1
    assert out.zero_variance_groups.tolist() == [True, False]
    assert out.keep_samples.all()
    dropped = compute_advantages(
        [1.0, 1.0, 1.0, 0.0, 1.0, 0.0], group_size=3, drop_zero_variance_groups=True
    )
    assert dropped.keep_samples.tolist() == [False, False, False, True, True, True]


def test_drgrpo_only_centres():
    # [3, 1, 2] - 2 = [1, -1, 0]
    out = compute_advantages([3.0, 1.0, 2.0], group_size=3, mode="drgrpo")
    torch.testing.assert_close(out.advantages, torch.tensor([1.0, -1.0, 0.0]))


def test_rloo_subtracts_mean_of_the_others():
    # 3 - (1 + 2)/2 = 1.5;  1 - (3 + 2)/2 = -1.5;  2 - (3 + 1)/2 = 0
    out = compute_advantages([3.0, 1.0, 2.0], group_size=3, mode="rloo")
    torch.testing.assert_close(out.advantages, torch.tensor([1.5, -1.5, 0.0]))
    # a group of one has no baseline
    assert compute_advantages([5.0], group_size=1, mode="rloo").advantages.tolist() == [0.0]


def test_batch_mode_centres_per_group_and_scales_by_batch_std():
    # centred: group [1, 0] -> [0.5, -0.5]; group [3, 1, 2] -> [1, -1, 0]
    # batch population std of the centred values: sqrt((0.25*2 + 1*2 + 0) / 5) = sqrt(0.5)
    out = compute_advantages(
        [1.0, 0.0, 3.0, 1.0, 2.0], group_ids=[0, 0, 1, 1, 1], mode="batch", eps=EPS
    )
    scale = 1 / (math.sqrt(0.5) + EPS)
    expected = torch.tensor([0.5, -0.5, 1.0, -1.0, 0.0]) * scale
    torch.testing.assert_close(out.advantages, expected)


def test_group_ids_may_be_interleaved_and_arbitrary():
    # group 7: rewards [1, 0] -> +-1 ; group 3: [0, 0] -> zero variance
    out = compute_advantages([1.0, 0.0, 0.0, 0.0], group_ids=[7, 3, 7, 3], mode="drgrpo")
    torch.testing.assert_close(out.advantages, torch.tensor([0.5, 0.0, -0.5, 0.0]))
    assert out.num_zero_variance_groups == 1


def test_broadcast_to_tokens_with_and_without_prompts():
    values = torch.tensor([1.5, -2.0])
    torch.testing.assert_close(
        broadcast_to_tokens(values, [2, 3]), torch.tensor([1.5, 1.5, -2.0, -2.0, -2.0])
    )
    torch.testing.assert_close(
        broadcast_to_tokens(values, [2, 3], prompt_lengths=[1, 2]),
        torch.tensor([0.0, 1.5, 1.5, 0.0, 0.0, -2.0, -2.0, -2.0]),
    )


def test_make_advantage_fn_binds_config():
    fn = make_advantage_fn(mode="rloo", eps=1e-6, drop_zero_variance_groups=False)
    torch.testing.assert_close(
        fn([3.0, 1.0, 2.0], group_size=3).advantages, torch.tensor([1.5, -1.5, 0.0])
    )
    with pytest.raises(ValueError, match="unknown advantage mode 'ppo'"):
        make_advantage_fn(mode="ppo")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"rewards": [1.0, float("nan")], "group_size": 2},
            r"finite \(unscored sample\?\); bad indices \[1\]",
        ),
        ({"rewards": [1.0, 0.0, 1.0], "group_size": 2}, "does not divide"),
        ({"rewards": [1.0, 0.0]}, "exactly one of group_ids or group_size"),
        ({"rewards": [1.0, 0.0], "group_ids": [0]}, "group_ids has shape"),
        ({"rewards": [], "group_size": 1}, "non-empty"),
    ],
)
def test_bad_inputs_raise_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        compute_advantages(**kwargs)
