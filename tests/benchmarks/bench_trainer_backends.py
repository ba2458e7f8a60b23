"""Benchmark: trained tokens per second of the torch and Megatron trainer backends.

Both train the same policy (the shipped default unless ``--model-dir``) on the same
synthetic batches, shaped like the built-in task's (``--samples`` responses of
lognormal length, median ``--median-len``, capped at ``--max-len``, after 20-token
prompts), with the default recipe's trainer settings (2 PPO minibatches, token-level
TIS). Steps alternate between the backends so the load of a shared machine hits both
alike; the first step of each is a warm-up and is not timed.

Then each two-process Megatron layout in ``--layouts`` (tensor, pipeline or data
parallel 2, gloo on loopback, one thread per rank) trains the same batches, one layout
after the other (they cannot interleave with the in-process pair), and is reported
against the torch backend's one-process rate from the first phase.

    python tests/benchmarks/bench_trainer_backends.py [--steps 6 --threads 1 --layouts tp2 pp2 dp2]
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

from sluice.engines.rl.loss import make_policy_loss
from sluice.engines.rl.rollout_correction import make_rollout_correction
from sluice.engines.rl.train_batch import TrainerSettings, TrainingSample
from sluice.engines.rl.trainer import PolicyTrainer

SHIPPED = (
    Path(__file__).resolve().parents[2]
    / "engines"
    / "policy"
    / "policies"
    / "longtail_sum-llama-0.9m"
)


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


# (tensor, pipeline, data) sizes of each two-process layout.
LAYOUTS = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "dp2": (1, 1, 2)}


def layout_rank(rank: int, layout: str, port: int, args: argparse.Namespace, out: str) -> None:
    """One rank of a two-process layout; rank 0 writes ``(tokens, seconds)`` to ``out``."""
    import os

    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2"})
    torch.set_num_threads(1)
    from sluice.engines.megatron.trainer import MegatronPolicyTrainer

    tp, pp, dp = LAYOUTS[layout]
    trainer = MegatronPolicyTrainer(
        args.model_dir,
        SETTINGS,
        make_policy_loss(),
        make_rollout_correction(mode="token_tis"),
        tensor_parallel=tp,
        pipeline_parallel=pp,
        data_parallel=dp,
    )
    tokens = seconds = 0.0
    for step, samples in enumerate(batches(args)):
        torch.distributed.barrier()
        started = time.perf_counter()
        metrics = trainer.train_step(samples)
        if step:
            seconds += time.perf_counter() - started
            tokens += metrics["train/trained_tokens"]
    if rank == 0:
        Path(out).write_text(f"{tokens} {seconds}")
    torch.distributed.destroy_process_group()


def run_layout(layout: str, args: argparse.Namespace) -> tuple[float, float]:
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result")
        mp.start_processes(
            layout_rank, args=(layout, port, args, out), nprocs=2, start_method="spawn"
        )
        tokens, seconds = map(float, Path(out).read_text().split())
    return tokens, seconds


SETTINGS = TrainerSettings(ppo_minibatches=2, lr=1e-4, max_tokens_per_micro_batch=8192)


def batches(args: argparse.Namespace) -> list[list[TrainingSample]]:
    rng = np.random.default_rng(0)
    return [batch(rng, args.samples, args.median_len, args.max_len) for _ in range(args.steps + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=SHIPPED)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--median-len", type=int, default=40)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)  # megatron-core without TE/Apex
    from sluice.engines.megatron.trainer import MegatronPolicyTrainer

    torch.set_num_threads(args.threads)
    trainers = {
        name: cls(
            args.model_dir,
            SETTINGS,
            make_policy_loss(),
            make_rollout_correction(mode="token_tis"),
        )
        for name, cls in (("torch", PolicyTrainer), ("megatron", MegatronPolicyTrainer))
    }
    tokens = dict.fromkeys(trainers, 0.0)
    seconds = dict.fromkeys(trainers, 0.0)
    for step, samples in enumerate(batches(args)):
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
    del trainers  # their memory is freed before the layouts' processes start
    for layout in args.layouts:
        name = f"megatron {layout}"
        tokens[name], seconds[name] = run_layout(layout, args)
    torch_rate = tokens["torch"] / seconds["torch"]
    print("| backend | processes | trained tokens/s | seconds per step | vs torch |")
    print("|---|---|---|---|---|")
    for name in tokens:
        rate = tokens[name] / seconds[name]
        processes = 2 if name.startswith("megatron ") else 1
        print(
            f"| {name} | {processes} | {rate:,.0f} | {seconds[name] / args.steps:.2f} "
            f"| {rate / torch_rate:.2f}x |"
        )


if __name__ == "__main__":
    main()
