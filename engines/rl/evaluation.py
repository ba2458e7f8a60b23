"""Held-out metrics from scored responses: reward, pass@1, greedy accuracy, by problem size.

The held-out reward (`eval/reward`) is the mean reward of k samples per held-out prompt;
pass@1 is the fraction of those samples scored correct. With a greedy response per
prompt as well (laid out after that prompt's k samples), `eval/greedy_accuracy` says
whether the policy's single most likely answer improved; at temperature 0 the samples
are greedy already and pass@1 is that accuracy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

SIZE_BUCKETS = ((2, 2), (3, 4), (5, 8), (9, 16), (17, 1_000_000))
"""Problem sizes (the built-in task's `num_terms`) reported separately: RL gains and
losses are rarely spread evenly over easy and hard prompts."""


def heldout_metrics(
    rows: Sequence[dict[str, Any]],
    rewards: Sequence[float],
    lengths: Sequence[int],
    samples_per_prompt: int,
    with_greedy: bool,
    correct_reward: float,
    greedy_temperature: bool = False,
) -> dict[str, float]:
    """Metrics of one evaluation; `rewards` and `lengths` hold one entry per response.

    Responses come prompt by prompt: `samples_per_prompt` samples, then one greedy
    response when `with_greedy`. `greedy_temperature` says the samples were drawn at
    temperature 0, so pass@1 is the greedy accuracy.
    """
    k = samples_per_prompt
    per_prompt = k + int(with_greedy)
    sampled, correct, sampled_lengths, greedy_correct = [], [], [], []
    for n, reward in enumerate(rewards):
        if with_greedy and n % per_prompt == k:
            greedy_correct.append(reward >= correct_reward)
            continue
        sampled.append(reward)
        correct.append(reward >= correct_reward)
        sampled_lengths.append(lengths[n])
    metrics = {
        "eval/reward": float(np.mean(sampled)),
        "eval/pass_at_1": float(np.mean(correct)),
        "eval/response_length_mean": float(np.mean(sampled_lengths)),
        "eval/prompts": float(len(rows)),
    }
    metrics.update(reward_by_size(rows, sampled, k))
    if with_greedy:
        metrics["eval/greedy_accuracy"] = float(np.mean(greedy_correct))
    elif greedy_temperature:
        metrics["eval/greedy_accuracy"] = metrics["eval/pass_at_1"]
    return metrics


def reward_by_size(
    rows: Sequence[dict[str, Any]], rewards: Sequence[float], k: int
) -> dict[str, float]:
    """Held-out reward per size bucket, for rows that carry a `num_terms` size."""
    out: dict[str, float] = {}
    if not rows or any(not isinstance(r.get("num_terms"), int) for r in rows):
        return out
    for low, high in SIZE_BUCKETS:
        chosen = [
            rewards[i * k + j]
            for i, row in enumerate(rows)
            if low <= row["num_terms"] <= high
            for j in range(k)
        ]
        if chosen:
            name = f"{low}" if low == high else f"{low}-{high}" if high < 1_000_000 else f"{low}_up"
            out[f"eval/reward_terms_{name}"] = float(np.mean(chosen))
    return out
