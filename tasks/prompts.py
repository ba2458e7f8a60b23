"""Prompts for a run: the problem from config, one deterministic prompt per group index.

Group n of a run always asks prompt n (seeded by the run seed and n), so a group that
was in flight when a process died is re-issued with exactly the same prompt, and two
runs with the same seed see the same prompts in the same order (η=0 vs η=4 compare
like with like). The one exception is a curriculum counted in trained steps
(`problem.curriculum_clock: trained`): there the policy version answering a group picks
its stage, so a group re-issued across a stage's end asks a prompt of the next stage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from sluice.engines.env.problems.base import Problem
from sluice.engines.env.problems.dataset import DatasetProblem
from sluice.engines.env.problems.registry import get_problem
from sluice.engines.policy.model_dir import ModelDirError, declared_end_token_ids
from sluice.engines.policy.warmstart import IGNORE_INDEX
from sluice.infra.config.problem import CurriculumStage, problem_options
from sluice.infra.config.run import RunConfig


def build_problem(config: RunConfig) -> Problem:
    if config.problem.dataset:
        return DatasetProblem.from_files(config.problem.dataset, config.evaluation.dataset)
    return get_problem(config.problem.name, **problem_options(config.problem))


def load_policy_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a policy checkpoint, padding with EOS when it has no pad."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


MAX_DRAWS = 64
"""Prompts drawn for one group before a run whose prompts never fit gives up."""


def policy_context(model_dir: str | Path, max_seq_len: int | None = None) -> int:
    """Prompt plus response tokens a policy's inference engine holds per sequence: the
    model's positions, at most `max_seq_len` (`rollout.max_seq_len`; None: 2048, the
    embedded engine's default)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return min(int(config.get("max_position_embeddings") or 2048), max_seq_len or 2048)


