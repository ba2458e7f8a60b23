"""Benchmark: how soon a run trains, with roles forked from the preloaded launcher or
started as fresh interpreters (`SLUICE_ROLE_LAUNCHER=fresh`, the old way).

Each trial calls the flow (async η=4, `flows/train.py`, or the colocated sync loop,
`flows/train_sync.py`) from the shipped warm-start policy with a short time budget and
reads the registry's commit times: seconds from the flow call to policy versions 1
and 10. Launcher settings alternate trial by trial, so a machine that slows down
hurts both alike. A throw-away run first starts the Prefect API, which would otherwise
land on the first trial's clock.

    python tests/benchmarks/bench_startup.py [--rounds 3 --budget-s 20]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from typing import Any

LAUNCHERS = ("fresh", "fork")
MODES = ("async η=4", "sync")


def trial(base: Any, mode: str, launcher: str, name: str, budget_s: float) -> dict[int, float]:
    from sluice.flows.bench.async_vs_sync import with_settings
    from sluice.flows.bench.time_to_target import ScoredRun
    from sluice.flows.train import train
    from sluice.flows.train_sync import train_sync

    config = with_settings(
        base,
        {
            "name": name,
            "trainer.time_budget_s": budget_s,
            "staleness.max_staleness": 4 if mode.startswith("async") else 0,
        },
    )
    os.environ["SLUICE_ROLE_LAUNCHER"] = launcher
    started = time.time()
    (train if mode.startswith("async") else train_sync)(config, run_id=name)
    return dict(ScoredRun(config, name, started).version_times())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=20.0)
    args = parser.parse_args()
    for var in ("DO_NOT_TRACK", "MLFLOW_DISABLE_TELEMETRY"):
        os.environ.setdefault(var, "true")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")

    from sluice.flows.bench.async_vs_sync import apply_bench_defaults, with_settings
    from sluice.flows.bench.studies import pin_initial_policy
    from sluice.flows.bench.time_to_target import TTT_DEFAULTS
    from sluice.infra.config.run import load_config

    with tempfile.TemporaryDirectory() as tmp:
        base = load_config("default")
        base = with_settings(base, {"workdir": tmp, "tracking.uri": f"sqlite:///{tmp}/mlflow.db"})
        base = pin_initial_policy(apply_bench_defaults(base, [], TTT_DEFAULTS))
        trial(base, "sync", "fresh", "warm-up", 5.0)  # starts the Prefect API
        results: dict[tuple[str, str], list[dict[int, float]]] = {}
        for r in range(args.rounds):
            for mode in MODES:
                order = LAUNCHERS if r % 2 == 0 else LAUNCHERS[::-1]
                for launcher in order:
                    name = (
                        f"startup-{r}-{'async' if mode.startswith('async') else 'sync'}-{launcher}"
                    )
                    times = trial(base, mode, launcher, name, args.budget_s)
                    results.setdefault((mode, launcher), []).append(times)

    def at(mode: str, launcher: str, version: int) -> list[float]:
        return [t[version] for t in results[(mode, launcher)] if version in t]

    def fmt(values: list[float]) -> str:
        if not values:
            return "-"
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.mean(values):.1f} ± {spread:.1f}"

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs; {args.rounds} rounds, budget {args.budget_s:g} s"
    )
    print("seconds from the flow call to the commit of policy version 1 and 10 (mean ± std):")
    print("| mode | launcher | version 1 | version 10 |")
    print("|---|---|---|---|")
    for mode in MODES:
        for launcher in LAUNCHERS:
            print(
                f"| {mode} | {launcher} | {fmt(at(mode, launcher, 1))} | {fmt(at(mode, launcher, 10))} |"
            )
    for mode in MODES:
        fresh, fork = at(mode, "fresh", 1), at(mode, "fork", 1)
        if fresh and fork:
            print(
                f"{mode}: first step fresh / fork = {statistics.mean(fresh) / statistics.mean(fork):.2f}x"
            )


if __name__ == "__main__":
    main()
