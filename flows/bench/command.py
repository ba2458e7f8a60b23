"""`sluice bench NAME`: the benchmark the arguments name, with its bench-sized defaults
under the user's `--set` (flows/cli.py checks the arguments first)."""

from __future__ import annotations

import argparse

from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import RunConfig


def run_bench(args: argparse.Namespace, config: RunConfig) -> int:
    if args.name == "determinism":
        return bench_determinism(config, args.overrides)
    # Bench-sized settings unless --set chose otherwise.
    from sluice.flows.bench.async_vs_sync import apply_bench_defaults

    seeds = args.seeds or 3
    if args.name in ("staleness", "mismatch"):
        from sluice.flows.bench.studies import STUDIES, bench_mismatch, bench_staleness

        config = apply_bench_defaults(config, args.overrides, STUDIES[args.name].defaults)
        if args.name == "staleness":
            bench_staleness(config, etas=args.etas, objectives=args.objectives, seeds=seeds)
        else:
            bench_mismatch(config, modes=args.modes, seeds=seeds)
        return 0
    if args.name == "time-to-target":
        from sluice.flows.bench.time_to_target import TTT_DEFAULTS, bench_time_to_target

        config = apply_bench_defaults(config, args.overrides, TTT_DEFAULTS)
        bench_time_to_target(
            config,
            args.variants,
            seeds=seeds,
            horizon_s=args.horizon or 300.0,
            delta=args.delta or 0.2,
        )
        return 0
    from sluice.flows.bench.async_vs_sync import bench_async_vs_sync

    bench_async_vs_sync(apply_bench_defaults(config, args.overrides), variants=args.variants)
    return 0


def bench_determinism(config: RunConfig, overrides: list[str]) -> int:
    """0 when both runs matched, 1 if not; `DEFAULT_STEPS` steps unless
    `--set trainer.total_steps=N` is given."""
    try:
        from sluice.flows.bench.determinism import (
            DEFAULT_STEPS,
            apply_check_defaults,
            determinism_check,
        )
    except ModuleNotFoundError as err:
        if err.name != "sluice.flows.bench.determinism":
            raise
        raise ConfigError("flows/bench/determinism.py is not in this checkout") from None
    explicit = {o.partition("=")[0].strip() for o in overrides}
    steps = config.trainer.total_steps if "trainer.total_steps" in explicit else DEFAULT_STEPS
    result = determinism_check(apply_check_defaults(config, overrides), steps)
    return 0 if result["matched"] else 1
