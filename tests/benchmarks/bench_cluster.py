"""Benchmark: what placing the roles through Ray costs, against the local launcher.

The default job (the shipped warm-start policy on the built-in task) runs to
`--steps` versions, once with the roles forked by the local launcher
(`cluster.engine: local`) and once with each role's Prefect task placed by Ray on a
one-node instance started for the run (`cluster.engine: ray`), the same settings
otherwise. The two alternate round by round (which goes first rotates), so a machine
that slows down hurts both alike, and all trials share one Prefect API (started first,
off the clock). Read from the registry's commit times:

- start-up: seconds from the flow call to policy version 10 (Ray's own start-up, the
  workers' imports and the roles' included);
- pace: seconds per step from version 10 to the last.

Target (issue: "Sluice on a cluster"): Ray no more than 10% slower per step.

`--server-actors` adds a third arm: Ray with the inference server as a Ray actor
(`servers.launch: ray`) instead of the rollout role's embedded child process.

    python tests/benchmarks/bench_cluster.py [--rounds 2 --steps 40 --server-actors]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from typing import Any

ARMS: dict[str, dict[str, str]] = {
    "local": {"cluster.engine": "local"},
    "ray": {"cluster.engine": "ray"},
    "ray-actors": {"cluster.engine": "ray", "servers.launch": "ray"},
}
START_VERSION = 10


def trial(base: Any, engine: str, name: str, steps: int) -> dict[int, float]:
    from sluice.flows.bench.async_vs_sync import with_settings
    from sluice.flows.bench.time_to_target import ScoredRun
    from sluice.flows.train import train

    config = with_settings(base, {"name": name, **ARMS[engine], "trainer.total_steps": steps})
    started = time.time()
    train(config, run_id=name)
    return dict(ScoredRun(config, name, started).version_times())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--server-actors", action="store_true", help="add Ray with the server as an actor"
    )
    args = parser.parse_args()
    engines = list(ARMS) if args.server_actors else ["local", "ray"]
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    for name, value in (
        ("DO_NOT_TRACK", "true"),
        ("MLFLOW_DISABLE_TELEMETRY", "true"),
        ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
    ):
        os.environ.setdefault(name, value)
    from prefect import flow

    from sluice.infra.config.run import load_config

    root = tempfile.mkdtemp(prefix="sluice-bench-cluster-")
    os.chdir(root)
    base = load_config("default", ["evaluation.during_run=false", "seed=0"])

    @flow(name="warm-up")
    def warm_up() -> None:
        """Start the Prefect API before the clock runs."""

    warm_up()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}; default job to version {args.steps}, "
        f"{args.rounds} rounds"
    )
    startup: dict[str, list[float]] = {engine: [] for engine in engines}
    pace: dict[str, list[float]] = {engine: [] for engine in engines}
    for round_ in range(args.rounds):
        shift = round_ % len(engines)  # who goes first rotates
        for engine in engines[shift:] + engines[:shift]:
            times = trial(base, engine, f"bench-{engine}-{round_}-{int(time.time())}", args.steps)
            last = max(times)
            start, per_step = (
                times[START_VERSION],
                (times[last] - times[START_VERSION]) / (last - START_VERSION),
            )
            startup[engine].append(start)
            pace[engine].append(per_step)
            print(
                f"round {round_} {engine:10s}: version {START_VERSION} at {start:6.1f} s, "
                f"{per_step:.3f} s/step over versions {START_VERSION}..{last}",
                flush=True,
            )
    median = {e: (statistics.median(startup[e]), statistics.median(pace[e])) for e in engines}
    print()
    print("| engine | start-up to version 10 (s, median) | s/step after it (median) |")
    print("|---|---|---|")
    for engine in engines:
        print(f"| {engine} | {median[engine][0]:.1f} | {median[engine][1]:.3f} |")
    for engine in engines[1:]:
        slower = median[engine][1] / median["local"][1] - 1
        print(
            f"{engine} / local: start-up {median[engine][0] / median['local'][0]:.2f}x, "
            f"per step {100 * slower:+.1f}% "
            f"(target <= +10%: {'met' if slower <= 0.10 else 'NOT met'})"
        )


if __name__ == "__main__":
    main()
