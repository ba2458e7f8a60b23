"""Built-in problems by name: what ``problem.name`` in a run config selects."""

from __future__ import annotations

from typing import Any

from sluice.engines.env.problems.base import Problem
from sluice.engines.env.problems.humaneval import HumanEvalProblem
from sluice.engines.env.problems.longtail import LongTailSum
from sluice.engines.env.problems.reasoning_gym import ReasoningGymProblem
from sluice.engines.env.problems.tool_arith import ToolArith

BUILTIN_PROBLEMS: dict[
    str,
    type[LongTailSum] | type[ToolArith] | type[ReasoningGymProblem] | type[HumanEvalProblem],
] = {
    "humaneval": HumanEvalProblem,
    "longtail_sum": LongTailSum,
    "reasoning_gym": ReasoningGymProblem,
    "tool_arith": ToolArith,
}


def get_problem(name: str, **options: Any) -> Problem:
    """A built-in problem by name (options go to its constructor)."""
    if name not in BUILTIN_PROBLEMS:
        raise ValueError(
            f"unknown built-in problem '{name}' (available: {', '.join(sorted(BUILTIN_PROBLEMS))})"
        )
    return BUILTIN_PROBLEMS[name](**options)
