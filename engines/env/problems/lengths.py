"""How long the reference solutions of a problem are: the long tail, measured.

``python -m sluice.engines.env.problems`` prints the histograms of the built-in task for the RL
prompts (long-tailed sizes) and the warm-start prompts (uniform sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sluice.engines.env.problems.base import Problem
from sluice.engines.env.problems.longtail import LongTailSum


@dataclass(frozen=True)
class LengthStats:
    """Reference-solution lengths (characters) over sampled prompts."""

    lengths: list[int]
    """One length per sampled prompt."""

    def percentile(self, q: float) -> float:
        """The q-th percentile (0..100), nearest-rank on the sorted lengths."""
        return float(np.percentile(np.asarray(self.lengths), q, method="nearest"))

    @property
    def tail_ratio(self) -> float:
        """p99 / p50: how much longer the slowest 1% are than the typical prompt."""
        return self.percentile(99) / self.percentile(50)


def solution_lengths(
    problem: Problem, n: int = 5000, seed: int = 0, *, warmstart: bool = False
) -> LengthStats:
    """Reference-solution lengths of `n` sampled training prompts."""
    rows = (
        problem.sample_warmstart_prompts(n, seed) if warmstart else problem.sample_prompts(n, seed)
    )
    lengths = []
    for row in rows:
        ref = problem.reference_response(row)
        if ref is None:
            raise ValueError(f"problem '{problem.name}' has no reference solutions to measure")
        lengths.append(len(ref))
    return LengthStats(lengths)


def length_report(
    problem: Problem, n: int = 5000, seed: int = 0, *, warmstart: bool = False, bins: int = 12
) -> str:
    """A text histogram of reference-solution lengths plus p50/p90/p99 and p99/p50."""
    stats = solution_lengths(problem, n, seed, warmstart=warmstart)
    values = np.asarray(stats.lengths)
    counts, edges = np.histogram(values, bins=bins)
    widest = max(int(counts.max()), 1)
    title = "warm-start (uniform sizes)" if warmstart else "train prompts (long-tailed sizes)"
    lines = [f"{problem.name}: reference-solution length in characters, {n} {title}"]
    for count, lo, hi in zip(counts, edges[:-1], edges[1:], strict=True):
        bar = "#" * max(1 if count else 0, round(50 * count / widest))
        lines.append(f"  {lo:6.0f}-{hi:<6.0f} {count:6d} {bar}")
    lines.append(
        f"  min {values.min()}  p50 {stats.percentile(50):.0f}  p90 {stats.percentile(90):.0f}  "
        f"p99 {stats.percentile(99):.0f}  max {values.max()}  mean {values.mean():.1f}  "
        f"p99/p50 {stats.tail_ratio:.2f}"
    )
    return "\n".join(lines)


def main() -> None:
    """Print the length histograms of the built-in task (RL and warm-start distributions)."""
    problem = LongTailSum()
    print(length_report(problem))
    print()
    print(length_report(problem, warmstart=True))


if __name__ == "__main__":
    main()
