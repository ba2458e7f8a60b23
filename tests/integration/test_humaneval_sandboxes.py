"""HumanEval scored in both code sandboxes: every canonical solution passes its tests in
the process sandbox, the reward role's pool counts unparsed answers, and in containers
(where a Docker engine answers) right, wrong, looping and non-Python answers score as
they do in the process sandbox."""

from __future__ import annotations

import time

import pytest

from sluice.engines.env.problems.humaneval import HumanEvalProblem, load_problems
from sluice.engines.env.verifiers import load_verifier, outcome_of

pytestmark = pytest.mark.integration


def rows_by_id(extraction: str = "raw") -> dict[str, dict]:
    problem = HumanEvalProblem(extraction=extraction)
    return {p["task_id"]: problem.make_row(p) for p in load_problems()}


@pytest.mark.slow  # 10 s on two quiet cores, over 20 s on busy ones
def test_every_canonical_solution_scores_one_in_the_process_sandbox() -> None:
    verify = load_verifier("code", timeout_s=10.0)
    problem = HumanEvalProblem()
    started = time.monotonic()
    failed = {}
    for task_id, row in rows_by_id().items():
        score = verify(row, problem.reference_response(row))
        if score != 1.0:
            failed[task_id] = outcome_of(score)
    took = time.monotonic() - started
    print(f"humaneval: 164 canonical solutions in the process sandbox in {took:.1f} s")
    assert failed == {}


def test_the_reward_pool_scores_humaneval_and_counts_unparsed_answers() -> None:
    from sluice.tasks.reward.role import VerifierPool

    row = rows_by_id()["HumanEval/53"]
    pool = VerifierPool("code", workers=1, timeout_s=20.0, correct=1.0, incorrect=0.0)
    try:
        texts = ["    return x + y\n", "    return x * y\n", "    return (\n"]
        assert pool.score([row, row, row], texts) == [1.0, 0.0, 0.0]
        assert (pool.unparsed, pool.errors, pool.timeouts) == (1, 0, 0)
    finally:
        pool.close()


# ------------------------------------------------------------------ containers


@pytest.mark.docker
def test_humaneval_scores_alike_in_containers(sandbox) -> None:
    verify = load_verifier("code", timeout_s=3.0, sandbox=sandbox)
    rows = rows_by_id()
    problem = HumanEvalProblem()
    for task_id in ("HumanEval/0", "HumanEval/32", "HumanEval/38", "HumanEval/163"):
        row = rows[task_id]
        assert verify(row, problem.reference_response(row)) == 1.0, task_id
    add = rows["HumanEval/53"]
    wrong = verify(add, "    return x - y\n")
    assert wrong == 0.0 and outcome_of(wrong) is None
    started = time.monotonic()
    loop = verify(add, "    while True:\n        pass\n")
    assert loop == 0.0 and outcome_of(loop) == "timeout"
    assert time.monotonic() - started < 3.0 + 10.0  # the deadline, plus a cold container
    unparsed = verify(add, "    return (\n")  # never reaches a container
    assert unparsed == 0.0 and outcome_of(unparsed) == "unparsed"
    fenced = rows_by_id("fenced")["HumanEval/53"]
    assert verify(fenced, "```python\ndef add(x, y):\n    return x + y\n```") == 1.0


@pytest.mark.docker
def test_a_humaneval_run_takes_containers_where_an_engine_answers(sandbox) -> None:
    from sluice.infra.config.run import load_config
    from sluice.infra.docker_sandbox import DockerSandbox
    from sluice.tasks.sandbox import code_sandbox

    config = load_config(
        None, ["problem.name=humaneval", "reward.verifier=code", "reward.sandbox_pool=1"]
    )
    chosen = code_sandbox(config)
    assert isinstance(chosen, DockerSandbox)
    try:
        verify = load_verifier("code", timeout_s=5.0, sandbox=chosen)
        assert verify(rows_by_id()["HumanEval/53"], "    return x + y\n") == 1.0
    finally:
        chosen.close()
