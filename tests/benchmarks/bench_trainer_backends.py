"""Benchmark: trained tokens per second of the torch and Megatron trainer backends.

Both train the same policy (the shipped default unless ``--model-dir``) on the same
synthetic batches, shaped like the built-in task's (``--samples`` responses of
lognormal length, median ``--median-len``, capped at ``--max-len``, after 20-token
prompts), with the default recipe's trainer settings (2 PPO minibatches, token-level
TIS). Steps alternate between the backends so the load of a shared machine hits both
alike; the first step of each is a warm-up and is not timed.

    python tests/benchmarks/bench_trainer_backends.py [--steps 6 --threads 1]
"""

from __future__ import annotations

import argparse
import math
import platform
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from engines.loss import make_policy_loss
from engines.rollout_correction import make_rollout_correction
from engines.trainer import PolicyTrainer, TrainerSettings, TrainingSample

SHIPPED = Path(__file__).resolve().parents[2] / "engines" / "policies" / "longtail_sum-llama-0.9m"


def batch(rng: np.random.Generator, n: int, median: int, longest: int) -> list[TrainingSample]:
    lengths = np.clip(rng.lognormal(math.log(median), 0.8, size=n), 2, longest).astype(int)
    return [
        TrainingSample(
            rng.integers(3, 30, 20),
            rng.integers(3, 30, int(length)),
            (-2.0 + 0.1 * rng.normal(size=int(length))).astype(np.float32),
            float(rng.normal()),
        )
        for length in lengths
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=SHIPPED)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--median-len", type=int, default=40)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)  # megatron-core without TE/Apex
    from engines.megatron.trainer import MegatronPolicyTrainer

    torch.set_num_threads(args.threads)
    settings = TrainerSettings(ppo_minibatches=2, lr=1e-4, max_tokens_per_micro_batch=8192)
    trainers = {
        name: cls(
            args.model_dir,
            settings,
            make_policy_loss(),
            make_rollout_correction(mode="token_tis"),
        )
        for name, cls in (("torch", PolicyTrainer), ("megatron", MegatronPolicyTrainer))
    }
    rng = np.random.default_rng(0)
    batches = [
        batch(rng, args.samples, args.median_len, args.max_len) for _ in range(args.steps + 1)
    ]
    tokens = dict.fromkeys(trainers, 0.0)
    seconds = dict.fromkeys(trainers, 0.0)
    for step, samples in enumerate(batches):
        for name, trainer in trainers.items():
            started = time.perf_counter()
            metrics = trainer.train_step(samples)
            if step:  # the first step of each backend warms up
                seconds[name] += time.perf_counter() - started
                tokens[name] += metrics["train/trained_tokens"]
    print(
        f"machine: {platform.machine()}, torch {torch.__version__}, threads {args.threads}; "
        f"model {args.model_dir.name}; {args.steps} timed steps of {args.samples} samples "
        f"(median response {args.median_len}, max {args.max_len}), steps interleaved"
    )
    print("| backend | trained tokens/s | seconds per step |")
    print("|---|---|---|")
    for name in trainers:
        print(
            f"| {name} | {tokens[name] / seconds[name]:,.0f} | {seconds[name] / args.steps:.2f} |"
        )
    ratio = (tokens["megatron"] / seconds["megatron"]) / (tokens["torch"] / seconds["torch"])
    print(f"megatron / torch: {ratio:.2f}x")


if __name__ == "__main__":
    main()
