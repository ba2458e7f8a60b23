"""LoRA against full fine-tuning on the real-model recipe, side by side, per seed.

For each seed both arms run in this invocation, one after the other (the order
alternates with the seed, so a drift in the machine's load hits both alike), each as
the real command in a new temporary directory:

- full: ``sluice train reasoning_gym --set seed=S --set model.path=DIR [--set ...]``;
- lora: the same with ``trainer.lora.rank=16``, ``trainer.lora.alpha=32`` and
  ``trainer.lr=2e-4`` (``--lora-set`` changes them).

Each arm trains for ``--minutes`` of wall time (``trainer.time_budget_s``, less the
command's start-up and shut-down), evaluates nothing while the clock runs, and its kept
versions are scored afterwards in this process on the same held-out prompts with the
same sampling seeds (``bench_default_run.score_after``). Per arm and seed it prints the
held-out curve and one table row: held-out reward of version 0 and of the newest
version committed within the window, seconds per step, the trainer's peak resident
memory, the bytes of a published version (mean over the versions after 0 still on
storage: the adapter for LoRA, the model for full) and the seconds from a version's
commit to every server holding it (median over the run's weight updates).

Run: ``python tests/benchmarks/bench_lora.py --model DIR [--seeds 0 1 2] [--minutes 30]
[--arms full lora] [--set key=value ...] [--lora-set key=value ...] [--eval-set key=value ...]``
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.benchmarks.bench_default_run import (  # noqa: E402
    run_train,
    score_after,
)

LORA = ["trainer.lora.rank=16", "trainer.lora.alpha=32", "trainer.lr=2e-4"]
SCORING = ["evaluation.num_prompts=128", "evaluation.samples=2"]


def figures(workdir: Path) -> dict[str, Any]:
    """What the run's status documents and storage say once it ended."""
    from sluice.flows.run_dirs import absolute_store_settings, resolve_run
    from sluice.infra.checkpoints import read_manifest
    from sluice.infra.config.run import load_config
    from sluice.tasks.run.paths import run_paths, run_registry
    from sluice.tasks.run.status import read_statuses

    stores = absolute_store_settings(workdir)
    run_id, config = resolve_run(load_config(None, stores), None, stores)
    statuses = read_statuses(config, run_paths(config, run_id))
    train, rollout = statuses.get("train", {}), statuses.get("rollout", {})
    kept = [v for v in run_registry(config, run_id).versions() if not v.deleted]
    sizes = [read_manifest(v.checkpoint_uri).total_bytes for v in kept if v.policy_version]
    step = train.get("step") or 0
    return {
        "steps": step,
        "s_per_step": train.get("wall_time_s", float("nan")) / step if step else float("nan"),
        "train_peak_mib": train.get("peak_rss_mb", float("nan")),
        "version_mb": float(np.mean(sizes)) / 1e6 if sizes else float("nan"),
        "commit_to_served_s": rollout.get("commit_to_served_s_median") or float("nan"),
        # Where a step's seconds went: the trainer's share of the run spent waiting for
        # batches, the tokens it trained and the servers generated per second, the mean
        # sample length, and the servers' total seconds spent taking new weights.
        "train_idle_ratio": train.get("idle_ratio", float("nan")),
        "trained_tokens_per_s": train.get("trained_tokens_per_s", float("nan")),
        "generated_tokens_per_s": rollout.get("tokens_per_s", float("nan")),
        "tokens_per_sample": rollout.get("tokens_generated", 0)
        / max(1, rollout.get("samples_written", 0)),
        "weight_update_s": rollout.get("update_time_s", float("nan")),
    }


def run_arm(
    arm: str, seed: int, overrides: list[str], eval_overrides: list[str], within_s: float
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"sluice-lora-{arm}-{seed}-") as scratch:
        workdir = Path(scratch)
        command = ["sluice", "train", "reasoning_gym", "--set", f"seed={seed}"]
        for item in [*overrides, "evaluation.during_run=false"]:
            command += ["--set", item]
        started_at, wall = run_train(command, workdir, f"{arm} seed {seed}")
        result = {"wall_s": wall, **figures(workdir)}
        curves, lines = score_after(workdir, started_at, eval_overrides, within_s)
        for line in lines:
            print(f"{arm:4s} seed {seed}  {line}", flush=True)
        result["reward"] = curves["eval/reward"]
        result["greedy"] = curves.get("eval/greedy_accuracy", [])
        print(f"{arm:4s} seed {seed}  {result}", flush=True)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the imported SmolLM2 directory")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--lora-set", dest="lora", action="append", default=None)
    parser.add_argument("--eval-set", dest="eval_overrides", action="append", default=None)
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=["full", "lora"],
        default=["full", "lora"],
        help="run only these arms (to rerun one arm of a seed)",
    )
    args = parser.parse_args()
    window = args.minutes * 60
    base = [
        f"model.path={Path(args.model).resolve()}",
        # Start-up and shut-down inside the window (about 50 s here).
        f"trainer.time_budget_s={max(60.0, window - 50):.0f}",
        "evaluation.every=6",
        *args.overrides,
    ]
    arms = {"full": base, "lora": [*base, *(args.lora or LORA)]}
    scoring = args.eval_overrides or SCORING
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}; window {args.minutes:.0f} min; lora: "
        f"{' '.join(args.lora or LORA)}; scoring: {' '.join(scoring)}",
        flush=True,
    )
    rows: list[tuple[str, int, dict[str, Any]]] = []
    for seed in args.seeds:
        order = ["full", "lora"] if seed % 2 == 0 else ["lora", "full"]
        for arm in [a for a in order if a in args.arms]:
            rows.append((arm, seed, run_arm(arm, seed, arms[arm], scoring, window)))
    print()
    print(
        "| arm | seed | held-out reward: v0 → newest in window (Δ) | greedy: v0 → newest | "
        "steps | s/step | trainer peak MiB | MB per version | commit → served s |"
    )
    print("|---" * 9 + "|")
    deltas: dict[str, list[float]] = {"full": [], "lora": []}
    for arm, seed, r in rows:
        (v0, start), (vn, end) = r["reward"][0], r["reward"][-1]
        deltas[arm].append(end - start)
        greedy = f"{r['greedy'][0][1]:.3f} → {r['greedy'][-1][1]:.3f}" if r["greedy"] else "-"
        print(
            f"| {arm} | {seed} | v{v0} {start:.3f} → v{vn} {end:.3f} ({end - start:+.3f}) | "
            f"{greedy} | {r['steps']} | {r['s_per_step']:.1f} | {r['train_peak_mib']:.0f} | "
            f"{r['version_mb']:.1f} | {r['commit_to_served_s']:.1f} |"
        )
    for arm, values in deltas.items():
        if values:
            print(
                f"{arm}: Δ held-out reward {np.mean(values):+.3f} ± {np.std(values):.3f} "
                f"over {len(values)} seed(s)"
            )


if __name__ == "__main__":
    main()
