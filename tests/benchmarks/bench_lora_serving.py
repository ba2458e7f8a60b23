"""Serving a LoRA version: folded into the weights, or applied at run time? Measured.

Sluice's engine folds each adapter into the base (W + alpha/r · B A) when it loads it, so
decoding costs what it costs without LoRA, and a load costs the fold. The alternative
keeps the base and computes x W + (alpha/r) · (x A) B in every adapted layer, every
step (PEFT's unmerged forward; SGLang's LoRA kernels do the same batched). This script
measures both on one model, side by side in one process, alternating rounds:

- decode: a batch of sequences decoding with a KV cache, seconds per step, for the
  plain model (what the folded adapter costs) and the PEFT-wrapped model;
- prefill: one forward over the batch's prompts, same two models;
- load: folding an adapter into the base (``merged_weights``) against reading the whole
  model's safetensors (what a full version's update reads).

    python tests/benchmarks/bench_lora_serving.py --model DIR [--rank 16] [--batch 32]
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from sluice.engines.inference.weights import read_weight_files
    from sluice.engines.policy.adapter import merged_weights, read_adapter
    from sluice.engines.rl.lora import LoraSettings, apply_lora, save_adapter

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).eval()
    settings = LoraSettings(rank=args.rank, alpha=2 * args.rank)
    adapted = apply_lora(copy.deepcopy(plain), settings).eval()
    with torch.no_grad():  # a trained adapter's B is not 0 (the cost is the same either way)
        for name, parameter in adapted.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0.0, 0.01)
    ids = torch.randint(100, 1000, (args.batch, args.prompt))

    def prefill_and_decode(model: torch.nn.Module) -> tuple[float, float]:
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True)
            prefill = time.perf_counter() - t0
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            return prefill, (time.perf_counter() - t0) / args.steps

    times: dict[str, list[tuple[float, float]]] = {"folded": [], "run-time": []}
    prefill_and_decode(plain)  # warm-up
    for round_ in range(args.rounds):
        order = [("folded", plain), ("run-time", adapted)]
        for name, model in order if round_ % 2 == 0 else order[::-1]:
            times[name].append(prefill_and_decode(model))

    with tempfile.TemporaryDirectory() as scratch:
        save_adapter(adapted, Path(scratch) / "adapter")
        loads: dict[str, list[float]] = {"fold adapter": [], "read full model": []}
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            base = read_weight_files(args.model)
            loads["read full model"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            merged_weights(base, read_adapter(Path(scratch) / "adapter"))
            loads["fold adapter"].append(time.perf_counter() - t0)
        adapter_mb = (Path(scratch) / "adapter" / "adapter_model.safetensors").stat().st_size / 1e6

    print(
        f"machine: {platform.machine()}, torch {torch.__version__}, {args.threads} thread(s); "
        f"{args.model}: rank {args.rank} on {', '.join(settings.target_modules)} "
        f"({adapter_mb:.1f} MB); batch {args.batch} x {args.prompt} prompt tokens, "
        f"{args.steps} decode steps, {args.rounds} rounds alternating"
    )
    print("| serving | prefill s (median) | decode s/step (median) |")
    print("|---|---|---|")
    for name, rows in times.items():
        print(
            f"| {name} | {statistics.median(p for p, _ in rows):.3f} | "
            f"{statistics.median(d for _, d in rows):.4f} |"
        )
    decode = {k: statistics.median(d for _, d in v) for k, v in times.items()}
    print(f"run-time / folded decode step: {decode['run-time'] / decode['folded']:.2f}x")
    for name, values in loads.items():
        print(f"{name}: {statistics.median(values):.3f} s (median)")


if __name__ == "__main__":
    main()
