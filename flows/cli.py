"""`sluice` command line: parse and validate first, import the heavy parts after.

    sluice --version
    sluice train [CONFIG] [KEY=VALUE ...] [--resume RUN | --sync] [--dry-run]
    sluice status [RUN]                   # from another terminal: step, reward, each role
    sluice logs [RUN] [--role R] [-f]     # the roles' logs; -f follows them
    sluice eval  [CONFIG] [KEY=VALUE ...] [--run RUN] [--version N]
    sluice promote [RUN] [--version N] --to NAME[@ALIAS]   # into a long-lived MLflow model (flows/promote.py)
    sluice serve [CONFIG] ...             # Prefect deployments
    sluice bench NAME [--set ...]         # time-to-target | async-vs-sync | staleness | ...
    sluice bench time-to-target [--variant sync|'async η=4' ...] [--seeds N] [--horizon S] [--delta D]
    sluice bench staleness [--eta E ...] [--objective decoupled|naive ...] [--seeds N]
    sluice bench mismatch  [--mode none|token_tis|... ...] [--seeds N]
    sluice plan [CONFIG] [--from-run RUN ...] [--hardware GPU ...]
    sluice model import SRC DIR [--dtype D] [--force]

A bare KEY=VALUE after a command is `--set KEY=VALUE` (`sluice train reasoning_gym
trainer.lr=1e-5`; a `--set` of the same key wins); `--set workdir=DIR` tells `status`
and `logs` where the runs are. RUN defaults to the newest run there.

A bad config fails here in milliseconds with one line, before torch, Prefect or
MLflow are imported; `status`, `logs` and `train --dry-run` never import them. This
module parses, checks and dispatches; each command's body is its own module, imported
once the arguments are known to be good: flows/cli_train.py (`train`, and where to look
while it runs), flows/cli_dry_run.py, flows/cli_status.py, flows/cli_logs.py,
flows/cli_eval.py, flows/cli_serve.py, flows/cli_bench.py (`bench`'s arguments and
checks), flows/model_cli.py and flows/planner/. The one error line and the exit codes
of a stop are flows/cli_common.py's.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from sluice.engines.policy.importer import ModelImportError
from sluice.flows.cli_bench import add_bench_parser
from sluice.flows.cli_common import (
    add_config_args,
    add_overrides_arg,
    exit_code,
    fail,
    interruption,
)
from sluice.flows.cli_eval import format_eval_result as format_eval_result  # re-exported
from sluice.flows.cli_serve import run_serve as run_serve  # re-exported
from sluice.flows.model_cli import add_model_parser, run_model
from sluice.flows.planner.args import add_plan_parser
from sluice.flows.promote import add_promote_parser, run_promote
from sluice.flows.run_dirs import resolve_run
from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import RunConfig, load_config
from sluice.infra.extras import check_extras

QUIET_ENV = {
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # A cold ephemeral Prefect API takes 10-20 s on a small machine.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "TOKENIZERS_PARALLELISM": "false",
}
DISTRIBUTION = "sluice-rl"
"""The distribution `pip install` puts Sluice in (pyproject.toml's [project] name)."""
RUN_READERS = ("status", "logs")
"""Commands that read a run's files and nothing else (no config of their own: RUN)."""
STARTS_RUNS = ("train", "bench", "serve")
"""Commands that run (or serve) their config, so it must find the extras it chooses."""


def _quiet_environment() -> None:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


def installed_version() -> str:
    """The version of the installed distribution that holds the `sluice` package."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # renamed: the slower lookup, by the package it holds
        for name in packages_distributions().get("sluice", []):
            return version(name)
    return "unknown (not installed: pip install -e .)"


class _PrintVersion(argparse.Action):
    """`--version`: the installed distribution's version, read only when asked for."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(f"sluice {installed_version()}")
        parser.exit()


def _add_run_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run",
        nargs="?",
        default=None,
        metavar="RUN",
        help="run id (default: the newest under {workdir}/runs)",
    )
    add_overrides_arg(parser, example="workdir=DIR (where the runs are)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice", description="Asynchronous RL for LLMs on verifiable reasoning tasks."
    )
    parser.add_argument("--version", action=_PrintVersion, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run asynchronous RL (the main job)")
    add_config_args(train)
    train.add_argument(
        "--resume", metavar="RUN", help="continue run RUN from its newest committed version"
    )
    train.add_argument(
        "--sync", action="store_true", help="run the synchronous colocated baseline instead"
    )
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config, the processes the run would start and an estimate "
        "of their memory, then exit without starting anything",
    )

    status = sub.add_parser(
        "status", help="where a run stands: step, reward, staleness, tokens/s, each role"
    )
    _add_run_arg(status)
    logs = sub.add_parser("logs", help="print a run's role logs (-f: follow them)")
    _add_run_arg(logs)
    logs.add_argument("--role", metavar="R", help="this role's log only (default: every log)")
    logs.add_argument(
        "-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C"
    )

    evaluate = sub.add_parser(
        "eval", help="evaluate a committed policy version on held-out prompts"
    )
    add_config_args(evaluate)
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
    add_config_args(serve)
    add_bench_parser(sub)
    add_plan_parser(sub)
    add_model_parser(sub)
    add_promote_parser(sub)
    return parser


