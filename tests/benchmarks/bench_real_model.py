"""Benchmark: Sluice's engine vs Hugging Face ``generate()`` on a run's own prompts.

A run config (default: the shipped ``reasoning_gym`` config) and a model directory
(``--model``, e.g. SmolLM2-135M-Instruct imported with ``sluice model import``) give the
workload: ``--steps`` rollout batches of ``trainer.prompts_per_batch`` prompts from the
run's own prompt sequence (chat template, end tokens), each asked
``rollout.group_size`` times, ``rollout.max_new_tokens`` at most, at the run's
temperature. Both systems run in this process, on the same torch threads, one after the
other, in alternating order per batch (so a shared machine's load hits both alike):

- engine: ``InferenceEngine`` with the run's ``rollout.max_batch_size`` KV slots and
  ``rollout.max_seq_len``; a group's prompt is prefilled once and shared.
- HF: ``model.generate()`` on the batch as one left-padded static batch (each prompt
  repeated group-size times, as a plain synchronous RL loop does), SDPA attention,
  stopping each row at the same end tokens; the batch decodes until its last row ends.

Two workloads:
  same work: EOS ignored, every response exactly ``max_new_tokens`` tokens, so both
             systems produce the same number of tokens (throughput of the machinery);
  as sampled: each system samples and stops at the end tokens as a run does; tokens
             per second counts the tokens each returned (what a run gets).

    python tests/benchmarks/bench_real_model.py --model models/smollm2 [--steps 2 --threads 2]
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any

import torch


def _hf_batch(
    model: Any, tokenizer: Any, prompts: list[list[int]], params: dict[str, Any]
) -> tuple[int, float]:
    """(tokens returned, seconds) of one left-padded ``generate`` over `prompts`."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad, **params)
    seconds = time.perf_counter() - started
    new = out[:, width:]
    if params.get("min_new_tokens"):
        return int(new.numel()), seconds
    stops = set(params["eos_token_id"])
    tokens = 0
    for row in new.tolist():
        for token in row:
            tokens += 1
            if token in stops:
                break
    return tokens, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local HF model directory")
    parser.add_argument("--config", default="reasoning_gym", help="run config (name or path)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=2, help="rollout batches per workload")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from sluice.engines.inference.engine import InferenceEngine
    from sluice.engines.inference.types import GenerationRequest, SamplingParams
    from sluice.infra.config.run import load_config
    from sluice.tasks.prompts import PromptSource

    torch.set_num_threads(args.threads)
    config = load_config(args.config, [f"model.path={args.model}", *args.overrides])
    source = PromptSource(config).use_policy(args.model)
    B, G = config.trainer.prompts_per_batch, config.rollout.group_size
    rollout = config.rollout
    batches = [
        [source.train_prompt(step * B + g)[1] for g in range(B)] for step in range(args.steps)
    ]
    engine = InferenceEngine(
        args.model,
        max_batch_size=rollout.max_batch_size,
        max_seq_len=rollout.max_seq_len,
        seed=config.seed,
        num_threads=args.threads,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    print(
        f"model {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params; "
        f"{platform.processor() or platform.machine()}, torch threads {args.threads}"
    )
    print(
        f"workload: {args.steps} batches x {B} prompts x {G} samples, <= {rollout.max_new_tokens} "
        f"new tokens, temperature {rollout.temperature}; engine slots {rollout.max_batch_size}"
    )

    def engine_batch(prompts: list[list[int]], same_work: bool, seed: int) -> tuple[int, float]:
        requests = [
            GenerationRequest(
                prompt_token_ids=p,
                sampling=SamplingParams(
                    max_new_tokens=rollout.max_new_tokens,
                    temperature=rollout.temperature,
                    seed=seed * 1000 + i,
                    stop_token_ids=() if same_work else source.stop_token_ids,
                    ignore_eos=same_work,
                ),
            )
            for i, p in enumerate(prompts)
        ]
        started = time.perf_counter()
        outputs = engine.generate(requests)
        return sum(len(o.output_token_ids) for o in outputs), time.perf_counter() - started

    def hf_batch(prompts: list[list[int]], same_work: bool) -> tuple[int, float]:
        params: dict[str, Any] = {
            "do_sample": True,
            "temperature": rollout.temperature,
            "top_k": 0,
            "max_new_tokens": rollout.max_new_tokens,
            "eos_token_id": list(source.stop_token_ids),
        }
        if same_work:
            params["min_new_tokens"] = rollout.max_new_tokens
        return _hf_batch(model, source.tokenizer, prompts, params)

    # Warm-up at the full batch: the first big batch pays for allocations in both systems.
    warm = [p for p in batches[0] for _ in range(G)]
    engine_batch(warm, True, seed=99)
    hf_batch(warm, True)
    try:
        for same_work in (True, False):
            totals = {"engine": [0, 0.0], "hf": [0, 0.0]}
            for step, group_prompts in enumerate(batches):
                prompts = [p for p in group_prompts for _ in range(G)]
                order = ("engine", "hf") if step % 2 == 0 else ("hf", "engine")
                for who in order:
                    if who == "engine":
                        tokens, seconds = engine_batch(prompts, same_work, seed=step)
                    else:
                        tokens, seconds = hf_batch(prompts, same_work)
                    totals[who][0] += tokens
                    totals[who][1] += seconds
            rate = {who: t / s for who, (t, s) in totals.items()}
            label = "same work  " if same_work else "as sampled "
            print(
                f"{label}: engine {rate['engine']:7.1f} tok/s ({totals['engine'][0]} tokens, "
                f"{totals['engine'][1]:.1f} s) | HF generate {rate['hf']:7.1f} tok/s "
                f"({totals['hf'][0]} tokens, {totals['hf'][1]:.1f} s) | "
                f"engine / HF = {rate['engine'] / rate['hf']:.2f}x"
            )
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
