"""One trainer step with the π_prox pass against without it, on a real model, side by side.

Arms, on one trainer built from the run config (default: the shipped ``reasoning_gym``
recipe) and the same seeded synthetic batch (``--samples`` responses of ``--response``
tokens after ``--prompt`` prompt tokens, random ids, behaviour log-probs from the model):

- **pass**: the no-grad π_prox pass over the whole batch first (what every step did
  before; what the Megatron backend and a model with dropout still do);
- **exact**: the first minibatch's own forward gives its π_prox; the other minibatches'
  samples get the pass (``trainer.loss.proximal: exact``, the default);
- **loglinear**: no pass (``proximal: loglinear``).

each at ``ppo_minibatches`` 1 and 2 (with 1, exact and loglinear are the same path, so
loglinear is left out). Arms take turns step by step, in an order that flips every
round, on the same torch threads; the first round warms up. The weights move with
every step (a real step each time); the batch stays fixed.

    python tests/benchmarks/bench_proximal_step.py --model DIR [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", default="reasoning_gym")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=60)
    parser.add_argument("--response", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from sluice.engines.rl.train_batch import TrainingSample
    from sluice.infra.config.run import load_config
    from sluice.tasks.train.factory import build_rank_trainer

    torch.set_num_threads(args.threads)
    config = load_config(args.config, [f"model.path={args.model}", *args.overrides])
    trainer = build_rank_trainer(config, args.model)
    base = trainer.settings
    rng = np.random.default_rng(0)
    vocab = trainer.model.config.vocab_size
    raw = [
        (rng.integers(100, vocab, args.prompt), rng.integers(100, vocab, args.response))
        for _ in range(args.samples)
    ]
    probes = [TrainingSample(p, r, np.zeros(len(r)), 0.0) for p, r in raw]
    behaviour = trainer.response_logprobs(probes)
    batch = [
        TrainingSample(p, r, b, float(rng.normal()))
        for (p, r), b in zip(raw, behaviour, strict=True)
    ]
    arms = [
        (f"{name} k={k}", free, proximal, k)
        for k in (1, 2)
        for name, free, proximal in (
            ("pass", False, "exact"),
            ("exact", True, "exact"),
            ("loglinear", True, "loglinear"),
        )
        if not (k == 1 and name == "loglinear")
    ]
    times: dict[str, list[dict[str, float]]] = {arm[0]: [] for arm in arms}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for name, free, proximal, k in arms if round_ % 2 == 0 else arms[::-1]:
            trainer.free_proximal = free
            trainer.settings = dataclasses.replace(base, proximal=proximal, ppo_minibatches=k)
            metrics = trainer.train_step(batch)
            if round_:
                times[name].append(metrics)
    print(
        f"machine: {platform.machine()}, torch {torch.__version__}, {args.threads} thread(s); "
        f"{args.model}; {args.config} {' '.join(args.overrides)}; {args.samples} samples x "
        f"({args.prompt} + {args.response}) tokens; {args.rounds} rounds, order flipped each"
    )
    print("| arm | s/step (median) | π_prox pass s (median) | pass tokens | pass s/step ÷ this |")
    print("|---|---|---|---|---|")
    step = {}
    for name, rows in times.items():
        step[name] = statistics.median(r["train/step_time_s"] for r in rows)
        proximal_s = statistics.median(r["train/proximal_time_s"] for r in rows)
        covered = rows[-1]["train/proximal_pass_tokens"]
        k = name.split("k=")[1]
        ratio = step[f"pass k={k}"] / step[name]
        print(f"| {name} | {step[name]:.2f} | {proximal_s:.2f} | {covered:.0f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
