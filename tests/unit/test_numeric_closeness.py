"""Partial credit for wrong numeric answers (`reward.numeric_closeness`): the closeness
by hand, the reasoning_gym verifier with and without it (in process and through the
reward role's worker pool), and the bad values refused in one line each."""

from __future__ import annotations

import math

import pytest

from sluice.engines.env.answers import numeric_closeness
from sluice.engines.env.problems.reasoning_gym import ReasoningGymProblem
from sluice.engines.env.verifiers import VerifierSpecError, load_verifier, outcome_of
from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import load_config
from sluice.tasks.reward.role import VerifierPool

TWO_TERMS = {"settings": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}}


@pytest.mark.parametrize(
    "answer, gold, expected",
    [
        ("-4", "-4", 1.0),
        ("-5", "-4", 0.75),  # 1 - 1/4
        ("121", "111", 1 - 10 / 111),  # ≈ 0.90991
        ("0.5", "0", 0.5),  # |gold| < 1 counts as 1: 1 - 0.5/1
        ("2", "0", 0.0),  # 1 - 2/1 = -1, floored at 0
        ("-5", "5", 0.0),  # a sign error: 1 - 10/5 = -1, floored
        ("1,000", "999", 0.0),  # not a number to float(): no credit
        ("nan", "3", 0.0),
        ("inf", "3", 0.0),
        ("", "3", 0.0),
    ],
)
def test_closeness_by_hand(answer, gold, expected):
    assert numeric_closeness(answer, gold) == pytest.approx(expected, abs=1e-12)


@pytest.fixture(scope="module")
def row() -> dict:
    problem = ReasoningGymProblem({"chain_sum": TWO_TERMS}, extraction="last_number")
    found = next(r for r in problem.sample_prompts(40, 0) if abs(int(r["answer"])) >= 20)
    return found


def test_a_wrong_answer_scores_its_closeness_times_kappa(row):
    gold = int(row["answer"])
    exact, credit = (
        load_verifier("reasoning_gym"),
        load_verifier("reasoning_gym", numeric_closeness=0.5),
    )
    off_by_two = f"The sum is {gold + 2}."
    # κ = 0.5, c = 1 - 2/|gold|: e.g. gold 40 -> 0.5 * 0.95 = 0.475.
    assert credit(row, off_by_two) == pytest.approx(0.5 * (1 - 2 / abs(gold)))
    assert exact(row, off_by_two) == 0.0
    # Right answers score the full reward either way; far-off and unparsed ones nothing.
    assert credit(row, f"= {gold}") == exact(row, f"= {gold}") == 1.0
    assert credit(row, f"= {gold + 3 * abs(gold)}") == 0.0
    unparsed = credit(row, "no idea")
    assert unparsed == 0.0 and outcome_of(unparsed) == "unparsed"


def test_the_credit_is_scaled_between_the_incorrect_and_correct_rewards(row):
    gold = int(row["answer"])
    verify = load_verifier(
        "reasoning_gym", correct_reward=5.0, incorrect_reward=-5.0, numeric_closeness=0.2
    )
    # -5 + 10 * 0.2 * (1 - 1/|gold|)
    assert verify(row, str(gold - 1)) == pytest.approx(-5 + 2 * (1 - 1 / abs(gold)))
    assert verify(row, str(gold)) == 5.0


def test_the_reward_pool_workers_get_the_credit(row):
    gold = int(row["answer"])
    pool = VerifierPool("reasoning_gym", 1, 20.0, 1.0, 0.0, closeness=0.5)
    try:
        scores = pool.score([row, row, row], [str(gold), str(gold + 1), "none"])
    finally:
        pool.close()
    assert scores[0] == 1.0 and scores[2] == 0.0
    assert math.isclose(scores[1], 0.5 * (1 - 1 / abs(gold)))


def test_bad_kappas_and_other_verifiers_are_refused():
    with pytest.raises(VerifierSpecError, match=r"must be in \[0, 1\)"):
        load_verifier("reasoning_gym", numeric_closeness=1.0)
    with pytest.raises(VerifierSpecError, match="verifier 'builtin' scores without it"):
        load_verifier("builtin", numeric_closeness=0.3)
    with pytest.raises(ConfigError, match="numeric_closeness"):
        load_config("reasoning_gym", ["reward.numeric_closeness=1.5"])
    with pytest.raises(
        ConfigError, match="partial credit of reward.verifier=reasoning_gym, not builtin"
    ):
        load_config("default", ["reward.numeric_closeness=0.3"])
    assert (
        load_config("reasoning_gym", ["reward.numeric_closeness=0.3"]).reward.numeric_closeness
        == 0.3
    )
