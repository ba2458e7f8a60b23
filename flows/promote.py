"""`sluice promote`: add a run's committed policy version to a long-lived registered model.

    sluice promote [RUN] [--version N] --to NAME[@ALIAS] [KEY=VALUE ...]

Each run keeps its own registered model, ``{tracking.registered_model}-{run}``, whose
alias gates the run's weight reloads. A *model line* NAME is the registered model people
keep and load (infra/model_line.py): ``promote`` registers the run's checkpoint as a new
version of NAME (created if missing), tagged with the run, policy version and checkpoint
digest, and points MLflow alias ALIAS at it. Then anyone with the tracking URI loads it::

    mlflow.set_tracking_uri("sqlite:///.sluice/mlflow.db")
    path = mlflow.artifacts.download_artifacts("models:/NAME@ALIAS")
    AutoModelForCausalLM.from_pretrained(path)

``tracking.promote_final_to`` does the same for the run's final version when the run
ends (``promote_final``, called by the train flows). RUN defaults to the newest run under
the workdir and its saved config is used (as ``sluice eval``); N defaults to the newest
committed version. Nothing heavy is imported until the arguments are known to be good.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import RunConfig, load_config
from sluice.infra.config.tracking import parse_target

if TYPE_CHECKING:
    from sluice.infra.model_line import PromotedVersion


def _target_arg(text: str) -> str:
    try:
        return str(parse_target(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_promote_parser(sub: Any) -> None:
    from sluice.flows.cli_common import add_overrides_arg

    promote_cmd = sub.add_parser(
        "promote",
        help="add a run's policy version to a long-lived registered model (NAME[@ALIAS])",
        description="Register the checkpoint of a committed policy version of RUN as a new "
        "version of the registered model NAME (created if missing), tagged with the run, "
        "the policy version and the checkpoint digest, and point alias ALIAS at it. Load "
        'it with mlflow.artifacts.download_artifacts("models:/NAME@ALIAS").',
    )
    promote_cmd.add_argument(
        "run",
        nargs="?",
        default=None,
        metavar="RUN",
        help="run to promote from (default: the newest under {workdir}/runs); its saved "
        "config is used, with --set applied on top",
    )
    add_overrides_arg(promote_cmd, example="workdir=DIR (where the runs are)")
    promote_cmd.add_argument(
        "--version", type=int, default=None, help="policy version (default: the newest)"
    )
    promote_cmd.add_argument(
        "--to",
        required=True,
        type=_target_arg,
        metavar="NAME[@ALIAS]",
        help="registered model to add the version to, and an alias to point at it "
        "(e.g. sluice-math@champion; MLflow reserves 'latest' and 'v<N>')",
    )


def promote(
    config: RunConfig, run_id: str, policy_version: int | None, target: str
) -> PromotedVersion:
    """Promote committed `policy_version` of run `run_id` (None: the newest) to `target`,
    ``NAME`` or ``NAME@ALIAS``. Raises ValueError for a bad target, RegistryError
    (PromotionError) with one line for a run, version or checkpoint that cannot be."""
    parsed = parse_target(target)
    from sluice.infra.model_line import PromotionError, promote_version
    from sluice.infra.tracking import get_client
    from sluice.tasks.run.paths import registered_model_name, run_registry

    name = registered_model_name(config, run_id)
    if not get_client(config.tracking.uri).search_registered_models(f"name = '{name}'"):
        # Checked first: the registry would register a model for a mistyped run id.
        raise PromotionError(
            f"run {run_id!r} has no registered model {name!r} in {config.tracking.uri}"
        )
    registry = run_registry(config, run_id)
    version = registry.newest_durable() if policy_version is None else registry.get(policy_version)
    if version is None:
        which = (
            "no committed version"
            if policy_version is None
            else f"no policy version {policy_version}"
        )
        raise PromotionError(f"run {run_id!r} has {which} in {config.tracking.uri}")
    return promote_version(registry, version, parsed, run_id)


def promote_final(config: RunConfig, run_id: str) -> PromotedVersion | None:
    """Promote the run's final version to `tracking.promote_final_to`, if set.

    Called when a train flow ends. A failure is reported, not raised: the run itself
    is complete, and the line printed says how to promote by hand.
    """
    target = config.tracking.promote_final_to
    if target is None:
        return None
    from sluice.infra.registry import RegistryError
    from sluice.infra.tracking import TrackingError

    try:
        promoted = promote(config, run_id, None, target)
    except (RegistryError, TrackingError, ValueError) as err:
        print(
            f"sluice: warning: tracking.promote_final_to={target} not done: {err}; "
            f"retry with: sluice promote {run_id} --to {target}",
            file=sys.stderr,
        )
        return None
    print(describe(promoted))
    return promoted


def describe(promoted: PromotedVersion) -> str:
    """One line: what went where, and the URI that loads it."""
    source = promoted.source
    how = "added as" if promoted.created else "already"
    alias = f", alias {promoted.target.alias}" if promoted.target.alias else ""
    return (
        f"run {promoted.source_run} policy version {source.policy_version} {how} version "
        f"{promoted.model_version} of {promoted.target.model}{alias}: load "
        f'mlflow.artifacts.download_artifacts("{promoted.uri}")'
    )


def run_promote(args: argparse.Namespace) -> int:
    """`sluice promote`: 0 when promoted; 2 with one error line otherwise."""
    from sluice.flows.cli_common import fail
    from sluice.flows.run_dirs import resolve_run
    from sluice.infra.registry import RegistryError
    from sluice.infra.tracking import TrackingError

    try:
        where = load_config(None, args.overrides)
        run_id, config = resolve_run(where, args.run, args.overrides, "promote from")
        promoted = promote(config, run_id, args.version, args.to)
    except (ConfigError, RegistryError, TrackingError, ValueError) as err:
        return fail(err)
    print(describe(promoted))
    print(f"  source: {promoted.source.checkpoint_uri}")
    print(f"  tracking URI: {config.tracking.uri} (mlflow.set_tracking_uri, before loading)")
    return 0
