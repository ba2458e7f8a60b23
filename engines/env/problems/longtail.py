"""The built-in task, ``longtail_sum``: a running sum over labelled digits.

::

    prompt:   a7b3c9d2:
    response: a7=7b3=10c9=19d2=21

Each step copies the next labelled digit and writes the running total, so the worked
solution grows linearly with the number of terms, and the final answer is the text
after the last ``=``. Copying the digit before adding it matters for a ~1M-parameter
model: without the copy (``a7b10c19d21=21``) it must find the digit and add it within
one token, and in the same supervised run it needed ~2200 steps instead of ~1350 to
hold 30% greedy held-out accuracy.
Term counts are drawn from a clipped log-normal (median 5, most prompts short, a few
up to 32 terms), which makes the reference-solution length long-tailed: p99/p50 is
about 7 (``python -m sluice.engines.env.problems`` prints the histogram). A long tail is what
makes synchronous RL wait for its slowest sample (docs/design.md §4).

Three departures from a plain sampler:
- the supervised warm start draws term counts *uniformly* over the whole range
  (``sample_warmstart_prompts``; docs/design.md §4): warm-starting on the long-tailed
  distribution memorised the short answers and left RL nothing to climb;
- half of the warm-start references are the bare answer (``=21``), half the worked
  sum. The warm-started policy then does what pretrained LLMs do: sometimes it works
  the problem out, sometimes it blurts an answer, and the first response token decides
  which. A ~1M-parameter model cannot add a dozen digits in one token, so the worked
  answers are right far more often, and RL has a real strategy to discover ("show your
  work"), as reasoning RL on LLMs does, while its responses grow longer. Warm-started on
  worked solutions only, the policy's errors were almost all one systematic miscopy
  (the last term's digit), RL could only sharpen what sampling already found, and
  held-out reward rose ~0.1 before it flattened;
- the held-out split is disjoint from training by a hash of the prompt text, so no
  held-out prompt is ever trained on, however many prompts are drawn.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import numpy as np

from sluice.engines.env.problems.base import (
    ANSWER_MARKER,
    MAX_SPLIT_ATTEMPTS,
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

LABELS = string.ascii_lowercase + string.ascii_uppercase


@dataclass(frozen=True)
class LongTailSum:
    """Running sum over labelled digits with long-tailed term counts (see module doc)."""

    min_terms: int = 2
    """Fewest terms in a prompt; 2 keeps every prompt a real sum (1 would be a copy)."""
    max_terms: int = 32
    """Most terms; 32 gives reference solutions up to ~180 characters. At most 52 labels."""
    median_terms: float = 5.0
    """Median of the log-normal term count before clipping."""
    sigma: float = 0.8
    """Log-normal shape: 0.8 puts p99 near 30 terms, so p99/p50 of solution length is ~7."""
    max_digit: int = 9
    """Terms are drawn uniformly from 0..max_digit."""
    test_fraction: float = 0.1
    """Share of the prompt space (by text hash) reserved for the held-out split."""
    direct_answer_fraction: float = 0.5
    """Share of warm-start rows whose reference is the bare answer (``=21``) instead of the
    worked running sum. A supervised corpus, like text on the web, mixes answers that show
    their work with answers that don't; the warm-started policy does both, and RL has to
    find out which one pays (see the module docstring). 0 = worked solutions only."""
    name: str = field(default="longtail_sum")
    """Task name written to each row."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_terms <= self.max_terms <= len(LABELS):
            raise ValueError(
                f"longtail_sum: need 1 <= min_terms ({self.min_terms}) <= max_terms "
                f"({self.max_terms}) <= {len(LABELS)}"
            )
        if self.median_terms <= 0 or self.sigma <= 0:
            raise ValueError("longtail_sum: median_terms and sigma must be positive")
        if not 1 <= self.max_digit <= 9:
            raise ValueError(f"longtail_sum: max_digit must be in 1..9, got {self.max_digit}")
        if not 0 <= self.direct_answer_fraction <= 1:
            raise ValueError(
                "longtail_sum: direct_answer_fraction must be in [0, 1], "
                f"got {self.direct_answer_fraction}"
            )
        if not 0 < self.test_fraction < 1:
            raise ValueError(
                f"longtail_sum: test_fraction must be in (0, 1), got {self.test_fraction}"
            )

    # -- sizes

    def _longtail_terms(self, rng: np.random.Generator) -> int:
        raw = rng.lognormal(mean=math.log(self.median_terms), sigma=self.sigma)
        return int(min(max(round(raw), self.min_terms), self.max_terms))

    def _uniform_terms(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.min_terms, self.max_terms + 1))

    # -- rows

    def make_row(self, digits: Sequence[int]) -> PromptRow:
        """The row for one list of digits (labels a, b, c, ... in order)."""
        if not self.min_terms <= len(digits) <= self.max_terms:
            raise ValueError(
                f"longtail_sum: {len(digits)} terms outside [{self.min_terms}, {self.max_terms}]"
            )
        if any(not 0 <= d <= self.max_digit for d in digits):
            raise ValueError(
                f"longtail_sum: digits must be in 0..{self.max_digit}, got {list(digits)}"
            )
        prompt = "".join(f"{LABELS[i]}{d}" for i, d in enumerate(digits)) + ":"
        steps, total = [], 0
        for i, d in enumerate(digits):
            total += d
            steps.append(f"{LABELS[i]}{d}{ANSWER_MARKER}{total}")
        # The last step already ends in "=total": it doubles as the final answer.
        solution = "".join(steps)
        return {
            "prompt_id": f"{self.name}-{stable_hash(prompt):016x}",
            "prompt": prompt,
            "answer": str(total),
            "task": self.name,
            "num_terms": len(digits),
            "solution": solution,
        }

    def _sample(
        self, n: int, seed: SeedLike, split: Split, sizes: Literal["longtail", "uniform"]
    ) -> list[PromptRow]:
        check_count(n)
        check_split(split)
        rng = as_generator(seed)
        draw_terms = self._longtail_terms if sizes == "longtail" else self._uniform_terms
        rows = []
        for _ in range(n):
            k = draw_terms(rng)
            # Redraw digits, never the size, until the prompt lands in the wanted split:
            # the split filter must not bend the size distribution.
            row = draw_in_split(
                partial(self._draw_digits, rng, k),
                "prompt",
                split,
                self.test_fraction,
                f"longtail_sum: no {split} prompt with {k} terms found in {MAX_SPLIT_ATTEMPTS} "
                "draws; raise max_digit or min_terms so each size has more distinct prompts",
            )
            rows.append(row)
        return rows

    def _draw_digits(self, rng: np.random.Generator, k: int) -> PromptRow:
        return self.make_row(rng.integers(0, self.max_digit + 1, size=k).tolist())

    def sample_prompts(self, n: int, seed: SeedLike, split: Split = "train") -> list[PromptRow]:
        """`n` rows with long-tailed term counts from the `split` half of the prompt space."""
        return self._sample(n, seed, split, "longtail")

    def sample_warmstart_prompts(self, n: int, seed: SeedLike) -> list[PromptRow]:
        """`n` training rows with term counts uniform over [min_terms, max_terms].

        A `direct_answer_fraction` share of them carry the bare answer as their reference
        (``solution_style`` "direct"), the rest the worked running sum ("worked").
        """
        rng = as_generator(seed)
        rows = self._sample(n, rng, "train", "uniform")
        for row in rows:
            if rng.random() < self.direct_answer_fraction:
                row["solution"] = f"{ANSWER_MARKER}{row['answer']}"
                row["solution_style"] = "direct"
            else:
                row["solution_style"] = "worked"
        return rows

    def format_prompt(self, row: PromptRow) -> str:
        """The prompt text as is: the policy continues right after the ':'."""
        return str(row["prompt"])

    def reference_response(self, row: PromptRow) -> str | None:
        """The worked running-sum solution stored in the row."""
        solution = row.get("solution")
        return solution if isinstance(solution, str) else None

    def check_answer(self, row: PromptRow, response_text: str) -> bool:
        """Correct when the text after the last '=' is exactly the expected integer.

        Only the final answer is checked, not the running sums: the reward is what a
        rule verifier can see, and the worked steps are the model's own business.
        """
        return final_answer_is(row, response_text)
