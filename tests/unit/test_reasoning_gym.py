"""The reasoning_gym problem kind: a seeded, disjoint split; one prompt per group index;
the mix follows its weights; answers are extracted as configured and scored by the
task itself, in the reward pool, under its deadline; bad tasks fail in one line."""

from __future__ import annotations

import math
import re
import time

import numpy as np
import pytest

from sluice.engines.env.answers import answer_in_boxed, answer_in_tags, extract_answer, last_number
from sluice.engines.env.problems.base import split_of
from sluice.engines.env.problems.reasoning_gym import ROW_KEY, ReasoningGymProblem
from sluice.engines.env.problems.registry import get_problem
from sluice.engines.env.verifiers import load_verifier, outcome_of
from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.problem import problem_options
from sluice.infra.config.run import load_config

# A small question space (two 1-digit terms: 100 sums, 100 differences), so a split
# that were not disjoint by construction would share questions within a few hundred draws.
TINY_SUMS = {"settings": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}


def tiny_problem(**options) -> ReasoningGymProblem:
    options.setdefault("test_fraction", 0.3)
    return ReasoningGymProblem({"chain_sum": TINY_SUMS}, **options)


def group_row(problem: ReasoningGymProblem, run_seed: int, index: int) -> dict:
    # What tasks/prompts.py PromptSource.train_row draws for group `index`.
    return problem.sample_prompts(1, np.random.default_rng([run_seed, index]), "train")[0]


# ------------------------------------------------------------------ problem


def test_train_and_held_out_splits_are_seeded_and_share_no_question():
    problem = tiny_problem()
    train = problem.sample_prompts(300, 0, "train")
    test = problem.sample_prompts(300, 0, "test")
    assert {r["question"] for r in train}.isdisjoint({r["question"] for r in test})
    assert all(split_of(r["question"], 0.3) == "train" for r in train)
    assert all(split_of(r["question"], 0.3) == "test" for r in test)
    assert problem.sample_prompts(300, 0, "test") == test  # same seed, same rows
    assert problem.sample_prompts(300, 1, "test") != test


def test_the_same_group_index_asks_the_same_prompt():
    problem = ReasoningGymProblem({"chain_sum": {}, "leg_counting": {}})
    again = ReasoningGymProblem({"leg_counting": {}, "chain_sum": {}})  # key order is irrelevant
    assert group_row(problem, 3, 17) == group_row(again, 3, 17)
    prompts = {group_row(problem, 3, index)["prompt"] for index in range(20)}
    assert len(prompts) == 20


def test_the_row_carries_the_question_the_instruction_and_what_rebuilds_the_entry():
    problem = tiny_problem(instruction="Answer in tags.", extraction="boxed", format_reward=0.1)
    row = problem.sample_prompts(1, 0)[0]
    assert row["prompt"] == f"{row['question']}\n\nAnswer in tags."
    assert problem.format_prompt(row) == row["prompt"]
    assert row["task"] == "chain_sum"
    spec = row[ROW_KEY]
    assert (spec["dataset"], spec["seed"], spec["size"]) == ("chain_sum", 0, 100_000)
    assert spec["settings"] == TINY_SUMS["settings"]
    assert (spec["extraction"], spec["format_reward"]) == ("boxed", 0.1)
    assert problem.reference_response(row) == f"\\boxed{{{row['answer']}}}"
    assert problem.check_answer(row, problem.reference_response(row))


