"""Sluice's inference engine against transformers' own continuous batching on a CPU.

TRL generates on a CPU with transformers' continuous batching
(``ContinuousBatchingManager``: a paged KV cache, requests admitted as pages free up).
Both run here on the same model, in this process, one after the other per round
(``--rounds`` rounds, the order alternating, so a drift in the machine's load hits
both alike), on the same requests with EOS ignored (every response is exactly its
drawn length: the same useful work for both):

- **rollout**: the SmolLM2 rollout workload of ``reasoning_gym.yaml``: 8 prompts × 8
  samples = 64 responses of 48 tokens each, prompts of 40-80 tokens.
- **long tail**: 64 responses whose lengths are lognormal (median 24, clipped to
  [4, 192]), prompts of 16-64 tokens: one long answer must not hold up the rest.

Both sample at temperature 1 with ``--batch`` sequences decoded together (Sluice's KV
slots; transformers' ``max_requests_per_batch``), at most 512 tokens per forward and
``--threads`` torch threads.
Prints useful tokens per second for each and their ratio per workload (median over
rounds).

Run: ``python tests/benchmarks/bench_engine_vs_cb.py --model DIR [--rounds 3]
[--batch 64] [--threads 2]``
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sluice.engines.inference.engine import InferenceEngine  # noqa: E402
from sluice.engines.inference.types import GenerationRequest, SamplingParams  # noqa: E402


def rollout_workload(rng: np.random.Generator, vocab: int) -> list[tuple[list[int], int]]:
    out = []
    for _ in range(8):
        prompt = rng.integers(100, vocab, size=int(rng.integers(40, 81))).tolist()
        out += [(prompt, 48)] * 8
    return out


def long_tail_workload(rng: np.random.Generator, vocab: int) -> list[tuple[list[int], int]]:
    lengths = np.clip(rng.lognormal(math.log(24), 0.9, size=64), 4, 192).astype(int)
    return [
        (rng.integers(100, vocab, size=int(rng.integers(16, 65))).tolist(), int(n)) for n in lengths
    ]


def run_sluice(engine: InferenceEngine, work: list[tuple[list[int], int]]) -> tuple[int, float]:
    requests = [
        GenerationRequest(
            prompt, SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, seed=i)
        )
        for i, (prompt, n) in enumerate(work)
    ]
    started = time.perf_counter()
    outputs = engine.generate(requests)
    elapsed = time.perf_counter() - started
    return sum(len(o.output_token_ids) for o in outputs), elapsed


def run_cb(manager: object, work: list[tuple[list[int], int]], never: int) -> tuple[int, float]:
    started = time.perf_counter()
    ids = [
        manager.add_request(prompt, max_new_tokens=n, eos_token_id=never)  # type: ignore[attr-defined]
        for prompt, n in work
    ]
    produced, waiting = 0, set(ids)
    deadline = time.monotonic() + 600
    while waiting:  # results come in finishing order, from one queue
        result = manager.get_result(timeout=1.0)  # type: ignore[attr-defined]
        if result is not None and result.request_id in waiting:
            waiting.discard(result.request_id)
            produced += len(result.generated_tokens)
        if time.monotonic() > deadline:
            raise SystemExit(f"transformers' continuous batching did not finish {sorted(waiting)}")
    return produced, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    engine = InferenceEngine(
        args.model, max_batch_size=args.batch, max_seq_len=512, num_threads=args.threads
    )
    vocab = int(engine.model.config.vocab_size)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    never = vocab + 7  # an id no sampled token can be: EOS ignored, as on Sluice's side
    generation = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=192
    )
    manager = model.init_continuous_batching(
        generation_config=generation,
        # Sized like Sluice's side: a KV cache for every request of a workload (72
        # pages of 256 tokens; left to itself it sizes the cache by free memory, took
        # 13 GB here and stalled) and 512 tokens per forward, Sluice's CPU prefill chunk.
        continuous_batching_config=ContinuousBatchingConfig(
            max_requests_per_batch=args.batch, seed=0, num_blocks=72, max_batch_tokens=512
        ),
    )
    manager.start()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"transformers {transformers.__version__}; model {args.model}; batch {args.batch}, "
        f"threads {args.threads}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    rng = np.random.default_rng(0)
    workloads = {
        "rollout": rollout_workload(rng, vocab),
        "long tail": long_tail_workload(rng, vocab),
    }
    # one warm-up each: first-call costs (allocation, kernels) are not throughput
    for work in workloads.values():
        run_sluice(engine, work[:8])
        run_cb(manager, work[:8], never)
    rates: dict[str, dict[str, list[float]]] = {w: {"sluice": [], "cb": []} for w in workloads}
    try:
        for round_ in range(args.rounds):
            for name, work in workloads.items():
                order = ["sluice", "cb"] if round_ % 2 == 0 else ["cb", "sluice"]
                for system in order:
                    if system == "sluice":
                        tokens, seconds = run_sluice(engine, work)
                    else:
                        tokens, seconds = run_cb(manager, work, never)
                    expected = sum(n for _, n in work)
                    if tokens != expected:
                        print(f"note: {system} produced {tokens} tokens of {expected} ({name})")
                    rates[name][system].append(tokens / seconds)
                    print(
                        f"round {round_} {name:9s} {system:6s} {tokens} tokens in {seconds:.2f} s "
                        f"= {tokens / seconds:.1f} tok/s",
                        flush=True,
                    )
    finally:
        manager.stop(block=True, timeout=30)
        engine.shutdown()
    print("\n| workload | Sluice engine tok/s | transformers CB tok/s | Sluice / CB |")
    print("|---|---|---|---|")
    for name, by in rates.items():
        ours, theirs = statistics.median(by["sluice"]), statistics.median(by["cb"])
        print(f"| {name} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f} |")


if __name__ == "__main__":
    main()
