"""The mismatch watchdog under injected mismatch: does it fire before held-out reward
falls, does `skip` or a correction mode keep the run up, and is it quiet on a clean run?

Per seed, in one invocation, four arms of the real `sluice train` (the default job),
each in a new temporary directory:

- ``clean``: no injected mismatch, everything as shipped (the watchdog warns), for the
  default job's whole length (``--steps`` does not apply). Every firing here is a false
  alarm.
- ``noisy``: the inference engine serves its weights with relative noise σ
  (``rollout.weight_noise_std``), no rollout correction, the watchdog warns: the arm that
  should degrade, and the one the "fires first" question is asked of.
- ``skip``: as ``noisy``, with ``trainer.watchdog.action=skip``.
- ``corrected``: as ``noisy``, with ``trainer.correction.mode`` = ``--correction``.

Nothing is evaluated while a run trains; afterwards every version the run kept (0,
every ``evaluation.every``-th, the newest) is scored in this process on the same
held-out prompts with the same sampling seeds. Per arm and seed the script prints the
best held-out reward and its version, the first kept version at least 0.05 below the
best before it (the drop), the first firing (step and signal), whether it came first,
the final reward, and the firings and skipped groups the run's status counts.

    python tests/benchmarks/bench_watchdog.py --noise 0.15 [--seeds 0 1 2] [--steps 60]
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

DROP = 0.05
"""How far below its best held-out reward a run must fall to count as degrading."""
SIGNALS = ("kl_k3", "log_ppl_gap", "grad_norm", "ess", "masked_fraction")


def arms(noise: float, correction: str) -> dict[str, list[str]]:
    noisy = [f"rollout.weight_noise_std={noise}", "trainer.correction.mode=none"]
    return {
        "clean": [],
        "noisy": noisy,
        "skip": [*noisy, "trainer.watchdog.action=skip"],
        "corrected": [noisy[0], f"trainer.correction.mode={correction}"],
    }


TRACED = ("mismatch/kl_k3", "mismatch/log_ppl_abs_diff", "train/grad_norm")
"""Signals whose course each arm prints (median of its first and last ten steps, and
the largest step)."""


def firings(
    workdir: Path,
) -> tuple[list[tuple[int, str]], dict[str, Any], dict[str, str]]:
    """Every (step, signal) the watchdog logged, the train status's counts, and the
    course of the traced signals."""
    from sluice.flows.run_dirs import absolute_store_settings, resolve_run
    from sluice.infra.config.run import load_config
    from sluice.infra.tracking import get_metric_history
    from sluice.tasks.run.paths import run_paths, run_registry
    from sluice.tasks.run.status import read_statuses

    stores = absolute_store_settings(workdir)
    run_id, config = resolve_run(load_config(None, stores), None, stores)
    mlflow_run = run_registry(config, run_id).get(0).run_id
    fired = sorted(
        (step, signal)
        for signal in SIGNALS
        for step, _ in get_metric_history(config.tracking.uri, mlflow_run, f"watchdog/{signal}")
    )
    course = {}
    for metric in TRACED:
        values = [v for _, v in get_metric_history(config.tracking.uri, mlflow_run, metric)]
        if values:
            first, last = np.median(values[:10]), np.median(values[-10:])
            course[metric.rpartition("/")[2]] = f"{first:.3g} → {last:.3g} (max {max(values):.3g})"
    return fired, read_statuses(config, run_paths(config, run_id)).get("train", {}), course


def first_drop(curve: list[tuple[int, float]]) -> int | None:
    """The first version at least `DROP` below the best version before it."""
    best = float("-inf")
    for version, reward in curve:
        if reward <= best - DROP:
            return version
        best = max(best, reward)
    return None


def run_arm(arm: str, seed: int, settings: list[str], steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"sluice-watchdog-{arm}-{seed}-") as scratch:
        workdir = Path(scratch)
        command = ["sluice", "train", "--set", f"seed={seed}"]
        # The clean arm is the default job whole (its false alarms are the question);
        # the noisy arms stop at `steps`.
        for item in [
            *([f"trainer.total_steps={steps}"] if arm != "clean" else []),
            "evaluation.every=5",
            "evaluation.during_run=false",
            *settings,
        ]:
            command += ["--set", item]
        started_at, wall = run_train(command, workdir, f"{arm} seed {seed}")
        fired, status, course = firings(workdir)
        curves, _ = score_after(workdir, started_at, [], within_s=float("inf"))
    curve = curves["eval/reward"]
    best_version, best = max(curve, key=lambda point: point[1])
    drop = first_drop(curve)
    first = fired[0] if fired else None
    result = {
        "wall_s": wall,
        "best": f"v{best_version} {best:.3f}",
        "drop": "-" if drop is None else f"v{drop}",
        "first_firing": "-" if first is None else f"step {first[0]} {first[1]}",
        "fired_first": "-" if drop is None else str(first is not None and first[0] <= drop),
        "final": f"v{curve[-1][0]} {curve[-1][1]:.3f}",
        "firings": status.get("watchdog_firings", 0),
        "skipped_groups": status.get("groups_skipped", 0),
        **course,
        "curve": curve,
    }
    print(f"{arm:9s} seed {seed}  {result}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--noise", type=float, required=True, help="rollout.weight_noise_std")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--correction", default="token_tis")
    parser.add_argument("--arms", nargs="+", default=None, help="a subset of the four arms")
    args = parser.parse_args()
    settings = arms(args.noise, args.correction)
    chosen = args.arms or list(settings)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}; default job, {args.steps} steps; noise σ {args.noise}; "
        f"corrected arm: {args.correction}; drop = {DROP} below the best version before",
        flush=True,
    )
    rows = []
    for seed in args.seeds:
        for arm in chosen:
            rows.append((arm, seed, run_arm(arm, seed, settings[arm], args.steps)))
    print()
    columns = (
        "best",
        "drop",
        "first_firing",
        "fired_first",
        "final",
        "firings",
        "skipped_groups",
        "kl_k3",
        "log_ppl_abs_diff",
    )
    print("| arm | seed | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 2) + "|")
    for arm, seed, result in rows:
        cells = " | ".join(str(result.get(c, "-")) for c in columns)
        print(f"| {arm} | {seed} | {cells} |")


if __name__ == "__main__":
    main()
