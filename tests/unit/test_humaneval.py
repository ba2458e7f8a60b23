"""The humaneval problem kind: HumanEval's problems split by a hash of their task id,
prompts of instruction and signature, completions read raw or from a fenced block and
scored by the problem's unit tests in the process sandbox; wrong, looping, raising and
non-Python answers score 0, and the ones that are not a wrong answer are counted."""

from __future__ import annotations

import time

import numpy as np
import pytest

from sluice.engines.env.problems.humaneval import (
    DEFAULT_INSTRUCTIONS,
    ROW_KEY,
    HumanEvalProblem,
    held_out_ids,
    load_problems,
    program_of,
    truncate_raw,
)
from sluice.engines.env.problems.registry import get_problem
from sluice.engines.env.verifiers import load_verifier, outcome_of
from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.problem import problem_options
from sluice.infra.config.run import load_config

# A mix: the first problem, one whose tests import modules and test with a seeded
# random generator (32), one whose prompt defines a helper before the function (38),
# one-liners (53, 55), string and list work (80, 129), and the last problem.
SAMPLE = ["HumanEval/0", "HumanEval/32", "HumanEval/38", "HumanEval/53", "HumanEval/55"]
SAMPLE += ["HumanEval/80", "HumanEval/129", "HumanEval/163"]


def by_id() -> dict[str, dict[str, str]]:
    return {p["task_id"]: p for p in load_problems()}


def row_of(task_id: str, extraction: str = "raw") -> dict:
    return HumanEvalProblem(extraction=extraction).make_row(by_id()[task_id])


@pytest.fixture(scope="module")
def verify():
    return load_verifier("code", timeout_s=5.0)


# ------------------------------------------------------------------ data and split


def test_the_data_file_holds_164_problems_with_tests():
    problems = load_problems()
    assert len(problems) == 164
    assert [p["task_id"] for p in problems[:2]] == ["HumanEval/0", "HumanEval/1"]
    for p in problems:
        assert {"prompt", "canonical_solution", "test", "entry_point"} <= set(p)
        assert "def check(candidate)" in p["test"]


def test_the_split_is_deterministic_disjoint_and_of_the_asked_size():
    problem = HumanEvalProblem()
    train = {p["task_id"] for p in problem.splits["train"]}
    test = {p["task_id"] for p in problem.splits["test"]}
    assert train.isdisjoint(test)
    assert len(train | test) == 164
    assert len(test) == round(0.2 * 164) == 33
    again = HumanEvalProblem(extraction="fenced")  # how prompts read does not move the split
    assert {p["task_id"] for p in again.splits["test"]} == test
    other_seed = HumanEvalProblem(split_seed=1)
    assert {p["task_id"] for p in other_seed.splits["test"]} != test
    assert len(HumanEvalProblem(test_fraction=0.5).splits["test"]) == 82
    # Order-free: the held-out set is a function of the ids, not of their order.
    ids = [p["task_id"] for p in load_problems()]
    assert held_out_ids(ids[::-1], 0.2) == test
    assert len(held_out_ids(ids, 0.001)) == 1  # never an empty held-out split


def test_rows_come_in_shuffled_passes_over_their_split():
    problem = HumanEvalProblem()
    test = problem.sample_prompts(66, 0, "test")
    ids = [r["prompt_id"] for r in test]
    assert len(set(ids[:33])) == 33 and set(ids[:33]) == set(ids[33:])  # each once a pass
    assert ids[:33] != ids[33:]  # a new order each pass
    assert problem.sample_prompts(66, 0, "test") == test  # seeded
    train = {r["prompt_id"] for r in problem.sample_prompts(300, 5, "train")}
    assert len(train) == 131 and train.isdisjoint(ids)
    # What tasks/prompts.py draws for group n: the same problem for the same n.
    group = [problem.sample_prompts(1, np.random.default_rng([3, n]))[0] for n in range(5)]
    again = [problem.sample_prompts(1, np.random.default_rng([3, n]))[0] for n in range(5)]
    assert group == again
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        problem.sample_prompts(1, 0, "valid")  # type: ignore[arg-type]


def test_the_row_asks_for_the_body_and_carries_the_test_program():
    row = row_of("HumanEval/53")
    source = by_id()["HumanEval/53"]
    assert row["prompt"] == f"{DEFAULT_INSTRUCTIONS['raw']}\n\n{source['prompt']}"
    assert row["answer"] == f"{source['test']}\n\ncheck(add)\n"
    assert (row["prompt_id"], row["task"]) == ("HumanEval/53", "humaneval")
    spec = row[ROW_KEY]
    assert (spec["prompt"], spec["entry_point"], spec["extraction"]) == (
        source["prompt"],
        "add",
        "raw",
    )
    bare = HumanEvalProblem(instruction="").make_row(source)
    assert bare["prompt"] == source["prompt"]
    assert "```python" in HumanEvalProblem(extraction="fenced").make_row(source)["prompt"]


# ------------------------------------------------------------------ scoring


@pytest.mark.parametrize("extraction", ["raw", "fenced"])
def test_canonical_solutions_score_one_in_the_process_sandbox(verify, extraction):
    problem = HumanEvalProblem(extraction=extraction)
    for task_id in SAMPLE:
        row = problem.make_row(by_id()[task_id])
        reference = problem.reference_response(row)
        score = verify(row, reference)
        assert score == 1.0 and outcome_of(score) is None, task_id
        assert problem.check_answer(row, reference)


