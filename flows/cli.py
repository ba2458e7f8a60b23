"""`sluice` command line: parse and validate first, import the heavy parts after.

    sluice train [CONFIG] [--set key=value ...] [--resume RUN | --sync]
    sluice eval  [CONFIG] [--set ...] [--run RUN] [--version N]
    sluice serve [CONFIG] ...            # Prefect deployments
    sluice bench NAME [--set ...]         # time-to-target | async-vs-sync | staleness | ...
    sluice bench time-to-target [--variant sync|'async η=4' ...] [--seeds N] [--horizon S] [--delta D]
    sluice bench staleness [--eta E ...] [--objective decoupled|naive ...] [--seeds N]
    sluice bench mismatch  [--mode none|token_tis|... ...] [--seeds N]
    sluice model import SRC DIR [--dtype D] [--force]   # flows/model_cli.py

A bad config fails here in milliseconds with one line, before torch, Prefect or
MLflow are imported. Every command lives here (exit codes, error lines, what is
printed), except `sluice model`'s parser and output (flows/model_cli.py); the flows it
calls (flows/train.py, flows/evaluate.py, flows/bench/async_vs_sync.py, ...) are
imported only once the arguments are known to be good.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any, get_args

from sluice.engines.policy.importer import ModelImportError
from sluice.flows.model_cli import add_model_parser, run_model
from sluice.flows.planner.args import add_plan_parser
from sluice.flows.run_dirs import resolve_run
from sluice.infra.config import ConfigError, CorrectionConfig, RunConfig, load_config

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
    _add_config_args(bench)
    add_plan_parser(sub)
    add_model_parser(sub)
    return parser


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


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, RunConfig]:
    return check_args(build_parser().parse_args(argv))


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
    args = build_parser().parse_args(argv)
    if args.command == "model":  # takes no run config
        _quiet_environment()
        try:
            return run_model(args)
        except ModelImportError as err:
            return fail(err)
    try:
        args, config = check_args(args)
    except ConfigError as err:
        return fail(err)
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


def interruption(stop: BaseException) -> str:
    """What stopped a command, in words: Ctrl-C or the signal's name."""
    signum = getattr(stop, "signal", signal.SIGINT)
    return (
        "interrupted (Ctrl-C)"
        if signum == signal.SIGINT
        else f"{signal.Signals(signum).name} received"
    )


def exit_code(stop: BaseException) -> int:
    """128 + the signal's number, as a shell reports a command a signal ended."""
    return 128 + int(getattr(stop, "signal", signal.SIGINT))


def run_command(args: argparse.Namespace, config: RunConfig) -> int:
    """The command `args` names, its arguments checked."""
    if args.command == "train":
        return run_train(config, resume=args.resume, sync=args.sync)
    if args.command == "eval":
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


def fail(err: Exception | str, code: int = 2) -> int:
    """One error line on stderr; the exit code."""
    print(f"sluice: error: {err}", file=sys.stderr)
    return code


# ---------------------------------------------------------------- sluice train


def run_train(config: RunConfig, resume: str | None = None, sync: bool = False) -> int:
    from sluice.tasks.process.supervisor import RunStopped, quiet_run_stopped_tracebacks

    quiet_run_stopped_tracebacks()
    if sync:
        from sluice.flows.train_sync import train_sync

        try:
            result = train_sync(config)
        except RunStopped as err:
            return fail(err, err.exit_code)
        print_where_to_look(config, result)
        return 0
    from prefect.exceptions import TerminationSignal

    from sluice.flows.run_claim import new_run_id
    from sluice.flows.train import ResumeError, train

    run_id = resume or new_run_id(config)
    try:
        result = train(config, run_id=run_id, resume=bool(resume))
    except ResumeError as err:
        return fail(err)
    except RunStopped as err:  # an outage outlasted the wait, a checkpoint was damaged
        return fail(err, err.exit_code)
    except (KeyboardInterrupt, TerminationSignal) as stop:  # its roles flushed and stopped
        return fail(
            f"run {run_id} stopped: {interruption(stop)}; "
            f"continue with: sluice train --resume {run_id}",
            exit_code(stop),
        )
    print_where_to_look(config, result)
    return 0


def print_where_to_look(config: RunConfig, result: dict[str, Any]) -> None:
    uri = config.tracking.uri
    print("\nDone.", file=sys.stdout)
    for key in ("held_out_reward_start", "held_out_reward_final"):
        if key in result:
            print(f"  {key.replace('_', ' ')}: {result[key]:.3f}")
    print(f"  checkpoint:  {result.get('checkpoint_uri', '-')}")
    if "core_split" in result:
        from sluice.tasks.run.report import core_split_lines

        for line in core_split_lines(result["core_split"]):
            print(f"  {line[2:]}")
    print(
        f"  MLflow UI:   mlflow ui --backend-store-uri {uri}   (then open {result.get('mlflow_run_url', '')})"
    )
    if "reward_curve_artifact" in result:
        print(f"  curves:      {result['reward_curve_artifact']} in the MLflow run's artifacts")
    print("  Prefect UI:  prefect server start   (flow runs at http://127.0.0.1:4200/runs)")


# ---------------------------------------------------------------- sluice eval


def run_eval(config: RunConfig, run_id: str, version: int | None = None) -> int:
    """Exit 2 with one line when the version does not exist, else evaluate it."""
    from sluice.flows.evaluate import VersionNotFound, evaluate, find_version
    from sluice.infra.registry import RegistryError
    from sluice.infra.tracking import TrackingError

    try:
        find_version(config, run_id, version)
    except VersionNotFound as err:
        return fail(err)
    except (TrackingError, RegistryError) as err:
        return fail(err, code=1)
    result = evaluate(config, run_id=run_id, version=version)
    print(format_eval_result(result))
    return 0


def format_eval_result(result: dict[str, Any]) -> str:
    """A short two-column table for the terminal."""
    rows = [
        ("run", result["run_id"]),
        ("policy version", str(result["policy_version"])),
        ("model version", f"{result['model_version']} of {result['registered_model']}"),
        ("held-out reward", f"{result['eval/reward']:.4f}"),
        ("pass@1", f"{result['eval/pass_at_1']:.4f}"),
        *(
            (f"pass@{key.removeprefix('eval/pass_at_')}", f"{value:.4f}")
            for key, value in result.items()
            if key.startswith("eval/pass_at_") and key != "eval/pass_at_1"
        ),
        (
            "prompts x samples",
            f"{int(result['eval/prompts'])} x {result['samples_per_prompt']}",
        ),
        ("response length", f"{result['eval/response_length_mean']:.1f} tokens (mean)"),
        ("time", f"{result['eval/time_s']:.1f} s"),
        ("MLflow run", result["mlflow_run_id"]),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


# ---------------------------------------------------------------- sluice serve


def run_serve(config: RunConfig) -> int:
    """Serve the deployments from this process until interrupted."""
    from prefect import serve
    from prefect.settings import get_current_settings

    from sluice.flows.deployments import build_deployments, next_steps

    deployments = build_deployments(config)
    settings = get_current_settings()
    print(next_steps(deployments, settings.api.url, settings.ui_url), flush=True)
    serve(*deployments, print_starting_message=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
