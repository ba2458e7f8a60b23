"""A timed supervised pass over a user's model: the first stage of SFT-then-RL.

The caller supplies the rows, `(input_ids, labels)` with IGNORE_INDEX wherever no loss
is taken (the prompt), so this module knows nothing of prompts or tasks. The pass
trains every weight with AdamW (constant learning rate, no weight decay, gradient norm
clipped at 1) on the mean cross-entropy of the labelled tokens of each batch, until
its minutes or its step cap run out, and saves the result with the model's tokenizer
(chat template included) and generation config, so the directory serves and trains
like the one it came from.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sluice.engines.policy.model import load_policy_dir
from sluice.engines.policy.warmstart import save_policy, supervised_step

log = logging.getLogger(__name__)

Example = tuple[list[int], list[int]]


@dataclass
class SupervisedReport:
    """What a supervised pass did."""

    steps: int
    """Optimizer steps taken."""
    rows: int
    """Rows trained on (steps x batch size)."""
    wall_time_s: float
    """Seconds from loading the model to the saved result."""
    stopped_by: str
    """`minutes` or `max_steps`."""
    loss_by_minute: list[float] = field(default_factory=list)
    """Mean loss of the steps that ended in each minute of the pass."""

    def facts(self) -> dict[str, Any]:
        """The report as flat values (registry tags, logs)."""
        data = asdict(self)
        losses = data.pop("loss_by_minute")
        if losses:
            data["loss_first_minute"], data["loss_last_minute"] = losses[0], losses[-1]
        return data


def supervised_pass(
    model_dir: str | Path,
    examples: Iterator[Example],
    out_dir: str | Path,
    *,
    minutes: float,
    lr: float,
    batch_size: int,
    max_steps: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    max_tokens_per_micro_batch: int = 2048,
    progress: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> SupervisedReport:
    """Train `model_dir` on `examples` for `minutes` (or `max_steps` steps, whichever ends
    first; at least one step) and save the result to `out_dir`."""
    if not minutes > 0 or not lr > 0 or batch_size < 1:
        raise ValueError(
            f"supervised pass: minutes and lr must be > 0 and batch_size >= 1, got "
            f"{minutes}, {lr}, {batch_size}"
        )
    say = progress or log.info
    started = clock()
    torch.manual_seed(seed)
    model, tokenizer = load_policy_dir(model_dir, device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(f"supervised pass: the tokenizer of '{model_dir}' has no pad or end token")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    deadline = started + 60.0 * minutes
    steps = 0
    losses: list[float] = []
    minute: list[float] = []
    stopped_by = "minutes"
    while True:
        batch = [next(examples) for _ in range(batch_size)]
        optimizer.zero_grad(set_to_none=True)
        minute.append(supervised_step(model, batch, pad, max_tokens_per_micro_batch, device))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        steps += 1
        now = clock()
        if now - started >= 60.0 * (len(losses) + 1) or now >= deadline:
            losses.append(sum(minute) / len(minute))
            minute = []
            say(f"supervised pass: step {steps}, minute {len(losses)}, loss {losses[-1]:.4f}")
        if now >= deadline:
            break
        if max_steps is not None and steps >= max_steps:
            stopped_by = "max_steps"
            if minute:
                losses.append(sum(minute) / len(minute))
            break
    model.eval()
    save_policy(model, tokenizer, Path(out_dir))
    report = SupervisedReport(
        steps=steps,
        rows=steps * batch_size,
        wall_time_s=round(clock() - started, 2),
        stopped_by=stopped_by,
        loss_by_minute=losses,
    )
    # The caller (a run's flow process) lives on for the whole run: the weights, gradients
    # and AdamW state go back to the device rather than staying in torch's CUDA cache
    # beside the roles (6.6 GB for SmolLM2-135M on an H200).
    del model, optimizer
    if torch.device(device).type == "cuda":
        gc.collect()  # a module graph may hold cycles
        torch.cuda.empty_cache()
    return report
