"""What a newcomer sees: `sluice train` in a fresh directory, once per seed, timed.

Each seed runs the real command (`sluice train --set seed=S`) as a subprocess in its own
new temporary directory, so nothing is cached: Prefect's temporary API server, MLflow's
sqlite store, the roles' processes and the final evaluation are all on the clock. The
wall time is the command's, start to exit. Afterwards the script reads each run's
held-out curves from its MLflow store and prints them, then the mean over seeds.

Target (issue: "the main job learns clearly and fast"): held-out reward up by at least
0.25 within 5 minutes of wall time on 2 cores, on the mean of 3 seeds.

With ``--config multiturn`` it runs ``sluice train multiturn`` instead (multi-turn
episodes with a calculator tool) and also prints the share of held-out episodes that
call the tool (``eval/calling_fraction``).

With ``--score-after`` (for the real-model recipe, ``--config reasoning_gym``) nothing
is evaluated while the clock runs (``evaluation.during_run=false``, so every core goes
to rollout and training); after each run the versions the evaluation schedule kept
(version 0, every ``evaluation.every``-th, the final one) are scored in this process on
the same held-out prompts with the same sampling seeds for every seed's run
(``--eval-set`` changes the scoring settings, e.g. ``evaluation.num_prompts=128``).
Each version's time is its commit time since the command started. The run's roles
report their peak memory (each process's high-water mark), generated and trained
tokens per second and seconds per step; the script prints them per seed.

Run: ``python tests/benchmarks/bench_default_run.py [--config NAME] [--seeds 0 1 2] [--set key=value ...] [--score-after [--eval-set key=value ...]] [--target DELTA --within S]``
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")

CURVES = ("eval/reward", "eval/greedy_accuracy", "eval/calling_fraction")


def curves_of(workdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Held-out curves of the one run in `workdir`'s MLflow store, by metric."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / '.sluice' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sluice")
    (run,) = client.search_runs([experiment.experiment_id])
    curves = {
        key: sorted(
            (int(m.step), float(m.value)) for m in client.get_metric_history(run.info.run_id, key)
        )
        for key in CURVES
    }
    return {key: points for key, points in curves.items() if points}


def score_after(
    workdir: Path, started_at: float, eval_overrides: list[str], within_s: float
) -> tuple[dict[str, list[tuple[int, float]]], list[str]]:
    """Score every version the run kept, in this process; curves by metric over the
    versions committed within `within_s` of the start, and a line per version (commit
    time since the command started, reward, greedy, length)."""
    from sluice.flows.run_dirs import absolute_store_settings, resolve_run
    from sluice.infra.config.run import load_config
    from sluice.tasks.evaluate.role import evaluate_checkpoint
    from sluice.tasks.run.paths import run_registry

    # Every seed's versions are scored on the same prompts with the same sampling
    # seeds, so two versions differ by their weights, not their luck.
    stores = absolute_store_settings(workdir)
    run_id, config = resolve_run(
        load_config(None, stores), None, [*stores, "seed=0", *eval_overrides]
    )
    versions = [v for v in run_registry(config, run_id).versions() if not v.deleted]
    if not versions:
        raise SystemExit(f"no committed versions found for run {run_id} in {workdir}")
    curves: dict[str, list[tuple[int, float]]] = {}
    lines = []
    for version in sorted(versions, key=lambda v: v.policy_version):
        metrics = evaluate_checkpoint(
            config, run_id, version.policy_version, version.checkpoint_uri
        )
        since_s = version.created_at_ms / 1000 - started_at
        if since_s <= within_s:
            for key, value in metrics.items():
                curves.setdefault(key, []).append((version.policy_version, value))
        lines.append(
            f"v{version.policy_version:<4d} {since_s / 60:5.1f} min  reward "
            f"{metrics['eval/reward']:.3f}  greedy {metrics.get('eval/greedy_accuracy', float('nan')):.3f}"
            f"  length {metrics['eval/response_length_mean']:5.1f}"
            + ("" if since_s <= within_s else "  (after the window: not in the table)")
        )
    return curves, lines


def run_train(command: list[str], workdir: Path, what: str) -> tuple[float, float]:
    """Run `command` (a `sluice train`) in `workdir`, its output to `workdir/train.log`;
    returns (its start as wall-clock time, its seconds). Exits naming `what` and showing
    the log's end if it fails."""
    started_at, started = time.time(), time.monotonic()
    log = workdir / "train.log"
    with log.open("w") as out:
        done = subprocess.run(command, cwd=workdir, stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - started
    if done.returncode != 0:
        print(log.read_text()[-3000:])
        raise SystemExit(f"{what}: sluice train exited {done.returncode}")
    return started_at, wall


def role_figures(workdir: Path) -> list[str]:
    """Peak memory, throughput and pace from the run's status documents."""
    from sluice.flows.run_dirs import absolute_store_settings, resolve_run
    from sluice.infra.config.run import load_config
    from sluice.tasks.run.paths import run_paths
    from sluice.tasks.run.status import read_statuses

    stores = absolute_store_settings(workdir)
    run_id, config = resolve_run(load_config(None, stores), None, stores)
    statuses = read_statuses(config, run_paths(config, run_id))
    memory = {role: s.get("peak_rss_mb") for role, s in statuses.items()}
    rollout, train = statuses.get("rollout", {}), statuses.get("train", {})
    if rollout.get("server_peak_rss_mb") is not None:
        memory["inference server"] = rollout["server_peak_rss_mb"]
    step = train.get("step") or 0
    pace = train.get("wall_time_s", float("nan")) / step if step else float("nan")
    return [
        "peak memory (MiB): "
        + ", ".join(f"{role} {mb:.0f}" for role, mb in memory.items() if mb is not None),
        f"generated {rollout.get('tokens_per_s', float('nan')):.1f} tok/s, trained "
        f"{train.get('trained_tokens_per_s', float('nan')):.1f} tok/s (last step), "
        f"{pace:.1f} s/step over {step} steps, trainer idle "
        f"{train.get('idle_ratio', float('nan')):.2f}, rollout idle "
        f"{rollout.get('idle_ratio', float('nan')):.2f}",
    ]


def run_seed(
    seed: int,
    overrides: list[str],
    config: str | None = None,
    eval_overrides: list[str] | None = None,
    within_s: float = float("inf"),
) -> tuple[float, dict[str, list[tuple[int, float]]]]:
    """Run one seed; with `eval_overrides` (not None) score its versions afterwards."""
    after = eval_overrides is not None
    with tempfile.TemporaryDirectory(prefix=f"sluice-{config or 'default'}-{seed}-") as scratch:
        workdir = Path(scratch)
        command = ["sluice", "train", *([config] if config else []), "--set", f"seed={seed}"]
        for item in [*overrides, *(["evaluation.during_run=false"] if after else [])]:
            command += ["--set", item]
        started_at, wall = run_train(command, workdir, f"seed {seed}")
        for line in role_figures(workdir):
            print(f"seed {seed}  {line}", flush=True)
        if not after:
            return wall, curves_of(workdir)
        curves, lines = score_after(workdir, started_at, eval_overrides or [], within_s)
        for line in lines:
            print(f"seed {seed}  {line}", flush=True)
        return wall, curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default=None, help="a config in flows/configs (default: default)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument(
        "--score-after",
        action="store_true",
        help="evaluate nothing during the run; score the kept versions after it",
    )
    parser.add_argument(
        "--eval-set",
        dest="eval_overrides",
        action="append",
        default=[],
        help="a scoring setting for --score-after (key=value)",
    )
    parser.add_argument(
        "--score-workdir",
        type=Path,
        default=None,
        help="with --score-after: score the finished run in this directory instead of "
        "training (its clock starts at the birth time of its train.log)",
    )
    parser.add_argument(
        "--target", type=float, default=0.25, help="Δ held-out reward the target asks"
    )
    parser.add_argument(
        "--within", type=float, default=300.0, help="wall seconds each seed may take"
    )
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}; sluice train {args.config or ''} --set seed=S "
        f"{' '.join(args.overrides)}"
    )
    if args.score_workdir is not None:
        log = args.score_workdir / "train.log"
        started_at = (
            os.stat(log).st_birthtime
            if hasattr(os.stat_result, "st_birthtime")
            else float(
                subprocess.run(
                    ["stat", "-c", "%W", str(log)], capture_output=True, text=True, check=True
                ).stdout
            )
        )
        for line in role_figures(args.score_workdir):
            print(line, flush=True)
        _, lines = score_after(args.score_workdir, started_at, args.eval_overrides, args.within)
        for line in lines:
            print(line, flush=True)
        return
    rows = []
    for seed in args.seeds:
        wall, curves = run_seed(
            seed,
            args.overrides,
            args.config,
            args.eval_overrides if args.score_after else None,
            args.within,
        )
        rows.append((seed, wall, curves))
        for key in [k for k in CURVES if k in curves]:
            points = "  ".join(f"v{v}:{r:.3f}" for v, r in curves[key])
            print(f"seed {seed}  wall {wall:5.0f} s  {key:22s} {points}", flush=True)
    keys = [key for key in CURVES if all(key in curves for _, _, curves in rows)]
    names = {
        "eval/reward": "held-out reward",
        "eval/greedy_accuracy": "greedy accuracy",
        "eval/calling_fraction": "calling the tool",
    }
    print()
    print("| seed | wall s | " + " | ".join(f"{names[k]} start → final (Δ)" for k in keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    deltas: dict[str, list[float]] = {key: [] for key in keys}
    for seed, wall, curves in rows:
        cells = []
        for key in keys:
            start, final = curves[key][0][1], curves[key][-1][1]
            deltas[key].append(final - start)
            cells.append(f"{start:.3f} → {final:.3f} ({final - start:+.3f})")
        print(f"| {seed} | {wall:.0f} | " + " | ".join(cells) + " |")
    walls = [w for _, w, _ in rows]
    mean = {k: (float(np.mean(v)), float(np.std(v))) for k, v in deltas.items()}
    print(
        f"| mean | {np.mean(walls):.0f} | "
        + " | ".join(f"Δ {mean[k][0]:+.3f} ± {mean[k][1]:.3f}" for k in keys)
        + " |"
    )
    # With --score-after the table's final version is the newest committed within the
    # window, whatever the command took to shut down after it.
    in_time = args.score_after or max(walls) <= args.within
    target = mean[CURVES[0]][0] >= args.target and in_time
    print(
        f"target (Δ held-out reward >= +{args.target:.2f} within {args.within:.0f} s, "
        f"mean of seeds): {'met' if target else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
