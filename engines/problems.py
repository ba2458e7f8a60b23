"""Prompts and reference answers: the built-in long-tailed task and dataset readers.

A *problem* hands out prompt rows and knows how to check an answer. A prompt row is a
plain dict with at least ``prompt_id``, ``prompt`` (text), ``answer`` (text) and
``task``; any other keys (a worked ``solution``, unit ``tests``, ``num_terms``) travel
with the row through the trajectory streams to the verifier.

The built-in task, ``longtail_sum``, is a running sum over labelled digits::

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
about 7 (``python -m engines.problems`` prints the histogram). A long tail is what
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

Dataset files (DeepScaleR/GSM8K style ``.jsonl`` or ``.parquet`` with ``prompt`` and
``answer``) are read by `load_dataset_rows`; a malformed row stops the load with one
error naming the file and the line or row.
"""

from __future__ import annotations

import hashlib
import json
import math
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

PromptRow = dict[str, Any]
"""One prompt: at least prompt_id, prompt, answer, task (all str); extras pass through."""

REQUIRED_ROW_KEYS = ("prompt_id", "prompt", "answer", "task")
Split = Literal["train", "test"]
SeedLike = int | np.random.Generator

ANSWER_MARKER = "="
"""The final answer of a built-in task follows the last occurrence of this marker."""


class DatasetFormatError(ValueError):
    """A dataset file that cannot be used, naming the file and the line/row at fault."""


@runtime_checkable
class Problem(Protocol):
    """What the rollout, reward and warm-start code need from a task."""

    @property
    def name(self) -> str:
        """Task name, written to the `task` column of every row."""
        ...

    def sample_prompts(self, n: int, seed: SeedLike, split: Split = "train") -> list[PromptRow]:
        """`n` rows of `split`, deterministic for an int seed; a Generator continues a stream."""
        ...

    def sample_warmstart_prompts(self, n: int, seed: SeedLike) -> list[PromptRow]:
        """`n` training rows for the supervised warm start (may differ in distribution)."""
        ...

    def format_prompt(self, row: PromptRow) -> str:
        """The text the policy is conditioned on."""
        ...

    def reference_response(self, row: PromptRow) -> str | None:
        """A worked correct response for supervised training, or None when unknown."""
        ...

    def check_answer(self, row: PromptRow, response_text: str) -> bool:
        """Whether the response's final answer is correct. Never raises."""
        ...


