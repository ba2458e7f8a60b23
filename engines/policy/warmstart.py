"""Supervised warm start: bring a random tiny policy to *partial* competence before RL.

RL from random weights on the built-in task never sees a reward; RL from a model that
already solves everything has nothing to learn. The warm start runs teacher-forced
cross-entropy on prompt + worked reference solution (loss on response tokens only) and
stops as soon as greedy held-out accuracy enters a target band (about 20-40%).

Per docs/design.md §4 the supervised rows come from `Problem.sample_warmstart_prompts`,
which for the built-in task draws problem sizes *uniformly* over the whole range,
while the held-out evaluation uses the long-tailed RL distribution. Warm-starting on
the long-tailed distribution memorised the short answers and RL then stalled.

The finished checkpoint is an ordinary Hugging Face directory plus a marker file
holding the report; the marker is written last, so its presence means "complete" and
a second call with the same `out_dir` returns at once (the caller owns cache keys).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sluice.engines.env.problems.base import Problem, PromptRow
from sluice.engines.policy.model import load_policy_dir
from sluice.engines.policy.warm_checks import (
    EpisodeCheck,
    eval_token_cap,
    evaluate_episodes_greedy,
    evaluate_greedy,
)

log = logging.getLogger(__name__)

WARM_START_MARKER = "sluice_warm_start.json"
IGNORE_INDEX = -100


@dataclass
class WarmStartReport:
    """What the warm start did; stored next to the checkpoint as the completion marker."""

    out_dir: str
    """Directory of the warm checkpoint (Hugging Face layout)."""
    steps: int
    """Optimizer steps taken."""
    examples_seen: int
    """Supervised rows consumed (steps x batch_size)."""
    wall_time_s: float
    """Seconds the warm start took when it ran (a cached report keeps the original)."""
    final_accuracy: float
    """Greedy held-out accuracy of the saved checkpoint, in [0, 1]."""
    stop_reason: str
    """'in_band', 'above_band' (overshot between evaluations), 'max_steps' or 'max_minutes'."""
    accuracy_curve: list[tuple[int, float]] = field(default_factory=list)
    """(step, greedy held-out accuracy) at every evaluation."""
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    """(step, mean response-token cross-entropy since the previous point)."""
    cached: bool = False
    """True when returned from an existing finished checkpoint without training."""

    @property
    def in_band(self) -> bool:
        """Whether the run stopped inside the target accuracy band."""
        return self.stop_reason == "in_band"

    def to_json(self) -> str:
        """JSON text of every field."""
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> WarmStartReport:
        """Inverse of to_json."""
        data = json.loads(text)
        data["accuracy_curve"] = [tuple(p) for p in data.get("accuracy_curve", [])]
        data["loss_curve"] = [tuple(p) for p in data.get("loss_curve", [])]
        return cls(**data)


def read_warm_start(out_dir: str | Path) -> WarmStartReport | None:
    """The report of a finished warm start in `out_dir`, or None when there is none."""
    marker = Path(out_dir) / WARM_START_MARKER
    if not marker.is_file():
        return None
    try:
        report = WarmStartReport.from_json(marker.read_text())
    except (ValueError, TypeError) as exc:
        log.warning("ignoring unreadable warm-start marker %s: %s", marker, exc)
        return None
    report.cached = True
    return report


# ------------------------------------------------------------------ batching


def encode_supervised(
    tokenizer: PreTrainedTokenizerBase, prompt_text: str, response_text: str
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for one row: labels are IGNORE_INDEX on the prompt.

    The prompt is encoded with the tokenizer's special tokens (bos), the response
    without, and eos closes the response so the policy learns to stop.
    """
    prompt_ids = list(tokenizer(prompt_text)["input_ids"])
    response_ids = list(tokenizer(response_text, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is None:
        raise ValueError("warm start needs a tokenizer with an eos token")
    response_ids.append(int(tokenizer.eos_token_id))
    return prompt_ids + response_ids, [IGNORE_INDEX] * len(prompt_ids) + response_ids


def encode_segments(
    tokenizer: PreTrainedTokenizerBase, prompt_text: str, segments: Sequence[tuple[str, bool]]
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for a reference episode given as `(text, trained)` pieces.

    Untrained pieces (a tool's observation) are in the input, so the policy learns to
    read them, and IGNORE_INDEX in the labels, so it never learns to write them. Each
    piece is encoded on its own, as an episode appends each turn's tokens; eos closes
    the episode and is trained.
    """
    prompt_ids = list(tokenizer(prompt_text)["input_ids"])
    ids, labels = list(prompt_ids), [IGNORE_INDEX] * len(prompt_ids)
    for text, trained in segments:
        piece = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids += piece
        labels += piece if trained else [IGNORE_INDEX] * len(piece)
    if tokenizer.eos_token_id is None:
        raise ValueError("warm start needs a tokenizer with an eos token")
    ids.append(int(tokenizer.eos_token_id))
    labels.append(int(tokenizer.eos_token_id))
    return ids, labels


def encode_reference(
    tokenizer: PreTrainedTokenizerBase, problem: Problem, row: PromptRow
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a row's reference: its episode's pieces when the problem
    has them (`reference_segments`), else its reference response."""
    prompt_text = problem.format_prompt(row)
    segments = getattr(problem, "reference_segments", None)
    if callable(segments):
        return encode_segments(tokenizer, prompt_text, segments(row))
    reference = problem.reference_response(row)
    if reference is None:
        raise ValueError(
            f"warm start needs reference solutions; row {row.get('prompt_id')} has none"
        )
    return encode_supervised(tokenizer, prompt_text, reference)


def collate_supervised(
    examples: Sequence[tuple[list[int], list[int]]], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / attention_mask / labels tensors."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, labs) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(labs)] = torch.tensor(labs)
        attention_mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def response_token_loss_sum(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross-entropy over the response tokens of `batch`."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # Position t predicts token t+1.
    shifted_logits = logits[:, :-1, :].float()
    shifted_labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.shape[-1]),
        shifted_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def length_bucketed(
    examples: Sequence[tuple[list[int], list[int]]], max_tokens_per_micro_batch: int
) -> list[list[tuple[list[int], list[int]]]]:
    """Split `examples` into micro-batches of similar length, each at most the budget.

    Sorting by length before cutting keeps padding small: uniform problem sizes make
    the longest row of a random batch about twice the mean, so one padded batch would
    spend half its compute on padding.
    """
    ordered = sorted(examples, key=lambda e: len(e[0]), reverse=True)
    groups: list[list[tuple[list[int], list[int]]]] = []
    for example in ordered:
        # Rows only get shorter, so the first row of a group sets its padded width.
        if groups and len(groups[-1][0][0]) * (len(groups[-1]) + 1) <= max_tokens_per_micro_batch:
            groups[-1].append(example)
        else:
            groups.append([example])
    return groups


def supervised_step(
    model: PreTrainedModel,
    examples: Sequence[tuple[list[int], list[int]]],
    pad_token_id: int,
    max_tokens_per_micro_batch: int,
    device: str | torch.device = "cpu",
) -> float:
    """Accumulate gradients of the batch's mean response-token loss; return that mean.

    The denominator is the number of response tokens in the whole batch, so how the
    batch is cut into micro-batches never changes the gradient.
    """
    num_tokens = sum(sum(1 for t in labels[1:] if t != IGNORE_INDEX) for _, labels in examples)
    if num_tokens == 0:
        raise ValueError("supervised batch has no response tokens")
    total = 0.0
    for group in length_bucketed(examples, max_tokens_per_micro_batch):
        batch = {k: v.to(device) for k, v in collate_supervised(group, pad_token_id).items()}
        loss = response_token_loss_sum(model, batch) / num_tokens
        loss.backward()
        total += float(loss.detach())
    return total


# ------------------------------------------------------------------ the warm start


class WeightAverage:
    """Exponential moving average of the parameters (Polyak averaging).

    Evaluated and saved instead of the raw weights: at a constant learning rate the
    greedy accuracy of the raw weights flickers by +-10 points between evaluations
    (a handful of short prompts flip together), so a band test on raw weights stops
    on noise. The average moves smoothly and is usually at least as accurate.
    """

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0 <= decay < 1:
            raise ValueError(f"weight average decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Fold the current weights in; the effective decay ramps up over the first steps."""
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for name, param in model.named_parameters():
            self.shadow[name].lerp_(param.detach(), 1.0 - decay)

    @torch.no_grad()
    def swap(self, model: torch.nn.Module) -> None:
        """Exchange the model's weights with the average (call twice to undo)."""
        for name, param in model.named_parameters():
            held = param.detach().clone()
            param.copy_(self.shadow[name])
            self.shadow[name] = held


def warm_start(
    model_dir: str | Path,
    problem: Problem,
    *,
    steps: int = 4000,
    lr: float = 2e-3,
    batch_size: int = 16,
    seed: int = 0,
    max_minutes: float = 4.0,
    target_accuracy: float | tuple[float, float] | None = (0.2, 0.4),
    out_dir: str | Path,
    eval_every: int = 50,
    num_eval_prompts: int = 128,
    max_new_tokens: int = 224,
    warmup_steps: int = 20,
    weight_average_decay: float = 0.98,
    max_tokens_per_micro_batch: int = 2048,
    device: str | torch.device = "cpu",
    progress: Callable[[str], None] | None = None,
    episodes: EpisodeCheck | None = None,
) -> WarmStartReport:
    """Supervised pass from `model_dir` until greedy held-out accuracy enters the band.

    `target_accuracy` is a band (low, high) or a single low bound; training stops at
    the first evaluation at or above the low bound ('in_band', or 'above_band' when it
    jumped past `high`), or when `steps` or `max_minutes` run out. None trains exactly
    `steps` steps and evaluates once at the end (what a byte-for-byte rebuild needs:
    no check on the path decides where training ends). Every `eval_every`
    steps the exponential weight average (`weight_average_decay`, 0 = raw weights) is
    scored greedily on `num_eval_prompts` held-out prompts of the RL distribution;
    the weights that were scored last are saved to `out_dir` with the report. Returns
    at once with cached=True when `out_dir` already holds a finished warm start.

    Defaults were tuned for the embedded ~1M Llama on `longtail_sum` (AdamW, lr 2e-3
    after 20 warm-up steps, 16 rows/step): lr 5e-3 stalled on a loss plateau and
    8 rows/step learned slower per second than 16.

    With `episodes`, held-out accuracy is that of greedy multi-turn episodes, the tool
    answering each call (`evaluate_episodes_greedy`).
    """
    cached = read_warm_start(out_dir)
    if cached is not None:
        return cached
    fixed_steps = target_accuracy is None
    if target_accuracy is None:
        low, high = 0.0, 1.0
        eval_every = steps
    elif isinstance(target_accuracy, int | float):
        low, high = float(target_accuracy), 1.0
    else:
        low, high = target_accuracy
    if not 0 <= low <= high <= 1:
        raise ValueError(
            f"target_accuracy band must satisfy 0 <= low <= high <= 1, got {target_accuracy}"
        )
    for name, value in (("steps", steps), ("batch_size", batch_size), ("eval_every", eval_every)):
        if value < 1:
            raise ValueError(f"warm_start: {name} must be >= 1, got {value}")
    if lr <= 0 or max_minutes <= 0:
        raise ValueError("warm_start: lr and max_minutes must be positive")
    say = progress or log.info

    started = time.monotonic()
    deadline = float("inf") if fixed_steps else started + 60.0 * max_minutes
    model, tokenizer = load_policy_dir(model_dir, device=device)
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    rng = np.random.default_rng(seed)
    eval_rows = problem.sample_prompts(num_eval_prompts, seed + 1_000_003, split="test")
    eval_new_tokens = eval_token_cap(tokenizer, problem, eval_rows, max_new_tokens)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    average = WeightAverage(model, weight_average_decay) if weight_average_decay > 0 else None
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup_steps))
    )

    accuracy_curve: list[tuple[int, float]] = []
    loss_curve: list[tuple[int, float]] = []
    window: list[float] = []
    step = 0
    stop_reason = "max_steps"
    accuracy = 0.0
    model.train()
    while step < steps:
        rows = problem.sample_warmstart_prompts(batch_size, rng)
        examples = [encode_reference(tokenizer, problem, row) for row in rows]
        optimizer.zero_grad(set_to_none=True)
        loss = supervised_step(model, examples, pad_id, max_tokens_per_micro_batch, device)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if average is not None:
            average.update(model)
        step += 1
        window.append(loss)
        if fixed_steps and step % 100 == 0 and step < steps:
            spent = time.monotonic() - started
            say(
                f"warm start step {step}/{steps}: loss {np.mean(window[-100:]):.4f}, "
                f"{spent:.0f}s, about {spent / step * (steps - step):.0f}s left"
            )
        out_of_time = time.monotonic() >= deadline
        if step % eval_every == 0 or step == steps or out_of_time:
            loss_curve.append((step, float(np.mean(window))))
            window = []
            if average is not None:
                average.swap(model)  # evaluate the averaged weights ...
            if episodes is None:
                accuracy = evaluate_greedy(model, tokenizer, problem, eval_rows, eval_new_tokens)
            else:
                accuracy = evaluate_episodes_greedy(model, tokenizer, problem, eval_rows, episodes)
            reached = accuracy >= low and not fixed_steps
            stopping = reached or out_of_time or step == steps
            if average is not None and not stopping:
                average.swap(model)  # ... and train on the raw ones; at a stop, keep the average
            model.train()
            accuracy_curve.append((step, accuracy))
            spent = time.monotonic() - started
            say(
                f"warm start step {step}/{steps}: loss {loss_curve[-1][1]:.4f}, held-out "
                f"greedy accuracy {accuracy:.3f}, {spent:.0f}s, at most "
                f"{spent / step * (steps - step):.0f}s left"
            )
            if reached:
                stop_reason = "in_band" if accuracy <= high else "above_band"
                break
            if out_of_time:
                stop_reason = "max_minutes"
                break
    report = WarmStartReport(
        out_dir=str(out_dir),
        steps=step,
        examples_seen=step * batch_size,
        wall_time_s=round(time.monotonic() - started, 2),
        final_accuracy=accuracy,
        stop_reason=stop_reason,
        accuracy_curve=accuracy_curve,
        loss_curve=loss_curve,
    )
    _save_checkpoint(model, tokenizer, Path(out_dir), report)
    return report


def save_policy(model: torch.nn.Module, tokenizer: Any, out: Path) -> None:
    """`model` and its tokenizer (chat template included) as a Hugging Face directory,
    staged and renamed, so `out` is either absent or whole."""
    staging = out.parent / f".{out.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging, safe_serialization=True)  # type: ignore[operator]
    tokenizer.save_pretrained(staging)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


def _save_checkpoint(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path, report: WarmStartReport
) -> None:
    # Stage then rename, marker last: a crash leaves no directory that looks finished.
    model.eval()
    save_policy(model, tokenizer, out)
    (out / WARM_START_MARKER).write_text(report.to_json())