def test_a_task_with_a_term_count_gives_the_row_its_size_for_the_held_out_split():
    from sluice.engines.rl.evaluation import reward_by_size

    mix = {"settings": {"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 1}}
    rows = ReasoningGymProblem({"chain_sum": mix}).sample_prompts(40, 0)
    # The size is the number of terms in the question ("...problem: 1 + 5 - 3 =" has 3).
    assert all(r["num_terms"] == len(re.findall(r"\d+", r["question"])) for r in rows)
    assert {r["num_terms"] for r in rows} == {2, 3, 4}
    rewards = [1.0 if r["num_terms"] == 2 else 0.0 for r in rows]
    assert reward_by_size(rows, rewards, 1) == {
        "eval/reward_terms_2": 1.0,
        "eval/reward_terms_3-4": 0.0,
    }
    # leg_counting has no term count: its rows carry no size.
    legs = ReasoningGymProblem({"leg_counting": {}}).sample_prompts(3, 0)
    assert all("num_terms" not in r for r in legs)


def test_the_mix_follows_its_weights():
    problem = ReasoningGymProblem(
        {"chain_sum": {"weight": 3}, "leg_counting": {"weight": 1}}, dataset_size=1000
    )
    n = 2000
    rows = problem.sample_prompts(n, 0)
    share = sum(r["task"] == "chain_sum" for r in rows) / n
    # Binomial: p = 3/4, sd = sqrt(p (1 - p) / n) = sqrt(0.1875 / 2000) = 0.0097; the
    # bound is 5 sd (a seeded draw, so this never flakes; a wrong mix of 1/2 or 2/3 fails).
    assert abs(share - 0.75) < 5 * math.sqrt(0.75 * 0.25 / n)


def test_an_unknown_task_names_the_closest_ones():
    with pytest.raises(
        ValueError, match=r"unknown reasoning-gym task 'chain_summ'; closest: chain_sum"
    ):
        ReasoningGymProblem({"chain_summ": {}})
    with pytest.raises(ValueError, match=r"no setting 'min_term' \(did you mean 'min_terms'\?\)"):
        ReasoningGymProblem({"chain_sum": {"settings": {"min_term": 3}}})
    with pytest.raises(ValueError, match="rejects its settings .*max_terms must be >= min_terms"):
        ReasoningGymProblem({"chain_sum": {"settings": {"min_terms": 5, "max_terms": 2}}})
    with pytest.raises(ValueError, match="'word_ladder' rejects .*dataset_size 100000"):
        ReasoningGymProblem({"word_ladder": {}})  # fewer puzzles than entries asked for


RG = ["problem.name=reasoning_gym", "reward.verifier=reasoning_gym"]


@pytest.mark.parametrize(
    ("tasks", "message"),
    [
        ("{chain_summ: {}}", "unknown reasoning-gym task 'chain_summ'; closest: chain_sum"),
        ("{chain_sum: {settings: {max_digit: 2}}}", "did you mean 'max_digits'?"),
        ("{chain_sum: {settings: {min_digits: 0}}}", "min_digits must be positive"),
        ("{chain_sum: {wieght: 2}}", "unknown key 'wieght' of a task (did you mean 'weight'?)"),
        ("{chain_sum: {weight: 0}}", "problem.reasoning_gym.tasks.chain_sum.weight"),
    ],
)
def test_a_bad_task_fails_the_config_in_one_line(tasks, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*RG, f"problem.reasoning_gym.tasks={tasks}"])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_the_config_builds_the_problem_and_asks_for_the_right_verifier():
    config = load_config(None, [*RG, "problem.reasoning_gym.tasks={chain_sum: {weight: 2}}"])
    problem = get_problem(config.problem.name, **problem_options(config.problem))
    assert isinstance(problem, ReasoningGymProblem)
    assert [t.name for t in problem.tasks] == ["chain_sum"]
    with pytest.raises(ConfigError, match="needs problem.reasoning_gym.tasks"):
        load_config(None, RG)
    with pytest.raises(ConfigError, match="scored by reward.verifier=reasoning_gym"):
        load_config(
            None, ["problem.name=reasoning_gym", "problem.reasoning_gym.tasks={chain_sum: {}}"]
        )


# ------------------------------------------------------------------ extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so <answer> 42 </answer>", "42"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last one counts
        ("<answer>a\nb</answer>", "a\nb"),  # across lines
        ("<answer></answer>", None),  # empty
        ("<answer>42", None),  # never closed
        ("42", None),
    ],
)
def test_answer_tags(text, expected):
    assert answer_in_tags(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} or \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # last, nested braces
        ("\\boxed{}", None),
        ("\\boxed{12", None),  # never closed
        ("boxed 42", None),
    ],
)
def test_boxed(text, expected):
    assert answer_in_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 + 4 = 7", "7"),
        ("It is -12.", "-12"),  # a leading minus; the full stop is not a decimal point
        ("71-43=28, so 28", "28"),
        ("5-3", "3"),  # a binary minus is not the number's sign
        ("total 1,234.50 apples", "1234.50"),  # thousands separator dropped
        ("no digits here", None),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_an_unknown_extraction_is_refused():
    with pytest.raises(ValueError, match="unknown answer extraction 'xml'"):
        extract_answer("<answer>1</answer>", "xml")


# ------------------------------------------------------------------ verifier


@pytest.fixture(scope="module")
def row() -> dict:
    return tiny_problem().sample_prompts(1, 0)[0]


