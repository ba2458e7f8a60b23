"""The built-in multi-turn task, ``tool_arith``: arithmetic a calculator call wins.

::

    prompt:   37*48+19:
    episode:  [37*48+19]            the policy's call (a turn that ends on ']')
              > 1795                the calculator's output, appended (never trained)
              =1795                 the policy's final answer, then EOS

The final answer is the text after the last ``=``, as in `longtail_sum`; the
observation is written without ``=`` (``observation_template`` ``"> {output}\\n"``),
so the tool's output alone never counts as the policy's answer: the policy has to copy
it. A ~1M-parameter model cannot multiply two 2-digit numbers in its head, so an
answer blurted without the call is almost always wrong, and one copied from the
calculator is almost always right.

As in `longtail_sum`, the warm start teaches both habits: a `direct_answer_fraction`
share of its references are the bare answer (``=1795``), the rest the call, the
observation and the copied answer (`reference_segments`; the observation is context,
not a training target). The warm-started policy then calls the tool some of the time,
and RL has to find out that calling pays: held-out reward and the share of episodes
that call rise together. Prompts are split between training and held-out by a hash
of their text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sluice.engines.env.problems.base import (
    ANSWER_MARKER,
    PromptRow,
    SeedLike,
    Split,
    as_generator,
    check_count,
    check_split,
    draw_in_split,
    final_answer_is,
    stable_hash,
)

CALL_OPEN, CALL_CLOSE = "[", "]"
OBSERVATION_TEMPLATE = "> {output}\n"
SHAPES = ("{a}*{b}+{c}", "{a}*{b}-{c}", "{c}+{a}*{b}")


@dataclass(frozen=True)
class ToolArith:
    """Two-digit products with an addend (see the module docstring)."""

    low: int = 10
    """Smallest factor."""
    high: int = 99
    """Largest factor and addend."""
    test_fraction: float = 0.1
    """Share of the prompt space (by text hash) held out."""
    direct_answer_fraction: float = 0.3
    """Share of warm-start references that blurt the answer instead of calling the tool.
    At 0.5 the warm start learned to copy the tool's output within 2,500 steps for two
    seeds of four (0 and 1, not 2 and 3): half the corpus then teaches the answer digits
    from the prompt, which the model cannot compute, and the copy after an observation
    has to win against it. At 0.3 it learned for seeds 2, 3 and 4 within 1,500 steps."""
    name: str = field(default="tool_arith")

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"tool_arith: need 1 <= low ({self.low}) <= high ({self.high})")
        if not 0 <= self.direct_answer_fraction <= 1:
            raise ValueError("tool_arith: direct_answer_fraction must be in [0, 1]")
        if not 0 < self.test_fraction < 1:
            raise ValueError("tool_arith: test_fraction must be in (0, 1)")

    def make_row(self, a: int, b: int, c: int, shape: int) -> PromptRow:
        expression = SHAPES[shape].format(a=a, b=b, c=c)
        value = a * b - c if "-" in expression else a * b + c
        prompt = f"{expression}:"
        return {
            "prompt_id": f"{self.name}-{stable_hash(prompt):016x}",
            "prompt": prompt,
            "answer": str(value),
            "task": self.name,
            "expression": expression,
            "solution_style": "tool",
        }

    def _sample(self, n: int, rng: np.random.Generator, split: Split) -> list[PromptRow]:
        rows = []

        def draw() -> PromptRow:
            a, b, c = (int(x) for x in rng.integers(self.low, self.high + 1, size=3))
            return self.make_row(a, b, c, int(rng.integers(len(SHAPES))))

        for _ in range(n):
            refusal = f"tool_arith: no {split} prompt found; widen low..high"
            rows.append(draw_in_split(draw, "prompt", split, self.test_fraction, refusal))
        return rows

    def sample_prompts(self, n: int, seed: SeedLike, split: Split = "train") -> list[PromptRow]:
        check_count(n)
        check_split(split)
        return self._sample(n, as_generator(seed), split)

    def sample_warmstart_prompts(self, n: int, seed: SeedLike) -> list[PromptRow]:
        """Training rows, a `direct_answer_fraction` share of them with the bare answer
        as their reference (``solution_style`` "direct") and the rest the tool call."""
        check_count(n)
        rng = as_generator(seed)
        rows = self._sample(n, rng, "train")
        for row in rows:
            if rng.random() < self.direct_answer_fraction:
                row["solution_style"] = "direct"
        return rows

    def format_prompt(self, row: PromptRow) -> str:
        return str(row["prompt"])

    def reference_segments(self, row: PromptRow) -> list[tuple[str, bool]]:
        """The reference episode as `(text, trained)` pieces: the tool's observation is
        context the policy reads, never a target it is taught to write."""
        answer = f"{ANSWER_MARKER}{row['answer']}"
        if row.get("solution_style") == "direct":
            return [(answer, True)]
        return [
            (f"{CALL_OPEN}{row['expression']}{CALL_CLOSE}", True),
            (OBSERVATION_TEMPLATE.format(output=row["answer"]), False),
            (answer, True),
        ]

    def reference_response(self, row: PromptRow) -> str | None:
        """The reference episode's text (observation included)."""
        return "".join(text for text, _ in self.reference_segments(row))

    def check_answer(self, row: PromptRow, response_text: str) -> bool:
        """Correct when the text after the last '=' is the value: the policy's own answer,
        since the observation carries no '='."""
        return final_answer_is(row, response_text)
