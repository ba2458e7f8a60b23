"""Benchmark: cost of one registry commit and one metric log as a run's version count grows.

A week-long run commits thousands of policy versions to one registered model. This
commits versions 1..N of a fresh registry (sqlite, as `sluice train` uses) and prints
the median seconds per `commit` and per `log_metrics` call around each checkpoint of
N, with a reader process polling the alias every 0.5 s as the rollout role does.

    python tests/benchmarks/bench_registry_growth.py [--versions 400]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

from sluice.infra.checkpoints import save_checkpoint
from sluice.infra.registry import CheckpointRegistry
from sluice.infra.tracking import get_client, log_metrics, start_or_resume_run


def poll(uri: str, stop: multiprocessing.Event) -> None:
    registry = CheckpointRegistry(uri, "growth")
    while not stop.is_set():
        registry.newest_servable()
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        uri = f"sqlite:///{root / 'mlflow.db'}"
        get_client(uri)
        run = start_or_resume_run(uri, "growth", run_name="growth")
        registry = CheckpointRegistry(uri, "growth")
        weights = root / "weights"
        weights.mkdir()
        (weights / "model.safetensors").write_bytes(b"\0" * 1_000_000)
        stop = multiprocessing.Event()
        reader = multiprocessing.Process(target=poll, args=(uri, stop), daemon=True)
        reader.start()
        commits: list[float] = []
        logs: list[float] = []
        print(f"{'versions':>8} {'commit s (median of 20)':>24} {'log_metrics s':>14}")
        for version in range(args.versions + 1):
            uri_v = save_checkpoint(weights, f"file://{root}/ckpt/v{version:06d}")
            t0 = time.perf_counter()
            registry.commit(version, uri_v, run_id=run)
            t1 = time.perf_counter()
            log_metrics(uri, run, {f"m/{k}": float(k) for k in range(40)}, step=version)
            t2 = time.perf_counter()
            commits.append(t1 - t0)
            logs.append(t2 - t1)
            if version and version % 100 == 0:
                print(
                    f"{version:>8} {statistics.median(commits[-20:]):>24.3f} "
                    f"{statistics.median(logs[-20:]):>14.3f}"
                )
        stop.set()
        reader.join(5)


if __name__ == "__main__":
    main()
