"""Forged verdicts score nothing in the process sandbox (issue 60, item 1): the tests run
in this process and the response's function in the sandboxed child, so each hack in
`verdict_hacks.HACKS` scores 0 on an assert-style row and on HumanEval's
``check(candidate)``, while honest code still scores 1."""

from __future__ import annotations

import time

import pytest

from sluice.engines.env.problems.humaneval import HumanEvalProblem, load_problems
from sluice.engines.env.verifiers import load_verifier, outcome_of
from tests.unit.verdict_hacks import ADD_TESTS, HACKS, HONEST, SLOW

TIMEOUT_S = 2.0


def rows() -> dict[str, dict]:
    problem = HumanEvalProblem(extraction="fenced")
    humaneval = {p["task_id"]: p for p in load_problems()}
    return {
        "asserts": {"prompt_id": "add", "tests": ADD_TESTS},
        "humaneval": problem.make_row(humaneval["HumanEval/53"]),
    }


@pytest.fixture(scope="module")
def verify():
    return load_verifier("code", timeout_s=TIMEOUT_S, memory_mb=256)


def fenced(code: str) -> str:
    return f"```python\n{code}```"


@pytest.mark.parametrize("row_kind", ["asserts", "humaneval"])
def test_honest_code_scores_one(verify, row_kind: str) -> None:
    assert verify(rows()[row_kind], fenced(HONEST)) == 1.0


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_a_forged_verdict_scores_zero(verify, hack: str) -> None:
    for kind, row in rows().items():
        started = time.monotonic()
        score = verify(row, fenced(HACKS[hack]))
        took = time.monotonic() - started
        assert score == 0.0, (hack, kind, outcome_of(score))
        assert took < TIMEOUT_S + 3.0, (hack, kind, took)  # bounded: refused, not a hang
        if hack in SLOW:
            assert outcome_of(score) == "timeout"


def test_a_redefined_helper_the_tests_trust_scores_zero(verify) -> None:
    # HumanEval/32's tests check find_zero with the prompt's own `poly`; a response that
    # redefines `poly` to return 0 would pass every root if the tests used its copy.
    problem = HumanEvalProblem(extraction="fenced")
    row = problem.make_row({p["task_id"]: p for p in load_problems()}["HumanEval/32"])
    hack = "def poly(xs, x):\n    return 0\n\ndef find_zero(xs):\n    return 0.0\n"
    assert verify(row, fenced(hack)) == 0.0
    assert verify(row, problem.reference_response(row)) == 1.0