def test_a_wrong_body_or_one_that_raises_scores_zero_as_a_wrong_answer(verify):
    row = row_of("HumanEval/53")
    for body in ("    return x - y\n", "    raise RuntimeError('no')\n", "", "    import os\n"):
        score = verify(row, body)
        assert score == 0.0 and outcome_of(score) is None, body
    assert not HumanEvalProblem().check_answer(row, "    return x - y\n")


def test_an_infinite_loop_scores_zero_at_the_deadline_and_is_counted():
    verify = load_verifier("code", timeout_s=1.0)
    started = time.monotonic()
    score = verify(row_of("HumanEval/53"), "    while True:\n        pass\n")
    assert score == 0.0 and outcome_of(score) == "timeout"
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("extraction", "response"),
    [
        ("raw", "    return (x +\n"),  # not Python
        ("raw", "    return x\x00 + y\n"),  # a null byte
        ("raw", None),  # not text at all
        ("raw", "    " + "(" * 500 + "\n"),  # nested past the parser's limit
        ("fenced", "    return x + y\n"),  # no fenced block
        ("fenced", "```python\ndef add(x, y):\n    return x +\n```"),  # a block, not Python
    ],
)
def test_a_response_that_is_not_python_scores_zero_as_unparsed(verify, extraction, response):
    score = verify(row_of("HumanEval/53", extraction), response)
    assert score == 0.0 and outcome_of(score) == "unparsed"


def test_the_reward_scale_applies(verify):
    scaled = load_verifier("code", correct_reward=5.0, incorrect_reward=-5.0, timeout_s=5.0)
    row = row_of("HumanEval/53")
    assert scaled(row, "    return x + y\n") == 5.0
    assert scaled(row, "    return x - y\n") == -5.0
    assert scaled(row, "    return (\n") == -5.0


# ------------------------------------------------------------------ extraction


def test_a_raw_completion_stops_at_a_new_top_level_statement(verify):
    body = "    return x + y\n"
    assert truncate_raw(body + "\n\nprint(add(1, 2))\n") == body + "\n"
    assert truncate_raw(body) == body
    # The __main__ block would wait on input() and fail a right answer; it never runs.
    tail = "\nif __name__ == '__main__':\n    input()\n"
    assert verify(row_of("HumanEval/53"), body + tail) == 1.0
    assert verify(row_of("HumanEval/53"), body + "\ndef helper():\n    return (\n") == 1.0


def test_a_fenced_answer_may_be_the_whole_function_or_its_body(verify):
    row = row_of("HumanEval/53", "fenced")
    whole = "Sure:\n```python\ndef add(x: int, y: int):\n    return x + y\n```\nDone."
    assert verify(row, whole) == 1.0
    assert verify(row, "```python\n    return x + y\n```") == 1.0  # the body alone
    assert verify(row, "```py\ndef add(x, y):\n    return x + y\n```") == 1.0
    # The first block counts, not a later one.
    assert verify(row, whole + "\n```python\ndef add(x, y):\n    return 0\n```") == 1.0
    assert verify(row, "```python\ndef add(x, y):\n    return 0\n```\n" + whole) == 0.0
    # A __main__ block in the answer is dropped: it would run before the tests.
    guarded = "```python\ndef add(x, y):\n    return x + y\n\nif __name__ == '__main__':\n"
    assert verify(row, guarded + "    input()\n```") == 1.0


def test_the_prompts_imports_and_helpers_stay_in_front_of_a_fenced_function(verify):
    # HumanEval/38's prompt defines encode_cyclic, which the solution calls.
    row = row_of("HumanEval/38", "fenced")
    answer = (
        "```python\ndef decode_cyclic(s: str):\n    return encode_cyclic(encode_cyclic(s))\n```"
    )
    assert verify(row, answer) == 1.0
    program = program_of(row[ROW_KEY]["prompt"], answer, "fenced")
    assert program is not None and program.index("def encode_cyclic") < program.index(
        "return encode_cyclic(encode_cyclic"
    )


# ------------------------------------------------------------------ config


H = ["problem.name=humaneval", "reward.verifier=code"]


def test_the_config_builds_humaneval_prompts():
    from sluice.tasks.prompts import PromptSource

    config = load_config(
        None, [*H, "problem.humaneval.extraction=fenced", "problem.humaneval.test_fraction=0.25"]
    )
    problem = get_problem(config.problem.name, **problem_options(config.problem))
    assert isinstance(problem, HumanEvalProblem)
    assert (problem.extraction, len(problem.splits["test"])) == ("fenced", 41)
    source = PromptSource(config)
    row = source.train_row(0)
    assert row == source.train_row(0) and row[ROW_KEY]["extraction"] == "fenced"
    assert row["prompt"].startswith(DEFAULT_INSTRUCTIONS["fenced"])
    held_out = {r["prompt_id"] for r in source.eval_rows()}
    assert held_out == {p["task_id"] for p in problem.splits["test"]}  # 64 prompts cover 41
    assert row["prompt_id"] not in held_out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [*H, "problem.humaneval.extractoin=raw"],
            "unknown config key 'problem.humaneval.extractoin'; "
            "did you mean 'problem.humaneval.extraction'?",
        ),
        ([*H, "problem.humaneval.extraction=xml"], "Input should be 'raw' or 'fenced'"),
        ([*H, "problem.humaneval.test_fraction=1"], "test_fraction"),
        (["problem.name=humaneval"], "scored by reward.verifier=code (not builtin)"),
        ([*H[:1], "reward.verifier=math"], "scored by reward.verifier=code (not math)"),
    ],
)
def test_a_bad_humaneval_option_fails_the_config_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)