def parse_args(
    parser: argparse.ArgumentParser, argv: list[str] | None = None
) -> argparse.Namespace:
    """The command line, with the bare words after the command sorted out: KEY=VALUE is
    `--set KEY=VALUE` (before the --set ones, so those win), another word the command's
    CONFIG (RUN for `status`, `logs` and `promote`). Two of those raise ConfigError."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extras = parser.parse_known_args(argv)
    options = [word for word in extras if word.startswith("-")]
    if options or (extras and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(options or extras)}")
    if not hasattr(args, "overrides"):  # `model`: no config
        return args
    slot = "run" if args.command in (*RUN_READERS, "promote") else "config"
    given = getattr(args, slot, None)
    words = ([given] if given is not None and given in argv else []) + extras
    settings = [word for word in words if "=" in word and not Path(word).exists()]
    names = [word for word in words if word not in settings]
    if len(names) > 1:
        what = "run" if slot == "run" else "config"
        raise ConfigError(
            f"two {what} names given, '{names[0]}' and '{names[1]}': name one, and set "
            "keys with KEY=VALUE or --set KEY=VALUE"
        )
    default = None if slot == "run" else "default"
    setattr(args, slot, names[0] if names else default)
    args.overrides = [*settings, *args.overrides]
    return args


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, RunConfig]:
    return check_args(parse_args(build_parser(), argv))


def check_args(args: argparse.Namespace) -> tuple[argparse.Namespace, RunConfig]:
    """The run config a command's arguments name, validated."""
    if getattr(args, "sync", False) and getattr(args, "resume", None):
        raise ConfigError(
            "--resume continues an asynchronous run; 'sluice train --sync' always starts "
            "a new run (drop --sync to resume, or --resume to start a new sync run)"
        )
    config = load_config(args.config, args.overrides)
    if getattr(args, "sync", False) and config.episode.tools:
        raise ConfigError(
            "episode.tools runs multi-turn episodes in the asynchronous pipeline; the "
            "colocated 'sluice train --sync' baseline generates single responses (drop "
            "--sync, or set episode.tools=[])"
        )
    if args.command == "bench":
        from sluice.flows.cli_bench import check_bench_args

        check_bench_args(args, config)
    if getattr(args, "resume", None):
        # Resuming under other storage, tracking or batch settings would silently start
        # a different run, so the run's own saved config wins over CONFIG.
        _, config = resolve_run(config, args.resume, args.overrides)
    elif config.model.path and args.command in ("train", "bench"):
        # A resumed run's version 0 is already committed; a new one must be trainable.
        from sluice.engines.policy.model_dir import ModelDirError, check_model_dir

        try:
            check_model_dir(config.model.path, config.model.chat_template)
        except ModelDirError as err:
            raise ConfigError(str(err)) from None
        if config.trainer.lora.rank:  # the adapters' modules and rank, before anything runs
            from sluice.engines.rl import lora

            try:
                lora.check_model_dir(
                    config.model.path, lora.LoraSettings(**config.trainer.lora.model_dump())
                )
            except lora.LoraError as err:
                raise ConfigError(str(err)) from None
    if args.command in STARTS_RUNS:
        # Before the Ray probe and anything else a missing package would break: one line
        # naming the extra, not an ImportError from a role process (infra/extras.py).
        check_extras(config)
    if config.cluster.engine == "ray" and config.cluster.address and args.command == "train":
        # Before anything is created: ray.init itself waits minutes on a dead address.
        from sluice.flows.cluster import ClusterError, probe_address

        try:
            probe_address(config.cluster.address)
        except ClusterError as err:
            raise ConfigError(str(err)) from None
    if args.command in ("train", "bench"):
        # Before anything is created: a missing key or a dead endpoint would otherwise
        # surface as a botocore traceback from the flow's first write.
        from sluice.infra.storage import StorageUnavailable, probe_storage

        try:
            probe_storage(config.storage.url, config.storage.options)
        except StorageUnavailable as err:
            raise ConfigError(str(err)) from None
    return args, config


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parse_args(parser, argv)
    except ConfigError as err:
        return fail(err)
    if args.command == "model":  # takes no run config
        _quiet_environment()
        try:
            return run_model(args)
        except ModelImportError as err:
            return fail(err)
    if args.command in RUN_READERS:
        return read_run(args)
    if args.command == "promote":  # RUN's own saved config
        _quiet_environment()
        return run_promote(args)
    try:
        args, config = check_args(args)
    except ConfigError as err:
        return fail(err)
    if args.command == "train" and args.dry_run:
        from sluice.flows.cli_dry_run import dry_run_report

        print(dry_run_report(config, args.config, sync=args.sync, resume=args.resume))
        return 0
    _quiet_environment()
    # SIGTERM ends a command as Ctrl-C does: the run's roles stop, the temporary Prefect
    # server is shut down, one line says so. Inside a flow Prefect's own handler raises
    # the same exception.
    from prefect.exceptions import TerminationSignal

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if in_main_thread else None
    try:
        return run_command(args, config)
    except (KeyboardInterrupt, TerminationSignal) as stop:
        if args.command == "serve":  # how serving is meant to end
            return 0
        return fail(f"{args.command} stopped: {interruption(stop)}", exit_code(stop))
    finally:
        if in_main_thread:  # main() called in a process of the caller's: leave it as it was
            signal.signal(signal.SIGTERM, previous)


