"""Benchmark: the Sluice inference engine vs ``transformers`` ``generate()``, and
interruptible vs wait-for-drain weight updates.

Model: a random-init ~1.1M-parameter Llama (Hugging Face format, saved to a temp
directory), CPU. Response lengths are long-tailed: each request's
``max_new_tokens`` is drawn from a lognormal and EOS is ignored, so every
request produces exactly its drawn length in both systems (same useful work).

(a) Generation throughput, useful tokens per second, over the same prompts:
    - engine: continuous batching with ``--batch`` KV slots; a finished
      sequence's slot is refilled from the queue at once.
    - HF: ``model.generate()`` on consecutive batches of ``--batch`` prompts
      (left-padded); each batch decodes until its longest request is done, and
      the tokens past a request's own length are discarded.

(b) Short responses in GRPO groups, the shape of an RL step on a short-answer task:
    ``--groups`` prompts × ``--group-size`` samples each, prompts of 16-32 tokens,
    responses of 6-14 tokens (EOS ignored, so both systems produce the same tokens),
    ``--rounds-short`` rounds. HF generate gets each round as one static batch (every
    prompt repeated group-size times, as a plain synchronous RL loop does); the engine
    gets the same requests and may reuse a prompt's prefill across its group.

(c) Weight updates under a steady request stream: a feeder keeps the engine's
    queue non-empty while a new checkpoint is loaded every ``--update-every-s``
    seconds; windows of each mode are interleaved over ``--rounds`` rounds so
    the load of a shared machine hits all modes alike.
    - interruptible: applied between two decode steps; in-flight sequences have
      their KV recomputed with the new weights and go on.
    - drain: admission stops, in-flight sequences finish on the old weights,
      then the new weights load and admission resumes.
    Throughput counts sampled tokens (recomputation is overhead, not output);
    a run without updates is printed for reference.

    On a CPU the two modes come out close, and that is expected: both prefill
    and decode are compute-bound, so prefill is at most ~2x cheaper per token
    than decode and recomputing the in-flight KV costs about as much as the
    capacity a drain leaves idle (a decode step with few rows left is cheap
    too). On a GPU, decode is memory-bound and prefill far cheaper per token,
    which is where interruptible updates pay off (AReaL §3). What a drain
    always costs is freshness: each update lands "drain wait" seconds late.

    The ceiling of interruptible / drain is no-updates / drain: an interruptible update
    cannot make generation faster than not updating at all; the line is printed.

    python tests/benchmarks/bench_inference.py [--requests 256 --batch 64 --threads 1]
"""

from __future__ import annotations

import argparse
import math
import platform
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.types import GenerationRequest, SamplingParams

VOCAB = 256
PAD = 0
EOS = 1


MODEL_SHAPES = {
    # ~1.1M parameters: Sluice's embedded default policy, one layer more.
    "tiny": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 5, "heads": 4},
    # ~85M parameters: a GPU-sized decoder (GPT-2 small's width and depth), where a
    # decode step reads enough weights and K/V to be bound by memory, not by launches.
    "small": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "heads": 12},
}


