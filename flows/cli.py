"""`sluice` command line: parse and validate first, import the heavy parts after.

    sluice train [CONFIG] [--set key=value ...] [--resume RUN]
    sluice eval  [CONFIG] [--set ...] [--run RUN] [--version N]
    sluice serve [CONFIG] ...            # Prefect deployments
    sluice bench NAME [--set ...]         # time-to-target | async-vs-sync | staleness | ...
    sluice bench time-to-target [--variant sync|'async η=4' ...] [--seeds N] [--horizon S] [--delta D]
    sluice bench staleness [--eta E ...] [--objective decoupled|naive ...] [--seeds N]
    sluice bench mismatch  [--mode none|token_tis|... ...] [--seeds N]

A bad config fails here in milliseconds with one line, before torch, Prefect or
MLflow are imported.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import get_args

from infra.config import ConfigError, CorrectionConfig, RunConfig, load_config

BENCHMARKS = ["time-to-target", "async-vs-sync", "staleness", "mismatch", "determinism"]
CORRECTION_MODES: tuple[str, ...] = get_args(CorrectionConfig.model_fields["mode"].annotation)

QUIET_ENV = {
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # A cold ephemeral Prefect API takes 10-20 s on a small machine.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "TOKENIZERS_PARALLELISM": "false",
}


def _quiet_environment() -> None:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        default="default",
        help="YAML config file, or the name of one in flows/configs (default: default)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set staleness.max_staleness=4 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice", description="Asynchronous RL for LLMs on verifiable reasoning tasks."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run asynchronous RL (the main job)")
    _add_config_args(train)
    train.add_argument(
        "--resume", metavar="RUN", help="continue run RUN from its newest committed version"
    )
    train.add_argument(
        "--sync", action="store_true", help="run the synchronous colocated baseline instead"
    )

    evaluate = sub.add_parser(
        "eval", help="evaluate a committed policy version on held-out prompts"
    )
    _add_config_args(evaluate)
    evaluate.add_argument(
        "--run",
        metavar="RUN",
        default=None,
        help="run to evaluate (default: the newest under {workdir}/runs); its saved config "
        "is used, with --set applied on top",
    )
    evaluate.add_argument(
        "--version", type=int, default=None, help="policy version (default: newest)"
    )

    serve = sub.add_parser("serve", help="serve the flows as Prefect deployments")
    _add_config_args(serve)

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
        "time-to-target: only this contender, 'sync', 'async η=1' or 'async η=4' (repeatable)",
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
    _add_config_args(bench)
    return parser


def check_bench_args(args: argparse.Namespace, config: RunConfig) -> None:
    """Study options that cannot apply fail here, before anything is imported or run."""
    from flows.study_stats import VARIED_KEYS

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
        from flows.study_stats import TIME_TO_TARGET_CONTENDERS

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
    if args.name == "mismatch" and not config.trainer.loss.decoupled:
        raise ConfigError(
            "'sluice bench mismatch' compares rollout corrections, which only the decoupled "
            "objective applies; drop --set trainer.loss.decoupled=false"
        )


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, RunConfig]:
    args = build_parser().parse_args(argv)
    config = load_config(args.config, args.overrides)
    if args.command == "bench":
        check_bench_args(args, config)
    if getattr(args, "resume", None):
        # Resuming under other storage, tracking or batch settings would silently start
        # a different run, so the run's own saved config wins over CONFIG.
        _, config = resolve_run(config, args.resume, args.overrides)
    return args, config


def resolve_run(config: RunConfig, run: str | None, overrides: list[str]) -> tuple[str, RunConfig]:
    """An earlier run (for `sluice eval` or `--resume`) and its own config, `--set` on top.

    `sluice train` saves each run's resolved config as {workdir}/runs/{run}/config.json.
    Evaluating with it, not with CONFIG, keeps storage and MLflow pointing where the run
    wrote its checkpoints and registry; CONFIG and --set only have to locate the workdir.
    No `run` means the run whose config was written last (a resume rewrites it).
    Raises ConfigError with one line naming the run.
    """
    runs_dir = Path(config.workdir) / "runs"
    saved = sorted(
        runs_dir.glob("*/config.json"), key=lambda path: (path.stat().st_mtime, path.parent.name)
    )
    if run is None:
        if not saved:
            raise ConfigError(
                f"no runs to evaluate under {runs_dir} (none has a config.json); "
                "train one with 'sluice train' or point --set workdir=... at its workdir"
            )
        path = saved[-1]
    else:
        path = runs_dir / run / "config.json"
        # A run id is one directory name: anything else would resolve outside runs_dir.
        if Path(run).name != run or run.startswith(".") or not path.is_file():
            names = sorted(p.parent.name for p in saved)
            known = f"; runs there: {', '.join(names[-5:])}" if names else ""
            raise ConfigError(f"run '{run}' not found: no {path}{known}")
    return path.parent.name, load_config(path, overrides)


def main(argv: list[str] | None = None) -> int:
    try:
        args, config = parse(argv)
    except ConfigError as err:
        print(f"sluice: error: {err}", file=sys.stderr)
        return 2
    _quiet_environment()
    if args.command == "train":
        from flows.train import run_from_cli

        return run_from_cli(config, resume=args.resume, sync=args.sync)
    if args.command == "eval":
        try:
            run_id, config = resolve_run(config, args.run, args.overrides)
        except ConfigError as err:
            print(f"sluice: error: {err}", file=sys.stderr)
            return 2
        from flows.evaluate import run_from_cli as eval_from_cli

        return eval_from_cli(config, run_id=run_id, version=args.version)
    if args.command == "serve":
        from flows.deployments import serve_from_cli

        return serve_from_cli(config)
    if args.command == "bench":
        return run_bench(args, config)
    return 2


def run_bench(args: argparse.Namespace, config: RunConfig) -> int:
    if args.name == "determinism":
        try:
            from flows.determinism import run_from_cli as determinism_from_cli
        except ModuleNotFoundError as err:
            if err.name != "flows.determinism":
                raise
            print("sluice: error: flows/determinism.py is not in this checkout", file=sys.stderr)
            return 2
        return determinism_from_cli(config, args.overrides)
    if args.name in ("staleness", "mismatch"):
        from flows.studies import run_from_cli as study_from_cli

        return study_from_cli(
            args.name,
            config,
            args.overrides,
            etas=args.etas,
            objectives=args.objectives,
            modes=args.modes,
            seeds=args.seeds or 3,
        )
    if args.name == "time-to-target":
        from flows.time_to_target import run_from_cli as ttt_from_cli

        return ttt_from_cli(
            config,
            args.overrides,
            contenders=args.variants,
            seeds=args.seeds or 3,
            horizon_s=args.horizon or 300.0,
            delta=args.delta or 0.2,
        )
    from flows.bench import run_from_cli as bench_from_cli

    return bench_from_cli(args.name, config, args.overrides, args.variants)


if __name__ == "__main__":
    sys.exit(main())