def end_token_ids(model_dir: str | Path, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Every token that ends a response: the tokenizer's EOS and those the model's
    generation config and config name (sorted, so requests are reproducible)."""
    ids = set(declared_end_token_ids(model_dir))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def uses_chat_template(config: RunConfig, tokenizer: PreTrainedTokenizerBase, where: Any) -> bool:
    """Whether prompts go through the chat template (`model.chat_template`)."""
    mode = config.model.chat_template
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if mode == "always" and not has_template:
        raise ModelDirError(
            f"model.chat_template=always, but the tokenizer in '{where}' has no chat template; "
            "use model.chat_template=never (plain prompts) or a chat model"
        )
    return has_template and mode != "never"


class PromptSource:
    """The run's prompt sequence and its tokenization.

    `use_policy(model_dir)` takes the policy's tokenizer, context and end tokens. A
    prompt is the problem's text, rendered through the tokenizer's chat template as one
    user message when `model.chat_template` says so; `stop_token_ids` end every response.

    With `max_prompt_tokens` set, a prompt that would leave the engine no room to
    generate is passed over for the next draw of the same group (seeded by the group and
    the draw, so a re-issued group gets the same prompt again); `skipped_too_long`
    counts them. A curriculum (`problem.curriculum`) passes over a prompt larger than its
    stage allows the same way (`skipped_by_curriculum`).
    """

    def __init__(self, config: RunConfig, tokenizer: PreTrainedTokenizerBase | None = None):
        self.config = config
        self.problem = build_problem(config)
        self.tokenizer = tokenizer
        self.max_prompt_tokens: int | None = None
        self.skipped_too_long = 0
        self.skipped_by_curriculum = 0
        self.chat = False
        self.stop_token_ids: tuple[int, ...] = ()

    def use_policy(self, model_dir: str | Path) -> PromptSource:
        """Encode prompts for the policy in `model_dir`; returns self."""
        tokenizer = load_policy_tokenizer(model_dir)
        context = policy_context(model_dir, self.config.rollout.max_seq_len)
        self.set_tokenizer(tokenizer, context - 1)
        self.chat = uses_chat_template(self.config, tokenizer, model_dir)
        self.stop_token_ids = end_token_ids(model_dir, tokenizer)
        return self

    def set_tokenizer(
        self, tokenizer: PreTrainedTokenizerBase, max_prompt_tokens: int | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens

    def encode_prompt(self, row: dict[str, Any]) -> list[int]:
        if self.tokenizer is None:
            raise RuntimeError("PromptSource needs a tokenizer before encoding prompts")
        text = self.problem.format_prompt(row)
        if not self.chat:
            return [int(i) for i in self.tokenizer(text)["input_ids"]]
        messages = [{"role": "user", "content": text}]
        if self.config.model.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.config.model.system_prompt})
        encoded = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return [int(i) for i in ids]

    def train_row(self, index: int, draw: int = 0) -> dict[str, Any]:
        seed = [self.config.seed, index] if draw == 0 else [self.config.seed, index, draw]
        return self.problem.sample_prompts(1, np.random.default_rng(seed), "train")[0]

    def stage(self, index: int, version: int | None = None) -> CurriculumStage | None:
        """The curriculum's stage for group `index`, generated by policy `version` (None:
        the whole mix). `problem.curriculum_clock: trained` counts the version; without
        one (or with `issued`), the group's step `index // prompts_per_batch`."""
        problem = self.config.problem
        step = index // self.config.trainer.prompts_per_batch
        if problem.curriculum_clock == "trained" and version is not None:
            step = version
        for stage in problem.curriculum:
            if step < stage.until_step:
                return stage
        return None

    def train_prompt(
        self, index: int, version: int | None = None
    ) -> tuple[dict[str, Any], list[int]]:
        """Group `index`'s prompt row and ids; `version` is the policy that will answer it
        (it picks the curriculum's stage under `problem.curriculum_clock: trained`)."""
        stage = self.stage(index, version)
        outside = 0
        for draw in range(MAX_DRAWS):
            row = self.train_row(index, draw)
            if stage is not None:
                size = row.get("num_terms")
                if not isinstance(size, int):
                    raise ValueError(
                        "problem.curriculum bounds a prompt's num_terms, and this problem's "
                        "rows have none (longtail_sum, chain_sum and basic_arithmetic do)"
                    )
                if not stage.min_terms <= size <= stage.max_terms:
                    outside += 1
                    self.skipped_by_curriculum += 1
                    continue
            ids = self.encode_prompt(row)
            if self.max_prompt_tokens is None or len(ids) <= self.max_prompt_tokens:
                return row, ids
            self.skipped_too_long += 1
        if stage is not None and outside == MAX_DRAWS:
            raise ValueError(
                f"group {index}: {MAX_DRAWS} prompts in a row have a num_terms outside "
                f"[{stage.min_terms}, {stage.max_terms}], the bounds of problem.curriculum's "
                "stage for this step; the problem's mix has (almost) none of those sizes"
            )
        raise ValueError(
            f"group {index}: {MAX_DRAWS} prompts in a row are longer than "
            f"{self.max_prompt_tokens} tokens, the most the policy's context leaves room "
            "for; the dataset's prompts do not fit this model"
        )

    def eval_rows(self) -> list[dict[str, Any]]:
        """The fixed held-out prompts every evaluation of the run uses."""
        rng = np.random.default_rng([self.config.seed, 2**31 - 1])
        return self.problem.sample_prompts(self.config.evaluation.num_prompts, rng, "test")


def reference_examples(
    source: PromptSource, end_id: int, max_terms: int = 0
) -> Iterator[tuple[list[int], list[int]]]:
    """Supervised rows for training prompts 0, 1, ...: `(input_ids, labels)` of the prompt
    as the rollout encodes it, then the row's reference answer and `end_id`; the labels
    are IGNORE_INDEX on the prompt. `max_terms` > 0 passes over rows with more terms."""
    index = 0
    while True:
        row = source.train_row(index)
        index += 1
        if max_terms and row.get("num_terms", 0) > max_terms:
            continue
        answer = source.problem.reference_response(row)
        if answer is None:
            raise ValueError(
                f"a supervised pass needs reference answers; {source.problem!r} has none "
                f"for training row {index - 1}"
            )
        prompt = source.encode_prompt(row)
        tokenizer = source.tokenizer
        assert tokenizer is not None  # encode_prompt raised otherwise
        response = [int(i) for i in tokenizer(answer, add_special_tokens=False)["input_ids"]]
        response.append(end_id)
        yield prompt + response, [IGNORE_INDEX] * len(prompt) + response
