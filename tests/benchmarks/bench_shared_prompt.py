"""One trainer step with each prompt packed once per group against once per response.

Two trainers built from the same run config (default: ``reasoning_gym_mix``, with its
PPO minibatches, micro-batch budget and loss), one with ``trainer.shared_prompt=true``,
take steps on the same seeded synthetic batch: ``--groups`` prompts of ``--prompt``
random tokens, each with ``--group-size`` responses of 1 to 2 x ``--response`` tokens
(uniform), behaviour log-probs from the model itself. They alternate step by step, in an
order that flips every round, on the same torch threads; the first round warms up.
Per trainer: seconds per step (median), tokens run through the model per step
(``train/packed_tokens``), and the loss of the last round (the two should agree to
float tolerance: the same update).

    python tests/benchmarks/bench_shared_prompt.py --model DIR [--rounds 3] [--threads 2]
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
    parser.add_argument("--config", default="reasoning_gym_mix")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=54)
    parser.add_argument("--response", type=int, default=14)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from sluice.engines.rl.train_batch import TrainingSample
    from sluice.infra.config.run import load_config
    from sluice.tasks.train.factory import build_rank_trainer

    torch.set_num_threads(args.threads)
    base = [f"model.path={args.model}", *args.overrides]
    trainers = {
        name: build_rank_trainer(
            load_config(args.config, [*base, f"trainer.shared_prompt={on}"]), args.model
        )
        for name, on in (("per response", "false"), ("shared", "true"))
    }
    rng = np.random.default_rng(0)
    vocab = trainers["shared"].model.config.vocab_size
    raw = []
    for _ in range(args.groups):
        prompt = rng.integers(100, vocab, args.prompt)
        for _ in range(args.group_size):
            raw.append((prompt, rng.integers(100, vocab, int(rng.integers(1, 2 * args.response)))))
    probes = [TrainingSample(p, r, np.zeros(len(r)), 0.0) for p, r in raw]
    behaviour = trainers["per response"].response_logprobs(probes)
    batch = [
        TrainingSample(p, r, b, float(rng.normal()))
        for (p, r), b in zip(raw, behaviour, strict=True)
    ]
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in trainers}
    for round_ in range(args.rounds + 1):  # the first round warms up
        names = list(trainers) if round_ % 2 == 0 else list(trainers)[::-1]
        for name in names:
            metrics = trainers[name].train_step(batch)
            if round_:
                rows[name].append(metrics)
    responses = sum(len(r) for _, r in raw)
    print(
        f"machine: {platform.machine()}, torch {torch.__version__}, {args.threads} thread(s); "
        f"{args.model}; {args.config} {' '.join(args.overrides)}; {args.groups} groups x "
        f"{args.group_size} responses, prompts of {args.prompt} tokens, {responses} response "
        f"tokens; {args.rounds} rounds alternating"
    )
    print("| packing | s/step (median) | packed tokens/step | last loss |")
    print("|---|---|---|---|")
    step = {}
    for name, measured in rows.items():
        step[name] = statistics.median(r["train/step_time_s"] for r in measured)
        packed = measured[-1]["train/packed_tokens"]
        loss = measured[-1]["loss/policy_loss"]
        print(f"| {name} | {step[name]:.2f} | {packed:.0f} | {loss:.6f} |")
    print(f"per response / shared seconds per step: {step['per response'] / step['shared']:.2f}x")


if __name__ == "__main__":
    main()
