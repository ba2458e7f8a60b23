"""`sluice` command line: parse and validate first, import the heavy parts after.

    sluice train [CONFIG] [--set key=value ...] [--resume RUN]
    sluice eval  [CONFIG] [--set ...] [--version N]
    sluice serve [CONFIG] ...            # Prefect deployments
    sluice bench NAME [--set ...]

A bad config fails here in milliseconds with one line, before torch, Prefect or
MLflow are imported.
"""

from __future__ import annotations

import argparse
import os
import sys

from infra.config import ConfigError, RunConfig, load_config

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
        "--version", type=int, default=None, help="policy version (default: newest)"
    )

    serve = sub.add_parser("serve", help="serve the flows as Prefect deployments")
    _add_config_args(serve)

    bench = sub.add_parser("bench", help="run a benchmark that prints side-by-side ratios")
    bench.add_argument("name", choices=["async-vs-sync"], help="benchmark to run")
    _add_config_args(bench)
    return parser


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, RunConfig]:
    args = build_parser().parse_args(argv)
    config = load_config(args.config, args.overrides)
    if getattr(args, "resume", None):
        config.name = args.resume
    return args, config


def main(argv: list[str] | None = None) -> int:
    try:
        args, config = parse(argv)
    except ConfigError as err:
        print(f"sluice: error: {err}", file=sys.stderr)
        return 2
    _quiet_environment()
    if args.command == "train":
        from flows.train import run_from_cli

        return run_from_cli(config, resume=bool(args.resume), sync=args.sync)
    if args.command == "eval":
        from flows.evaluate import run_from_cli as eval_from_cli

        return eval_from_cli(config, version=args.version)
    if args.command == "serve":
        from flows.deployments import serve_from_cli

        return serve_from_cli(config)
    if args.command == "bench":
        from flows.bench import run_from_cli as bench_from_cli

        return bench_from_cli(args.name, config)
    return 2


if __name__ == "__main__":
    sys.exit(main())
