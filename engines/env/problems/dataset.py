"""Problems read from dataset files (DeepScaleR/GSM8K style ``.jsonl`` or ``.parquet``).

`load_dataset_rows` reads a file whose rows have ``prompt`` and ``answer``; a malformed
row stops the load with one error naming the file and the line or row. `DatasetProblem`
hands those rows out, holding back a hash-chosen share (or a separate file) as the
held-out split.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.engines.env.problems.base import (
    PromptRow,
    SeedLike,
    Split,
    as_generator,
    check_count,
    check_split,
    final_answer,
    split_of,
)


class DatasetFormatError(ValueError):
    """A dataset file that cannot be used, naming the file and the line/row at fault."""


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
        # Bytes, decoded line by line: a text-mode reader decodes ahead in chunks, so the
        # line a decoding error names would not be the line that holds the bad bytes.
        with where.open("rb") as handle:
            for line_no, data in enumerate(handle, start=1):
                loc = f"{where}: line {line_no}"
                try:
                    line = data.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DatasetFormatError(
                        f"{loc}: not valid UTF-8 ({exc.reason} at column {exc.start + 1})"
                    ) from None
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetFormatError(
                        f"{loc}: not valid JSON ({exc.msg} at column {exc.colno})"
                    ) from None
                rows.append(_normalise_row(raw, loc, len(rows), default_task, stem))
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
        check_count(n)
        check_split(split)
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