def as_generator(seed: SeedLike) -> np.random.Generator:
    """A numpy Generator from an int seed (fresh) or a Generator (used as is)."""
    if isinstance(seed, np.random.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(f"seed must be an int or numpy Generator, got {type(seed).__name__}")
    return np.random.default_rng(int(seed))


def stable_hash(text: str) -> int:
    """A 64-bit hash of `text` that is the same in every process (unlike hash())."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def split_of(prompt_text: str, test_fraction: float) -> Split:
    """The split a prompt belongs to, fixed forever by its text."""
    bucket = stable_hash(prompt_text) % 1_000_000
    return "test" if bucket < round(test_fraction * 1_000_000) else "train"


def final_answer(response_text: str, marker: str = ANSWER_MARKER) -> str | None:
    """Text after the last `marker`, stripped; None when there is no marker."""
    if not isinstance(response_text, str) or marker not in response_text:
        return None
    return response_text.rsplit(marker, 1)[1].strip()


def _check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")


def _check_count(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"number of prompts must be a non-negative int, got {n!r}")


# ------------------------------------------------------------------ built-in task

LABELS = string.ascii_lowercase + string.ascii_uppercase
# Redraws allowed to land a prompt in the wanted split. Default sizes have >= 100
# distinct prompts each, so this never binds; a degenerate config (1 term of 0..1)
# may have no test prompt at all and gets a clear error instead of a hang.
_MAX_SPLIT_ATTEMPTS = 2000


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
        _check_count(n)
        _check_split(split)
        rng = as_generator(seed)
        draw_terms = self._longtail_terms if sizes == "longtail" else self._uniform_terms
        rows = []
        for _ in range(n):
            k = draw_terms(rng)
            # Redraw digits, never the size, until the prompt lands in the wanted split:
            # the split filter must not bend the size distribution.
            for _attempt in range(_MAX_SPLIT_ATTEMPTS):
                digits = rng.integers(0, self.max_digit + 1, size=k).tolist()
                row = self.make_row(digits)
                if split_of(row["prompt"], self.test_fraction) == split:
                    break
            else:
                raise ValueError(
                    f"longtail_sum: no {split} prompt with {k} terms found in {_MAX_SPLIT_ATTEMPTS} draws; "
                    "raise max_digit or min_terms so each size has more distinct prompts"
                )
            rows.append(row)
        return rows

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
        got = final_answer(response_text)
        if got is None:
            return False
        expected = str(row.get("answer", "")).strip()
        return got == expected and expected != ""


# ------------------------------------------------------------------ datasets


def _normalise_row(raw: Any, where: str, index: int, default_task: str, stem: str) -> PromptRow:
    if not isinstance(raw, dict):
        raise DatasetFormatError(
            f"{where}: expected an object with 'prompt' and 'answer', got {type(raw).__name__}"
        )
    for key in ("prompt", "answer"):
        if key not in raw or raw[key] is None:
            present = ", ".join(sorted(map(str, raw))) or "none"
            raise DatasetFormatError(f"{where}: missing field '{key}' (fields present: {present})")
    prompt = raw["prompt"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise DatasetFormatError(
            f"{where}: field 'prompt' must be a non-empty string, got {type(prompt).__name__}"
        )
    answer = raw["answer"]
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise DatasetFormatError(
            f"{where}: field 'answer' must be a string or number, got {type(answer).__name__}"
        )
    if isinstance(answer, float) and not math.isfinite(answer):
        raise DatasetFormatError(f"{where}: field 'answer' is not a finite number ({answer})")
    row = dict(raw)
    row["prompt"] = prompt
    row["answer"] = answer if isinstance(answer, str) else str(answer)
    prompt_id = raw.get("prompt_id")
    if prompt_id is None:
        row["prompt_id"] = f"{stem}-{index}"
    elif isinstance(prompt_id, str | int) and not isinstance(prompt_id, bool):
        row["prompt_id"] = str(prompt_id)
    else:
        raise DatasetFormatError(f"{where}: field 'prompt_id' must be a string or int")
    task = raw.get("task")
    if task is None:
        row["task"] = default_task
    elif isinstance(task, str):
        row["task"] = task
    else:
        raise DatasetFormatError(
            f"{where}: field 'task' must be a string, got {type(task).__name__}"
        )
    return row


def load_dataset_rows(path: str | Path, *, task: str | None = None) -> list[PromptRow]:
    """Rows of a `.jsonl` or `.parquet` file with `prompt` and `answer` fields.

    Numbers in `answer` become strings; a missing `prompt_id` becomes ``{stem}-{index}``
    and a missing `task` becomes `task` (default: the file stem). Every other field is
    kept for the verifier (e.g. `solution`, `tests`). Raises DatasetFormatError naming
    the file and the 1-based line (jsonl) or 0-based row (parquet) of the first bad row.
    """
    where = Path(path)
    if not where.is_file():
        raise DatasetFormatError(f"dataset file '{where}' does not exist or is not a file")
    stem = where.stem
    default_task = task or stem
    suffix = where.suffix.lower()
    rows: list[PromptRow] = []
    if suffix == ".jsonl":
        with where.open("r", encoding="utf-8") as handle:
            line_no = 0
            try:
                for line_no, line in enumerate(handle, start=1):  # noqa: B007 - used after loop
                    if not line.strip():
                        continue
                    loc = f"{where}: line {line_no}"
                    try:
                        raw = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DatasetFormatError(
                            f"{loc}: not valid JSON ({exc.msg} at column {exc.colno})"
                        ) from None
                    rows.append(_normalise_row(raw, loc, len(rows), default_task, stem))
            except UnicodeDecodeError as exc:
                raise DatasetFormatError(
                    f"{where}: line {line_no + 1}: not valid UTF-8 ({exc.reason})"
                ) from None
    elif suffix == ".parquet":
        import pyarrow.parquet as pq  # lazy: only dataset runs need pyarrow

        try:
            table = pq.read_table(where)
        except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for non-parquet bytes
            raise DatasetFormatError(f"{where}: not a readable parquet file ({exc})") from None
        for key in ("prompt", "answer"):
            if key not in table.column_names:
                raise DatasetFormatError(
                    f"{where}: missing column '{key}' (columns: {', '.join(table.column_names)})"
                )
        for index, raw in enumerate(table.to_pylist()):
            rows.append(_normalise_row(raw, f"{where}: row {index}", index, default_task, stem))
    else:
        raise DatasetFormatError(
            f"{where}: unsupported dataset format '{suffix}' (use .jsonl or .parquet)"
        )
    if not rows:
        raise DatasetFormatError(f"{where}: no rows")
    return rows


@dataclass
class DatasetProblem:
    """A problem backed by dataset rows (DeepScaleR/GSM8K style).

    Without separate held-out rows, a hash of the prompt text puts `test_fraction` of
    the rows in the test split. Answers are checked by exact match of the text after
    the last '=' or of the whole stripped response; real math/code runs score with the
    `math`/`code` verifiers instead.
    """

    rows: list[PromptRow]
    """Training rows (all rows when `eval_rows` is None, then split by hash)."""
    eval_rows: list[PromptRow] | None = None
    """Held-out rows; None splits `rows` by prompt hash."""
    test_fraction: float = 0.1
    """Share of `rows` held out when `eval_rows` is None."""
    prompt_template: str = "{prompt}"
    """Format string applied to each row (keys of the row are available)."""
    name: str = "dataset"
    """Task name for reporting."""
    _train: list[PromptRow] = field(init=False, repr=False)
    _test: list[PromptRow] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.eval_rows is not None:
            self._train, self._test = list(self.rows), list(self.eval_rows)
        else:
            self._train = [
                r for r in self.rows if split_of(r["prompt"], self.test_fraction) == "train"
            ]
            self._test = [
                r for r in self.rows if split_of(r["prompt"], self.test_fraction) == "test"
            ]
        if not self._train:
            raise DatasetFormatError(f"dataset problem '{self.name}': no training rows")

    @classmethod
    def from_files(
        cls, train_path: str | Path, eval_path: str | Path | None = None, **kwargs: Any
    ) -> DatasetProblem:
        """Read `train_path` (and `eval_path`) with load_dataset_rows."""
        rows = load_dataset_rows(train_path)
        eval_rows = load_dataset_rows(eval_path) if eval_path is not None else None
        kwargs.setdefault("name", Path(train_path).stem)
        return cls(rows=rows, eval_rows=eval_rows, **kwargs)

    def sample_prompts(self, n: int, seed: SeedLike, split: Split = "train") -> list[PromptRow]:
        """`n` rows drawn uniformly with replacement from `split`."""
        _check_count(n)
        _check_split(split)
        pool = self._train if split == "train" else self._test
        if not pool and n:
            raise ValueError(f"dataset problem '{self.name}': the {split} split is empty")
        rng = as_generator(seed)
        return [dict(pool[i]) for i in rng.integers(0, len(pool), size=n)] if n else []

    def sample_warmstart_prompts(self, n: int, seed: SeedLike) -> list[PromptRow]:
        """Training rows (datasets have no size knob to flatten)."""
        return self.sample_prompts(n, seed, "train")

    def format_prompt(self, row: PromptRow) -> str:
        """`prompt_template` filled from the row."""
        try:
            return self.prompt_template.format(**row)
        except (KeyError, IndexError) as exc:
            raise ValueError(
                f"prompt_template {self.prompt_template!r} needs field {exc}"
            ) from None

    def reference_response(self, row: PromptRow) -> str | None:
        """The row's `solution` field when it has one."""
        solution = row.get("solution")
        return solution if isinstance(solution, str) and solution else None

    def check_answer(self, row: PromptRow, response_text: str) -> bool:
        """Exact match of the final answer (after the last '=' if any, else the whole text)."""
        if not isinstance(response_text, str):
            return False
        got = final_answer(response_text)
        got = response_text.strip() if got is None else got
        return got == str(row.get("answer", "")).strip() != ""


BUILTIN_PROBLEMS: dict[str, type[LongTailSum]] = {"longtail_sum": LongTailSum}


def get_problem(name: str, **options: Any) -> LongTailSum:
    """A built-in problem by name (options go to its constructor)."""
    if name not in BUILTIN_PROBLEMS:
        raise ValueError(
            f"unknown built-in problem '{name}' (available: {', '.join(sorted(BUILTIN_PROBLEMS))})"
        )
    return BUILTIN_PROBLEMS[name](**options)


# ------------------------------------------------------------------ length report


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
