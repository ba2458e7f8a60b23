"""Benchmark: a config's inference engine and trainer on a CUDA device, in one process.

For a GPU machine that has PyTorch and transformers but not the orchestration stack
(Prefect, MLflow): Sluice's own engine and trainer, set up as the config sets them,
driven through the colocated loop of `sluice train --sync` (tasks/train/sync.py): generate
the step's B prompts x G responses, score them, build the trainer's samples from the
scored batch, take one step, save the weights and load them into the engine. Every
`--eval-every` steps the greedy accuracy on the config's held-out prompts.

Two halves, because the prompts come from the task library and the config:

    # here, with Sluice installed: the plan (prompts, answers, every setting)
    python tests/benchmarks/bench_cuda_loop.py plan reasoning_gym MODEL_DIR plan.json
    # on the GPU machine (torch, transformers, tokenizers, pyarrow, gguf for a .gguf)
    python tests/benchmarks/bench_cuda_loop.py run plan.json MODEL_DIR_OR_GGUF --seconds 300

Prints per step: reward, seconds generating / training / loading weights, tokens per
second of each phase and peak CUDA memory of each phase; at the end the held-out curve
and the medians. Scoring on the GPU machine: the last number of the response equals the
answer (what `reward.verifier: reasoning_gym` decides for its arithmetic tasks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def plan(config_name: str, model_dir: str, out: str, steps: int, overrides: list[str]) -> None:
    from sluice.infra.config.run import load_config
    from sluice.tasks.prompts import PromptSource
    from sluice.tasks.train.factory import trainer_settings

    config = load_config(config_name, [f"model.path={model_dir}", *overrides])
    source = PromptSource(config).use_policy(model_dir)
    B, G = config.trainer.prompts_per_batch, config.rollout.group_size
    train = []
    for index in range(steps * B):
        row, ids = source.train_prompt(index)
        train.append({"ids": ids, "answer": str(row.get("answer", ""))})
    held_out = [
        {"ids": source.encode_prompt(row), "answer": str(row.get("answer", ""))}
        for row in source.eval_rows()
    ]
    t, r = config.trainer, config.rollout
    document = {
        "config": config_name,
        "overrides": overrides,
        "seed": config.seed,
        "prompts_per_batch": B,
        "group_size": G,
        "extraction": config.problem.reasoning_gym.extraction
        if config.problem.name == "reasoning_gym"
        else "last_number",
        "rollout": {
            "dtype": r.dtype,
            "max_batch_size": r.max_batch_size,
            "max_seq_len": r.max_seq_len,
            "max_new_tokens": r.max_new_tokens,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_k": r.top_k,
        },
        "stop_token_ids": list(source.stop_token_ids),
        "trainer": dataclasses.asdict(trainer_settings(config)),
        "loss": t.loss.model_dump(),
        "correction": t.correction.model_dump(),
        "advantage": t.advantage.model_dump(),
        # trainer.lora (rank > 0): versions are adapters, folded into the engine's base
        "lora": t.lora.model_dump() if t.lora.rank else None,
        "train": train,
        "held_out": held_out,
    }
    Path(out).write_text(json.dumps(document))
    print(f"plan: {len(train)} train prompts ({steps} steps), {len(held_out)} held-out -> {out}")


def correct(text: str, answer: str, extraction: str) -> bool:
    from sluice.engines.env.answers import extract_answer

    found = extract_answer(text, extraction)
    if found is None:
        return False
    try:
        return float(found) == float(answer)
    except ValueError:
        return found.strip() == answer.strip()


def prepared_model(path: str, work: Path) -> Path:
    """A model directory: `path` itself, or a .gguf file imported into `work`."""
    if not path.endswith(".gguf"):
        return Path(path)
    from sluice.engines.policy.importer import import_model

    target = work / "imported"
    started = time.monotonic()
    import_model(path, target)
    print(f"imported {path} in {time.monotonic() - started:.1f} s", flush=True)
    return target


def run(plan_path: str, model: str, seconds: float, eval_every: int, device: str) -> None:
    import torch

    from sluice.engines.inference.engine import InferenceEngine
    from sluice.engines.inference.types import GenerationRequest, SamplingParams
    from sluice.engines.rl.advantages import make_advantage_fn
    from sluice.engines.rl.loss import make_policy_loss
    from sluice.engines.rl.rollout_correction import make_rollout_correction
    from sluice.engines.rl.samples import batch_rows, batch_table, samples_from_table
    from sluice.engines.rl.train_batch import TrainerSettings
    from sluice.engines.rl.trainer import PolicyTrainer

    document = json.loads(Path(plan_path).read_text())
    work = Path(tempfile.mkdtemp(prefix="sluice-cuda-loop-"))
    model_dir = prepared_model(model, work)
    settings = document["trainer"]
    settings["adam_betas"] = tuple(settings["adam_betas"])
    rollout = document["rollout"]
    B, G, seed = document["prompts_per_batch"], document["group_size"], document["seed"]
    extraction = document["extraction"]
    cuda = device == "cuda"
    print(
        f"device: {torch.cuda.get_device_name(0) if cuda else device}; torch {torch.__version__};"
        f" config {document['config']} {' '.join(document['overrides'])}: B={B} G={G} "
        f"max_new_tokens={rollout['max_new_tokens']} engine {rollout['dtype']}, trainer float32",
        flush=True,
    )

    def peak_reset() -> None:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak_mib() -> float:
        if not cuda:
            return float("nan")
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20

    engine = InferenceEngine(
        model_dir,
        device=device,
        dtype=rollout["dtype"],
        max_batch_size=rollout["max_batch_size"],
        max_seq_len=rollout["max_seq_len"],
        seed=seed,
    )
    loss = make_policy_loss(**document["loss"])
    correction = (
        make_rollout_correction(**document["correction"])
        if document["loss"].get("decoupled", True)
        else None
    )
    lora = None
    if document.get("lora"):  # needs peft where it runs
        from sluice.engines.rl.lora import LoraSettings

        lora = LoraSettings(**document["lora"])
    trainer = PolicyTrainer(
        model_dir,
        TrainerSettings(**settings),
        loss,
        correction,
        device=device,
        decoupled=document["loss"].get("decoupled", True),
        lora=lora,
    )
    advantages = make_advantage_fn(**document["advantage"])
    tokenizer = trainer.tokenizer

    def sampling(sample_seed: int | None, greedy: bool = False) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=rollout["max_new_tokens"],
            temperature=0.0 if greedy else rollout["temperature"],
            top_p=1.0 if greedy else rollout["top_p"],
            top_k=-1 if greedy else rollout["top_k"],
            stop_token_ids=document["stop_token_ids"],
            seed=sample_seed,
        )

    def held_out_accuracy() -> float:
        requests = [
            GenerationRequest(prompt_token_ids=p["ids"], sampling=sampling(None, greedy=True))
            for p in document["held_out"]
        ]
        outputs = engine.generate(requests)
        hits = [
            correct(tokenizer.decode(o.output_token_ids, skip_special_tokens=True), p["answer"],
                    extraction)
            for p, o in zip(document["held_out"], outputs, strict=True)
        ]  # fmt: skip
        return sum(hits) / len(hits)

    curve = [(0, held_out_accuracy())]
    print(f"held-out greedy accuracy at version 0: {curve[0][1]:.3f}", flush=True)
    rows_of: list[dict[str, float]] = []
    started = time.monotonic()
    step = 0
    while time.monotonic() - started < seconds and (step + 1) * B <= len(document["train"]):
        prompts, requests = [], []
        for g in range(step * B, (step + 1) * B):
            prompt = document["train"][g]
            row = {"prompt_id": str(g), "prompt": "", "answer": prompt["answer"]}
            for k in range(G):
                prompts.append((g, row, prompt["ids"]))
                requests.append(
                    GenerationRequest(
                        prompt_token_ids=prompt["ids"],
                        sampling=sampling(seed * 1_000_003 + g * 1009 + k),
                    )
                )
        peak_reset()
        t0 = time.monotonic()
        outputs = engine.generate(requests)
        generate_s = time.monotonic() - t0
        generate_mib = peak_mib()
        rewards = [
            float(correct(tokenizer.decode(o.output_token_ids, skip_special_tokens=True),
                          row["answer"], extraction))
            for (_, row, _), o in zip(prompts, outputs, strict=True)
        ]  # fmt: skip
        table = batch_table(batch_rows(prompts, outputs, rewards, step))
        samples, _ = samples_from_table(table, advantages)
        peak_reset()
        t0 = time.monotonic()
        metrics = trainer.train_step(samples) if samples else {}
        train_s = time.monotonic() - t0
        train_mib = peak_mib()
        step += 1
        t0 = time.monotonic()
        saved = trainer.save(work / f"v{step:06d}", include_optimizer=False)
        engine.update_weights_from_disk(saved, step)
        load_s = time.monotonic() - t0
        if step > 1:  # the served version is loaded: the one before it can go
            shutil.rmtree(work / f"v{step - 1:06d}", ignore_errors=True)
        generated = sum(len(o.output_token_ids) for o in outputs)
        trained = sum(len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples)
        row_ = {
            "reward": statistics.fmean(rewards),
            "generate_s": generate_s,
            "train_s": train_s,
            "load_s": load_s,
            "version_mb": sum(f.stat().st_size for f in saved.iterdir()) / 1e6,
            "gen_tok_s": generated / generate_s,
            "train_tok_s": trained / train_s if train_s and trained else float("nan"),
            "generate_mib": generate_mib,
            "train_mib": train_mib,
            "kl_k3": float(metrics.get("mismatch/kl_k3", float("nan"))),
        }
        rows_of.append(row_)
        print(
            f"step {step:3d}: reward {row_['reward']:.3f} | generate {generate_s:5.2f} s "
            f"({row_['gen_tok_s']:7.0f} tok/s, peak {generate_mib:7.0f} MiB) | train "
            f"{train_s:5.2f} s ({row_['train_tok_s']:7.0f} tok/s, peak {train_mib:7.0f} MiB) "
            f"| save+load {load_s:4.2f} s | k3 {row_['kl_k3']:.2e}",
            flush=True,
        )
        if eval_every and step % eval_every == 0:
            curve.append((step, held_out_accuracy()))
            print(f"held-out greedy accuracy at version {step}: {curve[-1][1]:.3f}", flush=True)
    if curve[-1][0] != step:
        curve.append((step, held_out_accuracy()))
    wall = time.monotonic() - started
    print()
    print(f"{step} steps in {wall:.0f} s ({wall / max(step, 1):.2f} s/step, evaluation included)")
    print("held-out greedy accuracy: " + " ".join(f"v{v}:{a:.3f}" for v, a in curve))
    print("| phase | median s/step | median tok/s | peak CUDA MiB (max) |")
    print("|---|---|---|---|")
    trained_rows = [r for r in rows_of if r["train_s"] > 0 and r["train_tok_s"] == r["train_tok_s"]]
    for phase, key, rows in (("generate", "gen", rows_of), ("train", "train", trained_rows)):
        print(
            f"| {phase} | {statistics.median(r[f'{phase}_s'] for r in rows):.2f} | "
            f"{statistics.median(r[f'{key}_tok_s'] for r in rows):.0f} | "
            f"{max(r[f'{phase}_mib'] for r in rows):.0f} |"
        )
    skipped = len(rows_of) - len(trained_rows)
    print(f"steps with nothing to train (every group's rewards equal): {skipped}")
    print(f"| save + load weights | {statistics.median(r['load_s'] for r in rows_of):.2f} | | |")
    print(f"a version: {rows_of[-1]['version_mb']:.1f} MB ({'adapter' if lora else 'model'})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="write the plan (needs Sluice installed)")
    p.add_argument("config")
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--set", action="append", default=[], dest="overrides")
    r = sub.add_parser("run", help="run the loop (torch and transformers are enough)")
    r.add_argument("plan")
    r.add_argument("model", help="model directory or .gguf file")
    r.add_argument("--seconds", type=float, default=300.0)
    r.add_argument("--eval-every", type=int, default=10)
    r.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if args.command == "plan":
        plan(args.config, args.model_dir, args.out, args.steps, args.overrides)
    else:
        run(args.plan, args.model, args.seconds, args.eval_every, args.device)


if __name__ == "__main__":
    sys.exit(main())
