"""Benchmark: how far a supervised pass on the mix's own answers moves greedy held-out accuracy.

Group-relative RL on the harder reasoning-gym mix sharpens what the start policy already
samples, and stops near the start policy's pass@16
(docs/reports/2026-11-27-harder-recipe.md). A supervised pass teaches each prompt's
answer directly. This script measures that pass alone, with no RL after it, scoring as
it goes (``model.supervised`` runs the same pass inside ``sluice train``, on the same
rows, and commits its result as version 0): for ``--minutes`` of training time it
trains the model (every weight, AdamW) on the config's training prompts, each rendered
exactly as the rollout renders it (chat template and system message included), with the
row's reference answer and the end token as the response (the loss on those tokens
only; ``tasks/prompts.py:reference_examples``). Then it scores the start and the
result greedily on the config's held-out prompts, with bench_recipe's scoring settings,
so the numbers compare with bench_recipe's curves.

The training prompts are the whole mix (a curriculum is RL's; ``--max-terms`` bounds
the term count instead). Printed: the mean loss a minute of training, and the scores by
term count of the start, of every ``--score-every`` minutes of training (scoring does
not count as training time) and of the end.

    python tests/benchmarks/bench_supervised.py --model-path DIR [--minutes 10] \\
        [--lr 2e-5] [--batch-size 16] [--max-terms N] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.benchmarks.bench_recipe import build_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model-path", required=True, help="a local HF model directory")
    parser.add_argument("--config", default="reasoning_gym_mix", help="run config (name or path)")
    parser.add_argument("--minutes", type=float, default=10.0, help="wall time of training")
    parser.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per optimizer step")
    parser.add_argument("--max-terms", type=int, default=0, help="train on rows up to N terms")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--score-every", type=float, default=0, help="also score every M minutes of training"
    )
    parser.add_argument("--keep", help="save the trained model here (default: deleted)")
    return parser.parse_args(argv)


def save_model(model: Any, source_dir: Path, out: Path) -> None:
    """`model`'s weights with every other file of `source_dir` (tokenizer, template)."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for path in source_dir.iterdir():
        if (
            path.is_file()
            and not (out / path.name).exists()
            and not path.name.startswith("sluice_")
        ):
            shutil.copyfile(path, out / path.name)


def train(
    config: Any, args: argparse.Namespace, out: Path, score: Callable[[str, Path], None]
) -> dict[str, Any]:
    """Train for `args.minutes` of training time; every `args.score_every` minutes save
    the model under `out` and call `score` (its time is not training time)."""
    import torch

    from sluice.engines.policy.model import load_policy_dir
    from sluice.engines.policy.warmstart import collate_supervised
    from sluice.tasks.prompts import PromptSource, reference_examples

    model_dir = Path(str(config.model.path))
    torch.manual_seed(config.seed)
    torch.set_num_threads(os.cpu_count() or 1)
    source = PromptSource(config).use_policy(model_dir)
    model, tokenizer = load_policy_dir(model_dir)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{model_dir}: the tokenizer has no end token to train")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    examples = reference_examples(source, int(tokenizer.eos_token_id), args.max_terms)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    trained_s, steps, losses = 0.0, 0, []
    minute_losses: list[float] = []
    marks = []
    if args.score_every:
        marks = [args.score_every * k for k in range(1, int(args.minutes / args.score_every) + 1)]
        marks = [mark for mark in marks if mark < args.minutes]
    while trained_s < args.minutes * 60:
        if marks and trained_s >= marks[0] * 60:
            mark = marks.pop(0)
            at = out / f"at-{mark:g}-min"
            model.eval()
            save_model(model, model_dir, at)
            score(f"after {mark:g} min ({steps} steps)", at)
            shutil.rmtree(at, ignore_errors=True)
            model.train()
        step_started = time.monotonic()
        batch = collate_supervised([next(examples) for _ in range(args.batch_size)], pad)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        steps += 1
        trained_s += time.monotonic() - step_started
        minute_losses.append(float(loss.detach()))
        if trained_s >= 60 * (len(losses) + 1):
            losses.append(sum(minute_losses) / len(minute_losses))
            print(f"  minute {len(losses)}: step {steps}, mean loss {losses[-1]:.4f}", flush=True)
            minute_losses = []
    model.eval()
    save_model(model, model_dir, out)
    score(f"after {args.minutes:g} min ({steps} steps)", out)
    return {"steps": steps, "rows": steps * args.batch_size, "loss_by_minute": losses}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from sluice.tasks.evaluate.role import evaluate_model_dir

    args = parse_args(argv)
    if not args.minutes > 0 or args.batch_size < 1 or not args.lr > 0:
        raise SystemExit("--minutes and --lr must be > 0 and --batch-size >= 1")
    recipe = argparse.Namespace(
        model_path=args.model_path,
        config=args.config,
        seeds=1,
        minutes=30.0,
        every=5,
        overrides=args.overrides,
    )
    config, scoring = build_config(recipe)
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="sluice-supervised-"))
    try:
        print(
            f"supervised pass: {args.config} {' '.join(args.overrides)}; model "
            f"`{config.model.path}`; {args.minutes:g} min, lr {args.lr:g}, "
            f"{args.batch_size} rows a step, max terms {args.max_terms or 'all'}",
            flush=True,
        )
        scores = {"start": evaluate_model_dir(scoring, Path(str(config.model.path)), 0)}

        def score(name: str, model_dir: Path) -> None:
            scores[name] = evaluate_model_dir(scoring, model_dir, len(scores))
            print(f"  {name}: greedy accuracy {scores[name]['eval/greedy_accuracy']:.3f}")

        trained = train(config, args, out, score)
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    print(f"{trained['steps']} steps, {trained['rows']} rows")
    print(f"| policy | greedy accuracy | length | {' | '.join(_term_keys(scores['start']))} |")
    print("|---|---|---|" + "---|" * len(_term_keys(scores["start"])))
    for name, metrics in scores.items():
        terms = " | ".join(f"{metrics[f'eval/{k}']:.3f}" for k in _term_keys(metrics))
        print(
            f"| {name} | {metrics['eval/greedy_accuracy']:.3f} | "
            f"{metrics['eval/response_length_mean']:.1f} | {terms} |"
        )
    return {**trained, **scores}


def _term_keys(metrics: dict[str, float]) -> list[str]:
    return sorted(k.removeprefix("eval/") for k in metrics if k.startswith("eval/reward_terms_"))


if __name__ == "__main__":
    main()
