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

Run: ``python tests/benchmarks/bench_default_run.py [--config NAME] [--seeds 0 1 2] [--set key=value ...]``
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


def run_seed(
    seed: int, overrides: list[str], config: str | None = None
) -> tuple[float, dict[str, list[tuple[int, float]]]]:
    with tempfile.TemporaryDirectory(prefix=f"sluice-{config or 'default'}-{seed}-") as scratch:
        workdir = Path(scratch)
        command = ["sluice", "train", *([config] if config else []), "--set", f"seed={seed}"]
        for item in overrides:
            command += ["--set", item]
        started = time.monotonic()
        log = workdir / "train.log"
        with log.open("w") as out:
            done = subprocess.run(command, cwd=workdir, stdout=out, stderr=subprocess.STDOUT)
        wall = time.monotonic() - started
        if done.returncode != 0:
            print(log.read_text()[-3000:])
            raise SystemExit(f"seed {seed}: sluice train exited {done.returncode}")
        return wall, curves_of(workdir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default=None, help="a config in flows/configs (default: default)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}; sluice train {args.config or ''} --set seed=S "
        f"{' '.join(args.overrides)}"
    )
    rows = []
    for seed in args.seeds:
        wall, curves = run_seed(seed, args.overrides, args.config)
        rows.append((seed, wall, curves))
        for key in curves:
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
    target = mean[CURVES[0]][0] >= 0.25 and max(walls) <= 300
    print(
        f"target (Δ held-out reward >= +0.25 within 300 s, mean of seeds): {'met' if target else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
