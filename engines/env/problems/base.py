"""What every problem shares: the prompt row, the `Problem` protocol, seeds, splits, answers.

A *problem* hands out prompt rows and knows how to check an answer. A prompt row is a
plain dict with at least ``prompt_id``, ``prompt`` (text), ``answer`` (text) and
``task``; any other keys (a worked ``solution``, unit ``tests``, ``num_terms``) travel
with the row through the trajectory streams to the verifier.

The problems themselves live beside this module: the built-in long-tailed sum in
`sluice.engines.env.problems.longtail`, dataset files in `sluice.engines.env.problems.dataset`, the name ->
problem table in `sluice.engines.env.problems.registry` and the solution-length report (``python -m
sluice.engines.env.problems``) in `sluice.engines.env.problems.lengths`.

Held-out prompts are chosen by a hash of the prompt text (`split_of`), so no held-out
prompt is ever trained on, however many prompts are drawn.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

PromptRow = dict[str, Any]
"""One prompt: at least prompt_id, prompt, answer, task (all str); extras pass through."""

REQUIRED_ROW_KEYS = ("prompt_id", "prompt", "answer", "task")
Split = Literal["train", "test"]
SeedLike = int | np.random.Generator

ANSWER_MARKER = "="
"""The final answer of a built-in task follows the last occurrence of this marker."""


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


def final_answer_is(row: PromptRow, response_text: str) -> bool:
    """Whether the text after the last `ANSWER_MARKER` is exactly the row's answer."""
    got = final_answer(response_text)
    expected = str(row.get("answer", "")).strip()
    return got is not None and got == expected and expected != ""


MAX_SPLIT_ATTEMPTS = 2000
"""Redraws a sampler may spend to land a prompt in the wanted split before it says the
prompt space is too small (a hang otherwise)."""


def draw_in_split(
    draw: Callable[[], PromptRow], key: str, split: Split, test_fraction: float, refusal: str
) -> PromptRow:
    """`draw()` again until its row's `key` text lands in `split`; after
    `MAX_SPLIT_ATTEMPTS` draws, ValueError(`refusal`): the prompt space is too small."""
    for _attempt in range(MAX_SPLIT_ATTEMPTS):
        row = draw()
        if split_of(row[key], test_fraction) == split:
            return row
    raise ValueError(refusal)


def check_split(split: str) -> None:
    """Refuse a split other than 'train' or 'test' with one clear error."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")


def check_count(n: int) -> None:
    """Refuse a prompt count that is not a non-negative int with one clear error."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"number of prompts must be a non-negative int, got {n!r}")
