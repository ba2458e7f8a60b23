"""Built-in problems by name: what ``problem.name`` in a run config selects."""

from __future__ import annotations

from typing import Any

from engines.problems.longtail import LongTailSum

BUILTIN_PROBLEMS: dict[str, type[LongTailSum]] = {"longtail_sum": LongTailSum}


def get_problem(name: str, **options: Any) -> LongTailSum:
    """A built-in problem by name (options go to its constructor)."""
    if name not in BUILTIN_PROBLEMS:
        raise ValueError(
            f"unknown built-in problem '{name}' (available: {', '.join(sorted(BUILTIN_PROBLEMS))})"
        )
    return BUILTIN_PROBLEMS[name](**options)
