"""`sluice train`: start a run (flows/train.py, or flows/train_sync.py with --sync), say
where to watch it as it starts, and what it left when it ends.

The run id is chosen here, before the flow (and its Prefect API) starts, so the first
lines a user sees name the run and the commands that watch it from another terminal.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from sluice.flows.cli_common import exit_code, fail, interruption
from sluice.infra.config.run import RunConfig


def mlflow_ui_command(tracking_uri: str) -> str:
    """The command that shows a run's MLflow metrics and registry in a browser (the UI's
    web server alone: infra/config/tracking.py)."""
    from sluice.infra.config.tracking import ui_command

    return ui_command(tracking_uri)


def prefect_ui_line() -> str:
    """Where the run's flow and its role tasks show in Prefect's UI."""
    api_url = os.environ.get("PREFECT_API_URL")
    if api_url:  # a Prefect server the run reports to
        return f"{api_url.rstrip('/').removesuffix('/api')}/runs"
    return "prefect server start   (flow runs at http://127.0.0.1:4200/runs)"


def run_log_dir(config: RunConfig, run_id: str) -> Path:
    """Where the run's role processes write their logs (on this machine)."""
    return Path(config.workdir) / "runs" / run_id / "logs"


def print_start(config: RunConfig, run_id: str, resume: bool = False) -> None:
    """Where to look while the run goes: printed before the flow starts."""
    print(
        f"{'Resuming' if resume else 'Starting'} run {run_id}. While it runs:\n"
        f"  status:      sluice status {run_id}\n"
        f"  logs:        sluice logs {run_id} -f   (files in {run_log_dir(config, run_id)}/)\n"
        f"  MLflow UI:   {mlflow_ui_command(config.tracking.uri)}\n"
        f"  Prefect UI:  {prefect_ui_line()}",
        flush=True,
    )


def run_train(config: RunConfig, resume: str | None = None, sync: bool = False) -> int:
    from sluice.flows.run_claim import new_run_id
    from sluice.flows.run_secrets import hand_over
    from sluice.tasks.process.supervisor import RunStopped, quiet_run_stopped_tracebacks

    quiet_run_stopped_tracebacks()
    run_id = resume or new_run_id(config)
    print_start(config, run_id, resume=bool(resume))
    # The flow's parameters are stored by Prefect: credentials travel in a 0600 file.
    config = hand_over(config, run_id)
    if sync:
        from sluice.flows.train_sync import train_sync

        try:
            result = train_sync(config, run_id=run_id)
        except RunStopped as err:
            return fail(err, err.exit_code)
        print_where_to_look(config, result)
        return 0
    from prefect.exceptions import TerminationSignal

    from sluice.flows.train import ResumeError, train

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
        f"  MLflow UI:   {mlflow_ui_command(config.tracking.uri)}   "
        f"(then open {result.get('mlflow_run_url', '')})"
    )
    from sluice.tasks.run.report import failover_lines

    for line in failover_lines(result.get("trainer_failovers", [])):
        print(f"  {line[2:]}")
    if "reward_curve_artifact" in result:
        print(f"  curves:      {result['reward_curve_artifact']} in the MLflow run's artifacts")
    print(f"  Prefect UI:  {prefect_ui_line()}")
