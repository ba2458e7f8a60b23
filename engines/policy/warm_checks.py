"""How the warm start scores a policy on held-out prompts while it trains.

Greedy decoding, because the warm start stops on a band of *greedy* accuracy: a single
response per prompt (`evaluate_greedy`, Hugging Face `generate` over left-padded
batches), or for a multi-turn task a greedy episode per prompt on the inference engine,
the tool answering each call (`evaluate_episodes_greedy`).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sluice.engines.env.episodes import EpisodeSpec, run_on_engine, sync_tool
from sluice.engines.env.problems.base import Problem, PromptRow

log = logging.getLogger(__name__)


@torch.no_grad()
def greedy_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    max_new_tokens: int,
    *,
    batch_size: int = 32,
) -> list[str]:
    """Greedy completions of `prompts` (text after the prompt, up to eos).

    Prompts are sorted by length and left-padded in batches so a batch wastes little
    on padding; order of the result matches `prompts`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    device = next(model.parameters()).device
    encoded = [list(tokenizer(p)["input_ids"]) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    out: list[str] = [""] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            width = max(len(encoded[i]) for i in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, width - len(encoded[i]) :] = torch.tensor(encoded[i])
                mask[row, width - len(encoded[i]) :] = 1
            generated = model.generate(  # type: ignore[operator]  # nn.Module.__getattr__ hides it
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=pad_id,
            )
            for row, i in enumerate(chunk):
                new_tokens = generated[row, width:].tolist()
                if tokenizer.eos_token_id in new_tokens:
                    new_tokens = new_tokens[: new_tokens.index(tokenizer.eos_token_id)]
                out[i] = str(tokenizer.decode(new_tokens, skip_special_tokens=True))
    finally:
        model.train(was_training)
    return out


def evaluate_greedy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problem: Problem,
    rows: Sequence[PromptRow],
    max_new_tokens: int,
    *,
    check: Callable[[PromptRow, str], bool] | None = None,
) -> float:
    """Share of `rows` whose greedy response passes `check` (default: the problem's)."""
    if not rows:
        raise ValueError("evaluate_greedy: no rows to evaluate")
    checker = check or problem.check_answer
    responses = greedy_responses(
        model, tokenizer, [problem.format_prompt(r) for r in rows], max_new_tokens
    )
    return sum(bool(checker(row, text)) for row, text in zip(rows, responses, strict=True)) / len(
        rows
    )


@dataclass(frozen=True)
class EpisodeCheck:
    """How the warm start's held-out check runs episodes: their rules and the tool."""

    spec: EpisodeSpec
    tool: Callable[[str], str]
    """Answers a call's text (raises on a bad call: an error observation)."""


def evaluate_episodes_greedy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problem: Problem,
    rows: Sequence[PromptRow],
    episodes: EpisodeCheck,
) -> float:
    """Share of `rows` whose greedy episode (the tool answering each call) ends in a
    right answer. The weights run on the inference engine, as in a run."""
    from sluice.engines.inference.engine import InferenceEngine
    from sluice.engines.inference.types import SamplingParams

    if not rows:
        raise ValueError("evaluate_episodes_greedy: no rows to evaluate")
    with tempfile.TemporaryDirectory(prefix="sluice-warm-eval-") as weights:
        model.save_pretrained(weights)
        tokenizer.save_pretrained(weights)
        engine = InferenceEngine(weights, max_batch_size=64, seed=0)
        try:
            done = run_on_engine(
                engine,
                [list(tokenizer(problem.format_prompt(row))["input_ids"]) for row in rows],
                episodes.spec,
                lambda _i: SamplingParams(temperature=0.0),
                sync_tool(episodes.tool),
                lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"]),
                lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
            )
        finally:
            engine.shutdown()
    texts = [str(tokenizer.decode(e.response_token_ids, skip_special_tokens=True)) for e in done]
    calls = sum(e.tool_calls > 0 for e in done)
    log.info("greedy episodes: %d of %d call the tool", calls, len(done))
    return sum(
        problem.check_answer(row, text) for row, text in zip(rows, texts, strict=True)
    ) / len(rows)


def eval_token_cap(
    tokenizer: PreTrainedTokenizerBase,
    problem: Problem,
    rows: Sequence[PromptRow],
    max_new_tokens: int,
) -> int:
    """The decoding budget of a check: a response much longer than the longest
    reference cannot end in a right answer any more, and an untrained model never emits
    eos, so the cap saves minutes."""
    lengths = []
    for row in rows:
        reference = problem.reference_response(row)
        if reference is None:
            return max_new_tokens
        lengths.append(len(tokenizer(reference, add_special_tokens=False)["input_ids"]))
    return max(1, min(max_new_tokens, max(lengths) + 8))
