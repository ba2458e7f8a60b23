"""The built-in multi-turn task and its warm-start encoding: a calculator call wins, the
observation is context and never a target, and the tool's output alone is no answer."""

from __future__ import annotations

import pytest

from sluice.engines.env.problems.base import split_of
from sluice.engines.env.problems.registry import get_problem
from sluice.engines.env.problems.tool_arith import ToolArith
from sluice.engines.env.tools import calculator
from sluice.engines.policy.model import build_tiny_policy
from sluice.engines.policy.warmstart import IGNORE_INDEX, encode_reference, encode_segments
from sluice.tasks.prompts import load_policy_tokenizer


def test_rows_are_products_with_an_addend_and_the_calculator_answers_them() -> None:
    problem = get_problem("tool_arith")
    rows = problem.sample_prompts(50, seed=0)
    assert rows == problem.sample_prompts(50, seed=0)  # seeded
    for row in rows:
        assert row["prompt"] == f"{row['expression']}:"
        assert calculator(row["expression"]) == row["answer"]
        assert split_of(row["prompt"], problem.test_fraction) == "train"
    held_out = {r["prompt"] for r in problem.sample_prompts(50, seed=0, split="test")}
    assert not held_out & {r["prompt"] for r in rows}


def test_only_the_policys_own_answer_counts_not_the_tools_output() -> None:
    problem = ToolArith()
    row = problem.make_row(37, 48, 19, shape=0)
    assert row["answer"] == "1795"
    assert problem.check_answer(row, "[37*48+19]> 1795\n=1795")
    assert problem.check_answer(row, "=1795")  # blurted, and right
    assert not problem.check_answer(row, "[37*48+19]> 1795\n")  # stopped after the tool
    assert not problem.check_answer(row, "[37*48+19]> 1795\n=1759")
    assert problem.make_row(37, 48, 19, shape=1)["answer"] == str(37 * 48 - 19)


def test_the_warm_start_teaches_calls_and_answers_but_never_the_observation(tmp_path) -> None:
    problem = ToolArith(direct_answer_fraction=0.5)
    rows = problem.sample_warmstart_prompts(200, seed=1)
    styles = [row["solution_style"] for row in rows]
    assert 70 < styles.count("direct") < 130
    tokenizer = load_policy_tokenizer(
        build_tiny_policy(tmp_path / "p", hidden_size=16, num_layers=1, num_heads=2)
    )
    row = next(r for r in rows if r["solution_style"] == "tool")
    ids, labels = encode_reference(tokenizer, problem, row)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text == f"{row['prompt']}[{row['expression']}]> {row['answer']}\n={row['answer']}"
    taught = tokenizer.decode([t for t in labels if t != IGNORE_INDEX], skip_special_tokens=True)
    assert taught == f"[{row['expression']}]={row['answer']}"
    assert labels[-1] == tokenizer.eos_token_id
    direct = next(r for r in rows if r["solution_style"] == "direct")
    _, labels = encode_reference(tokenizer, problem, direct)
    taught = tokenizer.decode([t for t in labels if t != IGNORE_INDEX], skip_special_tokens=True)
    assert taught == f"={direct['answer']}"


def test_segments_need_an_eos_token(tmp_path) -> None:
    class NoEos:
        eos_token_id = None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [1] * len(text)}

    with pytest.raises(ValueError, match="eos"):
        encode_segments(NoEos(), "p", [("a", True)])