def build_model(path: Path, seed: int, shape: str = "tiny") -> Path:
    """A random-init Llama of one of ``MODEL_SHAPES``, saved in Hugging Face format."""
    torch.manual_seed(seed)
    dims = MODEL_SHAPES[shape]
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=dims["hidden_size"],
        intermediate_size=dims["intermediate_size"],
        num_hidden_layers=dims["num_hidden_layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["heads"],
        max_position_embeddings=1024,
        bos_token_id=2,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return path


def workload(
    rng: np.random.Generator, n: int, median_new_tokens: int, max_new_tokens: int
) -> list[GenerationRequest]:
    """Prompts of 8-32 tokens and lognormal response lengths clipped to [4, max]."""
    lengths = np.clip(
        rng.lognormal(math.log(median_new_tokens), 0.9, size=n), 4, max_new_tokens
    ).astype(int)
    requests = []
    for i, length in enumerate(lengths.tolist()):
        prompt = rng.integers(3, VOCAB, size=int(rng.integers(8, 33))).tolist()
        params = SamplingParams(max_new_tokens=length, temperature=1.0, ignore_eos=True, seed=i)
        requests.append(GenerationRequest(prompt, params))
    return requests


def short_rounds(
    rng: np.random.Generator, rounds: int, groups: int, group_size: int
) -> list[list[GenerationRequest]]:
    """Rounds of `groups` prompts x `group_size` samples with 6-14 token responses."""
    out = []
    for r in range(rounds):
        requests = []
        for g in range(groups):
            prompt = rng.integers(3, VOCAB, size=int(rng.integers(16, 33))).tolist()
            for k in range(group_size):
                params = SamplingParams(
                    max_new_tokens=int(rng.integers(6, 15)),
                    temperature=1.0,
                    ignore_eos=True,
                    seed=(r * groups + g) * group_size + k,
                )
                requests.append(GenerationRequest(prompt, params))
        out.append(requests)
    return out


def run_engine(engine: InferenceEngine, requests: list[GenerationRequest]) -> tuple[int, float]:
    start = time.perf_counter()
    outputs = engine.generate(requests)
    elapsed = time.perf_counter() - start
    return sum(len(o.output_token_ids) for o in outputs), elapsed


def run_hf(
    model: LlamaForCausalLM, requests: list[GenerationRequest], batch: int
) -> tuple[int, float, int]:
    """HF generate on consecutive batches; returns useful tokens, seconds, decoded rows x steps."""
    useful = decoded = 0
    start = time.perf_counter()
    for lo in range(0, len(requests), batch):
        chunk = requests[lo : lo + batch]
        width = max(len(r.prompt_token_ids) for r in chunk)
        input_ids = torch.full((len(chunk), width), PAD, dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, r in enumerate(chunk):
            n = len(r.prompt_token_ids)
            input_ids[row, width - n :] = torch.tensor(list(r.prompt_token_ids))
            attention[row, width - n :] = 1
        longest = max(r.sampling.max_new_tokens for r in chunk)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids.to(model.device),
                attention_mask=attention.to(model.device),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=longest,
                min_new_tokens=longest,
                pad_token_id=PAD,
                eos_token_id=None,
            )
        assert out.shape[1] - width == longest
        if out.is_cuda:
            torch.cuda.synchronize()
        useful += sum(r.sampling.max_new_tokens for r in chunk)
        decoded += len(chunk) * longest
    return useful, time.perf_counter() - start, decoded


def stream_window(
    model_dirs: list[Path],
    mode: str,
    *,
    device: str,
    dtype: str,
    batch: int,
    max_seq_len: int,
    window_s: float,
    warmup_s: float,
    update_every_s: float,
    median_new_tokens: int,
    max_new_tokens: int,
    seed: int,
) -> dict[str, float]:
    """One measured window of a steady request stream under ``mode``.

    mode: ``none`` (no updates), ``interruptible`` or ``drain``. The stream runs
    ``warmup_s`` first so in-flight lengths reach their steady mix.
    """
    engine = InferenceEngine(
        model_dirs[0],
        device=device,
        dtype=dtype,
        max_batch_size=batch,
        max_seq_len=max_seq_len,
        seed=0,
    )
    pool = workload(np.random.default_rng(seed), 20_000, median_new_tokens, max_new_tokens)
    stop = threading.Event()
    reports: list = []
    start = 0.0

    def feed() -> None:
        index = 0
        while not stop.is_set():
            while engine.num_waiting < batch and not stop.is_set():
                engine.submit(pool[index % len(pool)])
                index += 1
            time.sleep(0.001)

    def update() -> None:
        # A fixed publishing cadence, as a trainer would keep (first one half an
        # interval in); an update that takes longer than the interval (a long
        # drain) delays the next one.
        version = 0
        while True:
            due = start + (version + 0.5) * update_every_s
            if stop.wait(max(0.0, due - time.perf_counter())):
                return
            version += 1
            target = model_dirs[version % len(model_dirs)]
            reports.append(engine.update_weights_from_disk(target, version, drain=mode == "drain"))

    engine.start()
    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    time.sleep(warmup_s)
    updater = threading.Thread(target=update, daemon=True)
    recomputed_before = engine.recomputed_tokens
    tokens_before = engine.generated_tokens
    start = time.perf_counter()
    if mode != "none":
        updater.start()
    time.sleep(window_s)
    tokens = engine.generated_tokens - tokens_before
    elapsed = time.perf_counter() - start
    recomputed = engine.recomputed_tokens - recomputed_before
    stop.set()
    if mode != "none":
        updater.join()
    feeder.join()
    engine.shutdown()
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "updates": len(reports),
        "drain_wait_s": sum(r.drain_wait_s for r in reports),
        "recomputed_tokens": recomputed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--median-new-tokens", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--update-every-s", type=float, default=3.0)
    parser.add_argument("--window-s", type=float, default=9.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--rounds-short", type=int, default=20)
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="tiny")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument(
        "--dtype", default="float32", help="engine and HF model dtype (float32, bfloat16)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    max_seq_len = 32 + args.max_new_tokens

    with tempfile.TemporaryDirectory() as tmp:
        dirs = [build_model(Path(tmp) / f"v{i}", seed=i, shape=args.model) for i in range(2)]
        model = LlamaForCausalLM.from_pretrained(dirs[0])
        model = model.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
        on_device = {"device": args.device, "dtype": args.dtype}
        params = sum(p.numel() for p in model.parameters())
        accelerator = (
            f", {torch.cuda.get_device_name(args.device)}" if args.device.startswith("cuda") else ""
        )
        print(
            f"machine: {platform.machine()} {platform.processor() or ''}{accelerator}, "
            f"torch {torch.__version__}, threads {args.threads}"
        )
        print(
            f"model: Llama {params / 1e6:.2f}M params, vocab {VOCAB}, {args.dtype} on {args.device}; "
            f"batch {args.batch} slots"
        )

        requests = workload(
            np.random.default_rng(0), args.requests, args.median_new_tokens, args.max_new_tokens
        )
        lengths = np.array([r.sampling.max_new_tokens for r in requests])
        print(
            f"(a) {args.requests} requests, max_new_tokens lognormal: mean {lengths.mean():.0f}, "
            f"p50 {np.median(lengths):.0f}, p99 {np.percentile(lengths, 99):.0f}, max {lengths.max()}"
        )
        engine = InferenceEngine(
            dirs[0], max_batch_size=args.batch, max_seq_len=max_seq_len, seed=0, **on_device
        )
        engine.generate(requests[: args.batch // 4])  # warm-up
        run_hf(model, requests[:8], 8)  # warm-up
        engine_tokens, engine_s = run_engine(engine, requests)
        hf_tokens, hf_s, hf_decoded = run_hf(model, requests, args.batch)
        assert engine_tokens == hf_tokens
        engine_tps, hf_tps = engine_tokens / engine_s, hf_tokens / hf_s
        print(
            f"    engine (continuous batching): {engine_tokens} tokens in {engine_s:.2f} s = {engine_tps:,.0f} tok/s"
        )
        print(
            f"    HF generate (static batches): {hf_tokens} tokens in {hf_s:.2f} s = {hf_tps:,.0f} tok/s "
            f"({hf_decoded} row-steps decoded, {hf_tokens / hf_decoded:.0%} useful)"
        )
        print(f"    ratio engine / HF generate: {engine_tps / hf_tps:.2f}x")

        rounds = short_rounds(
            np.random.default_rng(1), args.rounds_short, args.groups, args.group_size
        )
        width = args.groups * args.group_size
        short_engine = InferenceEngine(
            dirs[0], max_batch_size=width, max_seq_len=max_seq_len, seed=0, **on_device
        )
        short_engine.generate(rounds[0])  # warm-up
        run_hf(model, rounds[0], width)  # warm-up
        engine_tokens = hf_tokens = 0
        engine_s = hf_s = 0.0
        for requests in rounds:  # interleaved, so machine noise hits both alike
            tokens, seconds = run_engine(short_engine, requests)
            engine_tokens, engine_s = engine_tokens + tokens, engine_s + seconds
            tokens, seconds, _ = run_hf(model, requests, width)
            hf_tokens, hf_s = hf_tokens + tokens, hf_s + seconds
        assert engine_tokens == hf_tokens
        print(
            f"(b) short responses: {args.rounds_short} rounds of {args.groups} prompts x "
            f"{args.group_size} samples, 6-14 new tokens each"
        )
        print(
            f"    engine (prompt cache, continuous batching): {engine_tokens} tokens in "
            f"{engine_s:.2f} s = {engine_tokens / engine_s:,.0f} tok/s"
        )
        print(
            f"    HF generate (one static batch a round): {hf_tokens} tokens in {hf_s:.2f} s"
            f" = {hf_tokens / hf_s:,.0f} tok/s"
        )
        print(f"    ratio engine / HF generate: {hf_s / engine_s:.2f}x")

        modes = ("none", "interruptible", "drain")
        print(
            f"(c) steady stream, weight update every {args.update_every_s:.1f} s, batch {args.batch}; "
            f"{args.rounds} rounds x {args.window_s:.0f} s per mode, modes interleaved"
        )
        totals = {
            m: {
                "tokens": 0.0,
                "seconds": 0.0,
                "updates": 0.0,
                "drain_wait_s": 0.0,
                "recomputed_tokens": 0.0,
            }
            for m in modes
        }
        for round_index in range(args.rounds):
            for mode in modes:
                window = stream_window(
                    dirs,
                    mode,
                    batch=args.batch,
                    **on_device,
                    max_seq_len=max_seq_len,
                    window_s=args.window_s,
                    warmup_s=args.warmup_s,
                    update_every_s=args.update_every_s,
                    median_new_tokens=args.median_new_tokens,
                    max_new_tokens=args.max_new_tokens,
                    seed=round_index,
                )
                for key, value in window.items():
                    totals[mode][key] += value
        tps = {m: totals[m]["tokens"] / totals[m]["seconds"] for m in modes}
        labels = {"none": "no updates", "interruptible": "interruptible", "drain": "drain"}
        for mode in modes:
            t = totals[mode]
            detail = ""
            if mode != "none":
                detail = (
                    f" over {t['updates']:.0f} updates: {t['recomputed_tokens'] / max(t['updates'], 1):,.0f} tokens "
                    f"recomputed and {t['drain_wait_s'] / max(t['updates'], 1):.2f} s drain wait per update"
                )
            print(f"    {labels[mode]:>13}: {tps[mode]:,.0f} tok/s{detail}")
        print(f"    ratio interruptible / drain: {tps['interruptible'] / tps['drain']:.2f}x")
        print(f"    ceiling (no updates / drain): {tps['none'] / tps['drain']:.2f}x")


if __name__ == "__main__":
    main()
