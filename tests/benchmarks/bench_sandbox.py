"""Benchmark: what a code reward costs in each sandbox, measured side by side.

For the same honest program (a function and three asserts), one invocation measures:

- process: the process sandbox (``sluice.engines.env.sandbox.run_python``), one run after another;
- docker, no pool: a container created and started for each run;
- docker, warm pool: runs taking containers the pool started ahead, one after another,
  and with ``--threads`` verifier threads at once (the pool refills behind them).

Needs a Docker engine and the base image (``bash infra/docker/engine.sh``).

    python tests/benchmarks/bench_sandbox.py [--samples 20 --pool 2 --threads 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import platform
import statistics
import time

from sluice.engines.env.sandbox import run_python
from sluice.infra.docker_sandbox import DockerSandbox

CODE = "def square(x):\n    return x * x"
TESTS = "assert square(3) == 9\nassert square(-2) == 4\nassert square(0) == 0"


def timed(run, samples: int) -> list[float]:
    seconds = []
    for _ in range(samples):
        started = time.perf_counter()
        assert run(CODE, TESTS, timeout_s=10).passed
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--pool", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    rows: dict[str, tuple[float, float]] = {}  # name -> (median s per sample, samples/s)
    process = timed(run_python, args.samples)
    rows["process"] = (statistics.median(process), len(process) / sum(process))

    with DockerSandbox(pool_size=0) as no_pool:  # every run starts its container
        cold = timed(no_pool.run_python, max(3, args.samples // 4))
    rows["docker, no pool (cold start)"] = (statistics.median(cold), len(cold) / sum(cold))

    with DockerSandbox(pool_size=args.pool) as sandbox:
        time.sleep(3 * args.pool)  # let the pool fill
        warm = timed(sandbox.run_python, args.samples)
        rows["docker, warm pool, 1 thread"] = (statistics.median(warm), len(warm) / sum(warm))
        time.sleep(3 * args.pool)
        started = time.perf_counter()
        with cf.ThreadPoolExecutor(args.threads) as pool:
            per_thread = list(
                pool.map(lambda _: timed(sandbox.run_python, 1)[0], range(args.samples))
            )
        wall = time.perf_counter() - started
        rows[f"docker, warm pool, {args.threads} threads"] = (
            statistics.median(per_thread),
            args.samples / wall,
        )

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; {args.samples} samples each; "
        f"pool {args.pool}"
    )
    print("| sandbox | median s per sample | samples/s | vs process |")
    print("|---|---|---|---|")
    base = rows["process"][1]
    for name, (median, rate) in rows.items():
        print(f"| {name} | {median:.3f} | {rate:.2f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
