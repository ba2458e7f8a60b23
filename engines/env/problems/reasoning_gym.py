"""Problem kind ``reasoning_gym``: seeded procedural tasks from the reasoning-gym package.

reasoning-gym (Apache-2.0) generates entries (``question``, ``answer``, ``metadata``)
from a dataset name, a seed, a size and the task's own settings; entry ``i`` depends on
those alone, and the dataset scores an answer against an entry (``score_answer``, a
float in [0, 1]; some tasks give partial credit).

How this problem uses it:
- each configured task is one dataset (seed `dataset_seed`, `dataset_size` entries,
  its settings); a prompt picks a task by the mixing weights, then an entry index
  uniformly, both from the caller's generator, so group n of a run always asks the
  same question (`tasks/prompts.py` seeds it by the run seed and n);
- the held-out split is chosen by a hash of the question text (`split_of`, as the
  built-in tasks do): an index whose question falls in the other split is redrawn, so
  no held-out question is ever trained on, even where two indices generate the same
  question (small tasks repeat themselves);
- the row carries what scoring needs to rebuild the entry (dataset, seed, size,
  settings, index) plus the answer extraction and format reward, in its extra field
  ``reasoning_gym``; the ``reasoning_gym`` verifier (`sluice.engines.env.verifiers`)
  rebuilds the entry and calls the task's own ``score_answer`` (`score_response`).

reasoning-gym is imported on first use: it costs about a second and pulls in sympy.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from sluice.engines.env.answers import EXTRACTIONS, extract_answer, format_answer
from sluice.engines.env.problems.base import (
    PromptRow,
    SeedLike,
    Split,
    as_generator,
    check_count,
    check_split,
    draw_in_split,
)

ROW_KEY = "reasoning_gym"
"""The row's extra field that holds what the verifier needs to rebuild the entry."""

DEFAULT_INSTRUCTION = "Give the final answer inside <answer></answer> tags."


def check_task(name: str, settings: Mapping[str, Any], seed: int = 0, size: int = 100_000) -> None:
    """Refuse an unknown task or settings the task rejects, in one line (ValueError).

    The dataset is built (entries are made lazily, so this is cheap for most tasks):
    some refuse a size here (``word_ladder`` has fewer distinct puzzles than 100,000).
    """
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = difflib.get_close_matches(name, list(DATASETS), n=3, cutoff=0.5)
        hint = f"; closest: {', '.join(close)}" if close else ""
        raise ValueError(f"unknown reasoning-gym task '{name}'{hint}")
    config_cls = DATASETS[name][1]
    known = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    for key in settings:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(
                f"reasoning-gym task '{name}' has no setting '{key}'{hint}; "
                f"its settings: {', '.join(known)}"
            )
    try:
        dataset_for(name, seed, size, settings)
    except (AssertionError, ValueError, TypeError) as exc:
        raise ValueError(
            f"reasoning-gym task '{name}' rejects its settings {dict(settings)} "
            f"(dataset_seed {seed}, dataset_size {size}): {exc}"
        ) from None


@functools.lru_cache(maxsize=256)
def _dataset(name: str, seed: int, size: int, settings_json: str) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(settings_json))


def dataset_for(name: str, seed: int, size: int, settings: Mapping[str, Any]) -> Any:
    """The reasoning-gym dataset of these arguments (cached: entries are made lazily)."""
    return _dataset(name, int(seed), int(size), json.dumps(dict(settings), sort_keys=True))


def response_answer(row: PromptRow, response_text: str) -> str | None:
    """The answer of a response to a reasoning-gym row, read in the row's format."""
    return extract_answer(response_text, str(row[ROW_KEY].get("extraction", "answer_tags")))


def score_response(row: PromptRow, response_text: str) -> tuple[float, str | None]:
    """(score in [0, 1], outcome) of a response to a reasoning-gym row.

    outcome is None when the task scored the extracted answer, ``"unparsed"`` when the
    response has no answer in the row's format (score 0). The row's format reward is
    the verifier's to add. Raises on a row that does not rebuild its entry (missing
    fields, another reasoning-gym version).
    """
    spec = row[ROW_KEY]
    answer = response_answer(row, response_text)
    if answer is None:
        return 0.0, "unparsed"
    dataset = dataset_for(spec["dataset"], spec["seed"], spec["size"], spec.get("settings", {}))
    entry = dataset[int(spec["index"])]
    if str(entry["answer"]) != str(row.get("answer")):
        raise ValueError(
            f"entry {spec['index']} of '{spec['dataset']}' rebuilds with answer "
            f"{entry['answer']!r}, the row has {row.get('answer')!r}"
        )
    score = float(dataset.score_answer(answer=answer, entry=entry))
    if not math.isfinite(score):
        raise ValueError(f"'{spec['dataset']}' scored {score}")
    return min(max(score, 0.0), 1.0), None


@dataclasses.dataclass(frozen=True)
class _Task:
    name: str
    weight: float
    settings: dict[str, Any]
    extraction: str