def test_the_verifier_scores_right_wrong_and_unparsed(row):
    verify = load_verifier("reasoning_gym")
    answer = row["answer"]
    right = verify(row, f"thinking... <answer>{answer}</answer>")
    assert right == 1.0 and outcome_of(right) is None
    wrong = verify(row, f"<answer>{int(answer) + 1}</answer>")
    assert wrong == 0.0 and outcome_of(wrong) is None
    unparsed = verify(row, f"the answer is {answer}")  # right, but not in the tags
    assert unparsed == 0.0 and outcome_of(unparsed) == "unparsed"


def test_the_format_reward_and_the_reward_scale(row):
    bonus_row = {**row, ROW_KEY: {**row[ROW_KEY], "format_reward": 0.1}}
    verify = load_verifier("reasoning_gym", correct_reward=5.0, incorrect_reward=-5.0)
    # -5 + s * (5 - (-5)) + 0.1: s = 1 gives 5.1, s = 0 gives -4.9; no answer: -5.
    assert verify(bonus_row, f"<answer>{row['answer']}</answer>") == pytest.approx(5.1)
    assert verify(bonus_row, "<answer>nope</answer>") == pytest.approx(-4.9)
    assert verify(bonus_row, row["answer"]) == -5.0


def test_a_task_that_gives_partial_credit_keeps_it():
    from sluice.engines.env.problems.reasoning_gym import dataset_for

    row = ReasoningGymProblem({"countdown": {}}).sample_prompts(1, 0)[0]
    spec = row[ROW_KEY]
    dataset = dataset_for(spec["dataset"], spec["seed"], spec["size"], spec["settings"])
    partial = dataset.score_answer(answer="1 + 1", entry=dataset[spec["index"]])
    assert 0 < partial < 1  # countdown credits a well-formed but wrong expression
    verify = load_verifier("reasoning_gym")
    assert verify(row, f"<answer>{row['answer']}</answer>") == 1.0
    assert verify(row, "<answer>1 + 1</answer>") == pytest.approx(partial)


def test_a_row_that_does_not_rebuild_its_entry_scores_incorrect_as_an_error(row):
    verify = load_verifier("reasoning_gym")
    changed = {**row, "answer": "not the entry's answer"}
    score = verify(changed, f"<answer>{row['answer']}</answer>")
    assert score == 0.0 and outcome_of(score) == "error"
    missing = verify({k: v for k, v in row.items() if k != ROW_KEY}, "<answer>1</answer>")
    assert missing == 0.0 and outcome_of(missing) == "error"


def test_the_verifier_stops_a_slow_task_at_its_deadline(row, monkeypatch):
    from sluice.engines.env.problems import reasoning_gym as module

    monkeypatch.setattr(module, "score_response", lambda row, text: time.sleep(5))
    verify = load_verifier("reasoning_gym", timeout_s=0.2)
    started = time.monotonic()
    score = verify(row, "<answer>1</answer>")
    assert score == 0.0 and outcome_of(score) == "timeout"
    assert time.monotonic() - started < 2


def test_the_reward_pool_scores_and_counts_in_spawned_workers(row):
    from sluice.tasks.reward.role import VerifierPool

    # A row whose entry takes minutes to generate (200 terms of 20 digits): the worker
    # is stuck inside reasoning-gym, and only the pool's deadline gets the batch back.
    stuck = {
        **row,
        ROW_KEY: {
            **row[ROW_KEY],
            "dataset": "basic_arithmetic",
            "settings": {"min_terms": 200, "max_terms": 200, "min_digits": 20, "max_digits": 20},
        },
    }
    pool = VerifierPool("reasoning_gym", workers=1, timeout_s=2.0, correct=1.0, incorrect=0.0)
    try:
        right, wrong = f"<answer>{row['answer']}</answer>", "<answer>-1</answer>"
        assert pool.score([row, row, row], [right, wrong, "no answer"]) == [1.0, 0.0, 0.0]
        assert (pool.unparsed, pool.errors, pool.timeouts) == (1, 0, 0)
        started = time.monotonic()
        assert pool.score([stuck], [right]) == [0.0]
        assert pool.timeouts == 1
        assert time.monotonic() - started < 4  # one call's deadline, not the minutes it needs
        # (tests/integration/test_verifier_pool.py shows the pool rebuilt after a stuck call)
    finally:
        pool.close()
