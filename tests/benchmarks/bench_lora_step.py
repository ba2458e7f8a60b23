"""One trainer step, full fine-tuning against LoRA, on a real model: where the time goes.

Both trainers are built from the same run config (default: the shipped ``reasoning_gym``
recipe: its PPO minibatches, micro-batch budget and loss) on the same model, and take
steps on the same seeded synthetic batch (``--samples`` responses of ``--response``
tokens after ``--prompt`` prompt tokens, random token ids, behaviour log-probs from the
model itself), alternating trainer by trainer, in this process and on the same torch
threads. Per trainer: seconds per step (median), of which the proximal pass
(``train/proximal_time_s``), and trained tokens per second.

    python tests/benchmarks/bench_lora_step.py --model DIR [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import statistics

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", default="reasoning_gym")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--lora-set", dest="lora", action="append", default=None)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=60)
    parser.add_argument("--response", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from sluice.engines.rl.train_batch import TrainingSample
    from sluice.infra.config.run import load_config
    from sluice.tasks.train.factory import build_rank_trainer

    torch.set_num_threads(args.threads)
    lora = args.lora or ["trainer.lora.rank=16", "trainer.lora.alpha=32", "trainer.lr=2e-4"]
    configs = {
        "full": load_config(args.config, [f"model.path={args.model}", *args.overrides]),
        "lora": load_config(args.config, [f"model.path={args.model}", *args.overrides, *lora]),
    }
    trainers = {name: build_rank_trainer(c, args.model) for name, c in configs.items()}
    rng = np.random.default_rng(0)
    vocab = trainers["full"].model.config.vocab_size
    raw = [
        (rng.integers(100, vocab, args.prompt), rng.integers(100, vocab, args.response))
        for _ in range(args.samples)
    ]
    probes = [TrainingSample(p, r, np.zeros(len(r)), 0.0) for p, r in raw]
    behaviour = trainers["full"].response_logprobs(probes)
    batch = [
        TrainingSample(p, r, b, float(rng.normal()))
        for (p, r), b in zip(raw, behaviour, strict=True)
    ]
    times: dict[str, list[dict[str, float]]] = {name: [] for name in trainers}
    for round_ in range(args.rounds + 1):  # the first round warms up
        names = list(trainers) if round_ % 2 == 0 else list(trainers)[::-1]
        for name in names:
            metrics = trainers[name].train_step(batch)
            if round_:
                times[name].append(metrics)
    tokens = args.samples * (args.prompt + args.response)
    print(
        f"machine: {platform.machine()}, torch {torch.__version__}, {args.threads} thread(s); "
        f"{args.model}; {args.config} {' '.join(args.overrides)}; lora: {' '.join(lora)}; "
        f"{args.samples} samples x ({args.prompt} + {args.response}) tokens; "
        f"{args.rounds} rounds alternating"
    )
    print("| trainer | s/step (median) | proximal pass s | trained tok/s |")
    print("|---|---|---|---|")
    step = {}
    for name, rows in times.items():
        step[name] = statistics.median(r["train/step_time_s"] for r in rows)
        proximal = statistics.median(r.get("train/proximal_time_s", float("nan")) for r in rows)
        print(f"| {name} | {step[name]:.2f} | {proximal:.2f} | {tokens / step[name]:.0f} |")
    print(f"lora / full seconds per step: {step['lora'] / step['full']:.2f}x")


if __name__ == "__main__":
    main()
