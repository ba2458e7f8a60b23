"""`sluice bench NAME`: its arguments, and the study options that cannot apply, refused
before anything is imported or run. The benchmarks themselves are flows/bench/."""

from __future__ import annotations

import argparse
from typing import Any, get_args

from sluice.flows.cli_common import add_config_args
from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import RunConfig
from sluice.infra.config.trainer import CorrectionConfig

BENCHMARKS = ["time-to-target", "async-vs-sync", "staleness", "mismatch", "determinism"]
CORRECTION_MODES: tuple[str, ...] = get_args(CorrectionConfig.model_fields["mode"].annotation)


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench", help="run a benchmark or study that prints a side-by-side table"
    )
    bench.add_argument("name", choices=BENCHMARKS, help="benchmark to run")
    bench.add_argument(
        "--variant",
        dest="variants",
        action="append",
        default=None,
        metavar="LABEL",
        help="async-vs-sync: run only this variant, e.g. 'sync' or 'async η=4 interrupt'; "
        "time-to-target: only this contender, 'sync', 'async η=1', 'async η=4', or 'async "
        "η=config' and 'async η=config dynamic' (the config's η, without and with dynamic "
        "sampling; run only when named) (repeatable)",
    )
    bench.add_argument(
        "--horizon",
        type=float,
        default=None,
        metavar="S",
        help="time-to-target: wall-clock seconds each run gets, start-up included (default 300)",
    )
    bench.add_argument(
        "--delta",
        type=float,
        default=None,
        metavar="D",
        help="time-to-target: the target is the start's held-out reward + D (default 0.2)",
    )
    bench.add_argument(
        "--eta",
        dest="etas",
        action="append",
        type=int,
        default=None,
        metavar="E",
        help="staleness: run only max staleness E (repeatable; default 0 1 2 4 8)",
    )
    bench.add_argument(
        "--objective",
        dest="objectives",
        action="append",
        choices=["decoupled", "naive"],
        default=None,
        help="staleness: run only this objective (repeatable; default both)",
    )
    bench.add_argument(
        "--mode",
        dest="modes",
        action="append",
        choices=list(CORRECTION_MODES),
        default=None,
        help="mismatch: run only this correction mode (repeatable; default none token_tis "
        "sequence_mis geometric_rs)",
    )
    bench.add_argument(
        "--seeds",
        type=int,
        default=None,
        metavar="N",
        help="time-to-target, staleness, mismatch: seeds per cell, seed .. seed+N-1 (default 3; "
        "--set seed=S shifts them)",
    )
    add_config_args(bench)


def check_bench_args(args: argparse.Namespace, config: RunConfig) -> None:
    """Study options that cannot apply fail here, before anything is imported or run."""
    from sluice.flows.bench.study_stats import VARIED_KEYS, contender_keys

    allowed = {
        ("variants", "--variant"): {"async-vs-sync", "time-to-target"},
        ("etas", "--eta"): {"staleness"},
        ("objectives", "--objective"): {"staleness"},
        ("modes", "--mode"): {"mismatch"},
        ("seeds", "--seeds"): {"staleness", "mismatch", "time-to-target"},
        ("horizon", "--horizon"): {"time-to-target"},
        ("delta", "--delta"): {"time-to-target"},
    }
    for (option, flag), benches in allowed.items():
        if getattr(args, option) is not None and args.name not in benches:
            raise ConfigError(
                f"{flag} applies to 'sluice bench {' / '.join(sorted(benches))}' only"
            )
    if args.seeds is not None and args.seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {args.seeds}")
    if args.horizon is not None and not args.horizon > 0:
        raise ConfigError(f"--horizon must be > 0 seconds, got {args.horizon}")
    if args.delta is not None and not args.delta > 0:
        raise ConfigError(f"--delta must be > 0, got {args.delta}")
    if args.name == "time-to-target" and args.variants:
        from sluice.flows.bench.study_stats import TIME_TO_TARGET_CONTENDERS

        unknown = [v for v in args.variants if v not in TIME_TO_TARGET_CONTENDERS]
        if unknown:
            raise ConfigError(
                f"unknown contender(s) {unknown}; known: {list(TIME_TO_TARGET_CONTENDERS)}"
            )
    if any(e < 0 for e in args.etas or []):
        raise ConfigError(f"--eta must be >= 0, got {args.etas}")
    explicit = {o.partition("=")[0].strip() for o in args.overrides}
    for key, flag in VARIED_KEYS.get(args.name, {}).items():
        if key in explicit:
            raise ConfigError(
                f"'sluice bench {args.name}' sets {key} in every cell; choose values with {flag}"
            )
    clash = (
        sorted(contender_keys(args.variants) & explicit) if args.name == "time-to-target" else []
    )
    if clash:
        raise ConfigError(
            f"'sluice bench time-to-target' contenders {args.variants or 'by default'} set "
            f"{clash[0]} themselves; choose contenders with --variant (the 'η=config' ones "
            "keep the config's η)"
        )
    if args.name == "mismatch" and not config.trainer.loss.decoupled:
        raise ConfigError(
            "'sluice bench mismatch' compares rollout corrections, which only the decoupled "
            "objective applies; drop --set trainer.loss.decoupled=false"
        )
