"""Benchmark: dynamic micro-batching (packed, no padding) vs a fixed number of padded micro-batches.

Trains a small causal LM (Hugging Face Llama architecture, random init) on CPU on one
long-tailed batch of sequences, the same number of optimizer steps each way, under the
same memory cap: at most ``--max-tokens`` tokens per micro-batch *including padding*.

- dynamic: :func:`sluice.engines.rl.batching.dynamic_micro_batches` (AReaL Algorithm 1), each
  micro-batch packed into one row and run with varlen attention (per-sequence causal
  SDPA from ``cu_seqlens``), no padding anywhere.
- fixed: the batch split in its given order into the fewest equal-count slices whose
  padded size fits the cap, each right-padded to its longest sequence.

Both compute the same loss (token-mean next-token cross-entropy over the global batch)
from the same initial weights; the first-step losses are printed as a sanity check.
Steps alternate between the two so machine load hits both alike. Prints tokens/s
(real, unpadded tokens) for each and the ratio.

    python tests/benchmarks/bench_microbatching.py [--num-seqs 128 --steps 3 --threads 1]
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sluice.engines.rl.batching import (
    dynamic_micro_batches,
    fixed_micro_batches,
    pack_sequences,
    pad_sequences,
    padded_tokens,
    register_packed_attention,
)


def long_tailed_lengths(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[int]:
    """Lognormal lengths clipped to [lo, hi]: most short, a few near the maximum."""
    raw = rng.lognormal(mean=math.log(96), sigma=1.0, size=n)
    lengths = np.clip(raw.astype(int), lo, hi)
    lengths[rng.integers(n)] = hi  # the tail always reaches the cap, as in a real batch
    return lengths.tolist()


def fewest_fixed_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """The fewest equal-count slices whose padded size stays within the cap."""
    for count in range(1, len(lengths) + 1):
        mbs = fixed_micro_batches(lengths, count)
        if max(padded_tokens(mbs, lengths)) <= max_tokens:
            return mbs
    raise ValueError(f"a single sequence exceeds --max-tokens {max_tokens}")


def dynamic_step(
    model: LlamaForCausalLM,
    seqs: list[torch.Tensor],
    micro_batches: list[list[int]],
    n_targets: int,
) -> float:
    total = 0.0
    for mb in micro_batches:
        packed = pack_sequences([seqs[i] for i in mb])
        logits = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            **packed.attention_kwargs(),
        ).logits[0]
        ids = packed.input_ids[0]
        # Predict token t+1 from t only inside a sequence: the last token of each has no target.
        has_target = torch.ones_like(ids, dtype=torch.bool)
        has_target[packed.cu_seqlens[1:].long() - 1] = False
        targets = torch.roll(ids, -1)
        loss = torch.nn.functional.cross_entropy(
            logits[has_target], targets[has_target], reduction="sum"
        )
        (loss / n_targets).backward()
        total += float(loss.detach())
    return total / n_targets


def fixed_step(
    model: LlamaForCausalLM,
    seqs: list[torch.Tensor],
    micro_batches: list[list[int]],
    n_targets: int,
) -> float:
    total = 0.0
    for mb in micro_batches:
        input_ids, attention_mask = pad_sequences([seqs[i] for i in mb])
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        targets = input_ids[:, 1:]
        has_target = attention_mask[:, 1:].bool()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1][has_target], targets[has_target], reduction="sum"
        )
        (loss / n_targets).backward()
        total += float(loss.detach())
    return total / n_targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-seqs", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=2048, help="tokens per micro-batch cap")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per method")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads; 1 keeps OpenMP from thrashing on a shared 2-core machine",
    )
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    lengths = long_tailed_lengths(rng, args.num_seqs, args.min_len, args.max_len)
    vocab = 64
    seqs = [torch.from_numpy(rng.integers(1, vocab, size=n)) for n in lengths]
    n_tokens = sum(lengths)
    n_targets = n_tokens - len(lengths)

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=args.max_len,
    )
    base = LlamaForCausalLM(config)
    dyn_model = copy.deepcopy(base)
    dyn_model.set_attn_implementation(register_packed_attention())
    fix_model = copy.deepcopy(base)
    fix_model.set_attn_implementation("sdpa")
    dyn_opt = torch.optim.AdamW(dyn_model.parameters(), lr=1e-3)
    fix_opt = torch.optim.AdamW(fix_model.parameters(), lr=1e-3)

    dyn_mbs = dynamic_micro_batches(lengths, args.max_tokens)
    fix_mbs = fewest_fixed_micro_batches(lengths, args.max_tokens)
    fix_padded = sum(padded_tokens(fix_mbs, lengths))

    arr = np.array(lengths)
    print(
        f"machine: {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}"
    )
    print(
        f"batch: {len(lengths)} seqs, {n_tokens} tokens, lengths p50 {int(np.median(arr))} "
        f"p90 {int(np.percentile(arr, 90))} p99 {int(np.percentile(arr, 99))} max {arr.max()} "
        f"(p99/p50 {np.percentile(arr, 99) / np.median(arr):.1f})"
    )
    print(
        f"model: Llama hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocab {vocab}, "
        f"{sum(p.numel() for p in base.parameters()) / 1e6:.2f}M params; cap {args.max_tokens} "
        "tokens per micro-batch incl. padding"
    )
    print(
        f"dynamic: {len(dyn_mbs)} micro-batches, max {max(sum(lengths[i] for i in mb) for mb in dyn_mbs)} "
        f"tokens, padding 0%"
    )
    print(
        f"fixed:   {len(fix_mbs)} micro-batches, max {max(padded_tokens(fix_mbs, lengths))} padded "
        f"tokens, padding {100 * (1 - n_tokens / fix_padded):.0f}%"
    )

    runs = {
        "dynamic": (dyn_model, dyn_opt, dynamic_step, dyn_mbs),
        "fixed": (fix_model, fix_opt, fixed_step, fix_mbs),
    }
    seconds = {name: 0.0 for name in runs}
    first_loss: dict[str, float] = {}
    for step in range(args.steps + 1):  # step 0 warms up allocators and is not timed
        for name, (model, opt, step_fn, mbs) in runs.items():
            start = time.perf_counter()
            loss = step_fn(model, seqs, mbs, n_targets)
            opt.step()
            opt.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - start
            if step == 0:
                first_loss[name] = loss
            else:
                seconds[name] += elapsed

    print(
        f"first-step loss: dynamic {first_loss['dynamic']:.6f}  fixed {first_loss['fixed']:.6f}  "
        f"|diff| {abs(first_loss['dynamic'] - first_loss['fixed']):.2e}"
    )
    rate = {name: args.steps * n_tokens / s for name, s in seconds.items()}
    for name in runs:
        print(
            f"{name:8s} {rate[name]:9.0f} tokens/s  ({seconds[name] / args.steps:.2f} s per optimizer step, "
            f"{args.steps} timed steps)"
        )
    print(f"ratio dynamic / fixed: {rate['dynamic'] / rate['fixed']:.2f}x")


if __name__ == "__main__":
    main()
