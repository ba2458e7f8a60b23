"""What a newcomer sees: `sluice train` in a fresh directory, once per seed, timed.

Each seed runs the real command (`sluice train --set seed=S`) as a subprocess in its own
new temporary directory, so nothing is cached: Prefect's temporary API server, MLflow's
sqlite store, the roles' processes and the final evaluation are all on the clock. The
wall time is the command's, start to exit. Afterwards the script reads each run's
held-out curves from its MLflow store and prints them, then the mean over seeds.

Target (issue: "the main job learns clearly and fast"): held-out reward up by at least
0.25 within 5 minutes of wall time on 2 cores, on the mean of 3 seeds.

Run: ``python tests/benchmarks/bench_default_run.py [--seeds 0 1 2] [--set key=value ...]``
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

CURVES = ("eval/reward", "eval/greedy_accuracy")


def curves_of(workdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Held-out curves of the one run in `workdir`'s MLflow store, by metric."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / '.sluice' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sluice")
    (run,) = client.search_runs([experiment.experiment_id])
    return {
        key: sorted(
            (int(m.step), float(m.value)) for m in client.get_metric_history(run.info.run_id, key)
        )
        for key in CURVES
    }


def run_seed(seed: int, overrides: list[str]) -> tuple[float, dict[str, list[tuple[int, float]]]]:
    with tempfile.TemporaryDirectory(prefix=f"sluice-default-{seed}-") as scratch:
        workdir = Path(scratch)
        command = ["sluice", "train", "--set", f"seed={seed}"]
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
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}; sluice train --set seed=S {' '.join(args.overrides)}"
    )
    rows = []
    for seed in args.seeds:
        wall, curves = run_seed(seed, args.overrides)
        rows.append((seed, wall, curves))
        for key in CURVES:
            points = "  ".join(f"v{v}:{r:.3f}" for v, r in curves[key])
            print(f"seed {seed}  wall {wall:5.0f} s  {key:22s} {points}", flush=True)
    print()
    print(
        "| seed | wall s | held-out reward start → final (Δ) | greedy accuracy start → final (Δ) |"
    )
    print("|---|---|---|---|")
    deltas = {key: [] for key in CURVES}
    for seed, wall, curves in rows:
        cells = []
        for key in CURVES:
            start, final = curves[key][0][1], curves[key][-1][1]
            deltas[key].append(final - start)
            cells.append(f"{start:.3f} → {final:.3f} ({final - start:+.3f})")
        print(f"| {seed} | {wall:.0f} | {cells[0]} | {cells[1]} |")
    walls = [w for _, w, _ in rows]
    mean = {k: (float(np.mean(v)), float(np.std(v))) for k, v in deltas.items()}
    print(
        f"| mean | {np.mean(walls):.0f} | Δ {mean[CURVES[0]][0]:+.3f} ± {mean[CURVES[0]][1]:.3f} "
        f"| Δ {mean[CURVES[1]][0]:+.3f} ± {mean[CURVES[1]][1]:.3f} |"
    )
    target = mean[CURVES[0]][0] >= 0.25 and max(walls) <= 300
    print(
        f"target (Δ held-out reward >= +0.25 within 300 s, mean of seeds): {'met' if target else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