class ReasoningGymProblem:
    """A weighted mix of reasoning-gym tasks (see the module docstring)."""

    def __init__(
        self,
        tasks: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        instruction: str = DEFAULT_INSTRUCTION,
        extraction: str = "answer_tags",
        format_reward: float = 0.0,
        dataset_seed: int = 0,
        dataset_size: int = 100_000,
        test_fraction: float = 0.1,
        name: str = "reasoning_gym",
    ):
        """`tasks`: reasoning-gym name -> {"weight", "settings", "extraction"} (all
        optional; extraction None = the problem's `extraction`). Every task is checked
        here, so a bad one fails when the run is prepared."""
        if extraction not in EXTRACTIONS:
            raise ValueError(f"unknown extraction '{extraction}' (use {', '.join(EXTRACTIONS)})")
        if not 0 < test_fraction < 1:
            raise ValueError("reasoning_gym: test_fraction must be in (0, 1)")
        if dataset_size < 1:
            raise ValueError("reasoning_gym: dataset_size must be at least 1")
        self.name, self.instruction = name, instruction
        self.extraction, self.format_reward = extraction, float(format_reward)
        self.dataset_seed, self.dataset_size = int(dataset_seed), int(dataset_size)
        self.test_fraction = test_fraction
        self.tasks: list[_Task] = []
        # Sorted by name, so reordering the config's keys draws the same prompts.
        for task_name in sorted(tasks or {}):
            options = dict(tasks[task_name]) if tasks else {}
            settings = dict(options.get("settings") or {})
            weight = float(options.get("weight", 1.0))
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"reasoning-gym task '{task_name}': weight must be > 0")
            task_extraction = options.get("extraction") or extraction
            if task_extraction not in EXTRACTIONS:
                raise ValueError(
                    f"reasoning-gym task '{task_name}': unknown extraction '{task_extraction}'"
                )
            check_task(task_name, settings, self.dataset_seed, self.dataset_size)
            self.tasks.append(_Task(task_name, weight, settings, task_extraction))
        total = sum(t.weight for t in self.tasks)
        self.weights = np.array([t.weight / total for t in self.tasks])

    def make_row(self, task: _Task, index: int) -> PromptRow:
        """The prompt row of entry `index` of `task`'s dataset."""
        entry = dataset_for(task.name, self.dataset_seed, self.dataset_size, task.settings)[index]
        question = str(entry["question"])
        prompt = f"{question}\n\n{self.instruction}" if self.instruction else question
        terms = entry.get("metadata", {}).get("num_terms")
        # A size the held-out metrics split by (eval/reward_terms_*), where the task has one.
        size = {"num_terms": terms} if isinstance(terms, int) else {}
        return {
            **size,
            "prompt_id": f"{task.name}-{self.dataset_seed}-{index}",
            "prompt": prompt,
            "answer": str(entry["answer"]),
            "task": task.name,
            "question": question,
            ROW_KEY: {
                "dataset": task.name,
                "seed": self.dataset_seed,
                "size": self.dataset_size,
                "settings": task.settings,
                "index": index,
                "extraction": task.extraction,
                "format_reward": self.format_reward,
            },
        }

    def _sample(self, n: int, rng: np.random.Generator, split: Split) -> list[PromptRow]:
        if not self.tasks:
            raise ValueError("problem reasoning_gym names no tasks (problem.reasoning_gym.tasks)")
        rows = []
        for _ in range(n):
            task = self.tasks[int(rng.choice(len(self.tasks), p=self.weights))]
            rows.append(
                draw_in_split(
                    functools.partial(self._draw_entry, task, rng),
                    "question",
                    split,
                    self.test_fraction,
                    f"reasoning-gym task '{task.name}': no {split} question found",
                )
            )
        return rows

    def _draw_entry(self, task: Any, rng: np.random.Generator) -> PromptRow:
        return self.make_row(task, int(rng.integers(self.dataset_size)))

    def sample_prompts(self, n: int, seed: SeedLike, split: Split = "train") -> list[PromptRow]:
        """`n` rows of `split`: a task by weight, then an entry index, per row."""
        check_count(n)
        check_split(split)
        return self._sample(n, as_generator(seed), split)

    def sample_warmstart_prompts(self, n: int, seed: SeedLike) -> list[PromptRow]:
        """Training rows."""
        return self.sample_prompts(n, seed, "train")

    def format_prompt(self, row: PromptRow) -> str:
        return str(row["prompt"])

    def reference_response(self, row: PromptRow) -> str | None:
        """The reference answer in the row's extraction format."""
        spec = row.get(ROW_KEY) or {}
        return format_answer(str(row["answer"]), str(spec.get("extraction", self.extraction)))

    def check_answer(self, row: PromptRow, response_text: str) -> bool:
        """Whether the task gives the response's answer full marks. Never raises."""
        try:
            score, outcome = score_response(row, response_text)
        except Exception:
            return False
        return outcome is None and score >= 1.0