def _terminated(signum: int, _frame: Any) -> None:
    from prefect.exceptions import TerminationSignal

    raise TerminationSignal(signum)


def read_run(args: argparse.Namespace) -> int:
    """`sluice status` and `sluice logs`: a run's own files, nothing started or imported
    beyond them. The run is looked for under the workdir of the defaults and --set."""
    try:
        where = load_config(None, args.overrides)
        purpose = "show" if args.command == "status" else "read logs of"
        run_id, config = resolve_run(where, args.run, args.overrides, purpose)
    except ConfigError as err:
        return fail(err)
    run_dir = Path(where.workdir) / "runs" / run_id
    if args.command == "status":
        from sluice.flows.cli_status import run_status

        return run_status(config, run_id, run_dir)
    from sluice.flows.cli_logs import run_logs

    return run_logs(run_id, run_dir, args.role, args.follow, config)


def run_command(args: argparse.Namespace, config: RunConfig) -> int:
    """The command `args` names, its arguments checked."""
    if args.command == "train":
        from sluice.flows.cli_train import run_train

        return run_train(config, resume=args.resume, sync=args.sync)
    if args.command == "eval":
        from sluice.flows.cli_eval import run_eval

        try:
            run_id, config = resolve_run(config, args.run, args.overrides)
        except ConfigError as err:
            return fail(err)
        return run_eval(config, run_id=run_id, version=args.version)
    if args.command == "serve":
        return run_serve(config)
    if args.command == "bench":
        from sluice.flows.bench.command import run_bench

        try:
            return run_bench(args, config)
        except ConfigError as err:  # a benchmark this checkout does not hold
            return fail(err)
    if args.command == "plan":
        from sluice.flows.planner.plan import run_plan

        try:
            return run_plan(args, config)
        except (ConfigError, ValueError) as err:  # bad input or a run lacking measurements
            return fail(err)
    return 2


if __name__ == "__main__":
    sys.exit(main())
