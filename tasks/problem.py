"""Prompts for a run: the problem from config, one deterministic prompt per group index.

Group n of a run always asks prompt n (seeded by the run seed and n), so a group that
was in flight when a process died is re-issued with exactly the same prompt, and two
runs with the same seed see the same prompts in the same order (η=0 vs η=4 compare
like with like).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engines.problems.base import Problem
from engines.problems.dataset import DatasetProblem
from engines.problems.registry import get_problem
from infra.config import RunConfig


def build_problem(config: RunConfig) -> Problem:
    if config.problem.dataset:
        return DatasetProblem.from_files(config.problem.dataset, config.evaluation.dataset)
    return get_problem(config.problem.name)


def load_policy_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a policy checkpoint, padding with EOS when it has no pad."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class PromptSource:
    """The run's prompt sequence and its tokenization."""

    def __init__(self, config: RunConfig, tokenizer: PreTrainedTokenizerBase | None = None):
        self.config = config
        self.problem = build_problem(config)
        self.tokenizer = tokenizer

    def set_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def encode_prompt(self, row: dict[str, Any]) -> list[int]:
        if self.tokenizer is None:
            raise RuntimeError("PromptSource needs a tokenizer before encoding prompts")
        ids = self.tokenizer(self.problem.format_prompt(row))["input_ids"]
        return [int(i) for i in ids]

    def train_row(self, index: int) -> dict[str, Any]:
        rng = np.random.default_rng([self.config.seed, index])
        return self.problem.sample_prompts(1, rng, "train")[0]

    def train_prompt(self, index: int) -> tuple[dict[str, Any], list[int]]:
        row = self.train_row(index)
        return row, self.encode_prompt(row)

    def eval_rows(self) -> list[dict[str, Any]]:
        """The fixed held-out prompts every evaluation of the run uses."""
        rng = np.random.default_rng([self.config.seed, 2**31 - 1])
        return self.problem.sample_prompts(self.config.evaluation.num_prompts, rng, "test")
