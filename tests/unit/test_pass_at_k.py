"""pass@k: Chen et al.'s unbiased estimator 1 - C(n - c, k) / C(n, k), worked by hand, and
the held-out metrics that average it over prompts."""

from __future__ import annotations

import itertools
import math

import pytest

from sluice.engines.rl.evaluation import heldout_metrics, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        # C(3, 2) / C(5, 2) = 3 / 10 of the pairs hold no correct sample: 1 - 0.3.
        (5, 2, 2, 0.7),
        # k = 1 is the fraction correct: 1 - C(3, 1) / C(4, 1) = 1 - 3/4.
        (4, 1, 1, 0.25),
        # C(7, 5) / C(10, 5) = 21 / 252 = 1/12.
        (10, 3, 5, 11 / 12),
        # No correct sample: never passes; all correct: always passes.
        (5, 0, 3, 0.0),
        (5, 5, 3, 1.0),
        # n - c = 1 < k = 2: every pair holds a correct sample.
        (3, 2, 2, 1.0),
        # k = n: passes when any sample is correct.
        (4, 1, 4, 1.0),
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_is_the_share_of_k_subsets_that_hold_a_correct_sample():
    # The definition, by enumeration, against the product form the function computes.
    for n, c in [(6, 1), (6, 2), (7, 3), (8, 0)]:
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            share = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(share)
            assert share == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


@pytest.mark.parametrize(("n", "c", "k"), [(3, 4, 1), (3, 1, 4), (3, 1, 0), (3, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_heldout_metrics_average_pass_at_k_over_prompts():
    # Two prompts x 4 samples (then a greedy response each): 1 and 3 correct.
    rows = [{"prompt_id": "a"}, {"prompt_id": "b"}]
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0] + [1.0, 1.0, 0.0, 1.0, 0.0]
    lengths = [3] * 10
    metrics = heldout_metrics(
        rows, rewards, lengths, 4, with_greedy=True, correct_reward=1.0, pass_at=[1, 2, 4]
    )
    # pass@1: (1/4 + 3/4) / 2 = 0.5, the plain share of correct samples.
    assert metrics["eval/pass_at_1"] == 0.5
    # pass@2: prompt a: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5; prompt b: n - c = 1 < 2, so 1.
    assert metrics["eval/pass_at_2"] == pytest.approx((0.5 + 1.0) / 2)
    # pass@4: both prompts have a correct sample among their 4.
    assert metrics["eval/pass_at_4"] == 1.0
    assert metrics["eval/greedy_accuracy"] == 0.5  # the greedy responses are left out above
    assert "eval/pass_at_2" not in heldout_metrics(rows, rewards, lengths, 4, True, 1.0)


def test_pass_at_k_is_also_split_by_problem_size():
    # Three prompts x 2 samples, no greedy pass: a 2-term prompt with 1 of 2 correct, and
    # two 3- and 4-term prompts with 0 and 2 correct.
    rows = [{"num_terms": 2}, {"num_terms": 3}, {"num_terms": 4}]
    rewards = [1.0, 0.0] + [0.0, 0.0] + [1.0, 1.0]
    metrics = heldout_metrics(rows, rewards, [2] * 6, 2, False, 1.0, pass_at=[1, 2])
    # pass@2 per prompt: 1 (one of two correct, k = n), 0, 1.
    assert metrics["eval/pass_at_2"] == pytest.approx(2 / 3)
    assert metrics["eval/pass_at_2_terms_2"] == 1.0
    assert metrics["eval/pass_at_2_terms_3-4"] == 0.5  # (0 + 1) / 2
    # The reward split stays the mean over every sample of the bucket's prompts.
    assert metrics["eval/reward_terms_2"] == 0.5
    assert metrics["eval/reward_terms_3-4"] == 0.5  # (0 + 0 + 1 + 1) / 4
    # Rows without a size: no split at all.
    plain = heldout_metrics([{}, {}, {}], rewards, [2] * 6, 2, False, 1.0, pass_at=[1, 2])
    assert not [key for key in plain if "_terms_" in key]


def test_sluice_eval_prints_each_pass_at_k():
    from sluice.flows.cli import format_eval_result

    result = {
        "run_id": "r",
        "policy_version": 3,
        "model_version": "4",
        "registered_model": "m",
        "eval/reward": 0.5,
        "eval/pass_at_1": 0.5,
        "eval/pass_at_5": 0.75,
        "eval/prompts": 33.0,
        "samples_per_prompt": 10,
        "eval/response_length_mean": 12.0,
        "eval/time_s": 1.0,
        "mlflow_run_id": "x",
    }
    lines = format_eval_result(result).splitlines()
    assert [line.split()[:2] for line in lines if line.startswith("pass@")] == [
        ["pass@1", "0.5000"],
        ["pass@5", "0.7500"],
    ]
