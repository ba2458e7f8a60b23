"""Held-out metrics from scored responses: reward, pass@1, pass@k, greedy accuracy, by
problem size.

The held-out reward (`eval/reward`) is the mean reward of k samples per held-out prompt;
pass@1 is the fraction of those samples scored correct. pass@k (`pass_at_k`) is the
chance that at least one of k samples is correct, estimated without bias from all n
samples of each prompt (Chen et al. 2021, eq. 1). With a greedy response per prompt as
well (laid out after that prompt's k samples), `eval/greedy_accuracy` says whether the
policy's single most likely answer improved; at temperature 0 the samples are greedy
already and pass@1 is that accuracy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

SIZE_BUCKETS = ((2, 2), (3, 4), (5, 8), (9, 16), (17, 1_000_000))
"""Problem sizes (the built-in task's `num_terms`) reported separately: RL gains and
losses are rarely spread evenly over easy and hard prompts."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from `n` samples of which `c` are correct (Chen et
    al. 2021, eq. 1): 1 - C(n - c, k) / C(n, k), the chance that k samples drawn without
    replacement from the n include a correct one. Computed as the product
    1 - prod_{i=n-c+1..n} (1 - k / i), which never forms the huge binomials."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def heldout_metrics(
    rows: Sequence[dict[str, Any]],
    rewards: Sequence[float],
    lengths: Sequence[int],
    samples_per_prompt: int,
    with_greedy: bool,
    correct_reward: float,
    greedy_temperature: bool = False,
    pass_at: Sequence[int] = (),
) -> dict[str, float]:
    """Metrics of one evaluation; `rewards` and `lengths` hold one entry per response.

    Responses come prompt by prompt: `samples_per_prompt` samples, then one greedy
    response when `with_greedy`. `greedy_temperature` says the samples were drawn at
    temperature 0, so pass@1 is the greedy accuracy. `pass_at` lists the k of
    `eval/pass_at_{k}`, the mean over prompts of `pass_at_k` (each k at most
    `samples_per_prompt`; for k = 1 that mean is `eval/pass_at_1`).
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
    correct_per_prompt = [sum(correct[i : i + k]) for i in range(0, len(correct), k)]
    for at in sorted(set(pass_at) - {1}):  # pass@1 is above, as a plain mean
        passed = [pass_at_k(k, c, at) for c in correct_per_prompt]
        metrics[f"eval/pass_at_{at}"] = float(np.mean(passed))
        for name, members in size_buckets(rows).items():
            metrics[f"eval/pass_at_{at}_terms_{name}"] = float(
                np.mean([passed[i] for i in members])
            )
    if with_greedy:
        metrics["eval/greedy_accuracy"] = float(np.mean(greedy_correct))
    elif greedy_temperature:
        metrics["eval/greedy_accuracy"] = metrics["eval/pass_at_1"]
    return metrics


def size_buckets(rows: Sequence[dict[str, Any]]) -> dict[str, list[int]]:
    """The indices of `rows` in each non-empty size bucket, by the bucket's name (`2`,
    `3-4`, `17_up`); {} unless every row carries a `num_terms` size."""
    if not rows or any(not isinstance(r.get("num_terms"), int) for r in rows):
        return {}
    out: dict[str, list[int]] = {}
    for low, high in SIZE_BUCKETS:
        members = [i for i, row in enumerate(rows) if low <= row["num_terms"] <= high]
        if members:
            name = f"{low}" if low == high else f"{low}-{high}" if high < 1_000_000 else f"{low}_up"
            out[name] = members
    return out


def reward_by_size(
    rows: Sequence[dict[str, Any]], rewards: Sequence[float], k: int
) -> dict[str, float]:
    """Held-out reward per size bucket, for rows that carry a `num_terms` size."""
    return {
        f"eval/reward_terms_{name}": float(
            np.mean([rewards[i * k + j] for i in members for j in range(k)])
        )
        for name, members in size_buckets(rows).items()
    }
