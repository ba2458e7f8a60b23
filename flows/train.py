"""The `train` flow: asynchronous RL with long-lived roles in separate processes.

    prepare (policy v0 committed) ─► rollout ─rollouts/─► reward ─scored/─► train
                                        ▲                                     │
                                        └──── MLflow alias: newest version ◄──┘
                                   evaluate polls the registry beside them

The flow itself never touches a token: it resolves the run, starts one Prefect task
per role (each supervising its own OS process), draws progress from the roles'
status documents, and writes the summary artifacts when training ends.
η = 0 with `rollout.interruptible=false` is the synchronous baseline with separate
resources; `train_sync` (flows/train_sync.py) is the colocated one.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from infra.config import RunConfig, load_config
from infra.tracking import log_config, start_or_resume_run
from tasks.common import ROLES, RunControl, read_statuses, run_paths, run_registry
from tasks.prepare import prepare_policy
from tasks.report import publish_summary
from tasks.supervise import run_role

ROLE_TASK_NAMES = {
    "rollout": "generate-rollouts",
    "reward": "score-rollouts",
    "train": "train-policy",
    "evaluate": "evaluate-policy",
}


def new_run_id(config: RunConfig) -> str:
    return f"{config.name}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"


def write_resolved_config(config: RunConfig, run_id: str) -> Path:
    path = Path(config.workdir) / "runs" / run_id / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config.model_dump(mode="json"), indent=2))
    return path


def progress_line(statuses: dict[str, dict[str, Any]], total_steps: int) -> str:
    train = statuses.get("train", {})
    rollout = statuses.get("rollout", {})
    evaluation = statuses.get("evaluate", {})

    def fmt(value: Any, spec: str = ".3f") -> str:
        return "-" if value is None else format(value, spec)

    return (
        f"step {train.get('step', 0)}/{total_steps}"
        f" | version {rollout.get('policy_version', '-')}"
        f" | reward {fmt(train.get('reward_mean'))}"
        f" | held-out {fmt(evaluation.get('last_reward'))}"
        f" | staleness {fmt(train.get('staleness_mean'), '.2f')}"
        f" | gen {fmt(rollout.get('tokens_per_s'), '.0f')} tok/s"
        f" | train {fmt(train.get('trained_tokens_per_s'), '.0f')} tok/s"
    )


def watch_progress(
    config: RunConfig, run_id: str, futures: dict[str, Any], interval_s: float = 5.0
) -> None:
    """Console line and Prefect progress artifact until every role has finished."""
    paths = run_paths(config, run_id)
    total = config.trainer.total_steps
    artifact_id = create_progress_artifact(0.0, key=None, description=f"Sluice run {run_id}")
    last_line = ""
    while not all(f.state.is_final() for f in futures.values()):
        time.sleep(interval_s)
        statuses = read_statuses(config, paths)
        step = statuses.get("train", {}).get("step", 0)
        update_progress_artifact(artifact_id, progress=100.0 * min(step, total) / total)
        line = progress_line(statuses, total)
        if line != last_line:
            print(line, flush=True)
            last_line = line
        failed = [r for r, f in futures.items() if f.state.is_failed()]
        if failed:  # one role failed for good: stop the others so the run ends
            RunControl(config, paths).mark_done(f"role failed: {', '.join(failed)}")


class ResumeError(RuntimeError):
    """A run asked to resume that cannot be (unknown, or nothing left to train)."""


def prepare_resume(config: RunConfig, run_id: str) -> str | None:
    """Check that `run_id` can resume and clear its stop marker; returns its MLflow run id.

    The MLflow run is found through the registry (every committed version carries the
    run that produced it), so metrics of a resumed run continue on the same curve even
    when the earlier flow finished and closed it.
    """
    registry = run_registry(config, run_id)
    latest = registry.latest()
    if latest is None:
        raise ResumeError(
            f"run '{run_id}' has no committed policy version in {config.tracking.uri}; "
            "start it without --resume"
        )
    if latest.policy_version >= config.trainer.total_steps:
        raise ResumeError(
            f"run '{run_id}' already reached policy version {latest.policy_version} of "
            f"{config.trainer.total_steps}; raise trainer.total_steps to train further"
        )
    # The stop marker of the earlier flow (finished, failed or killed) would stop the
    # roles at once; a resumed run starts without one.
    RunControl(config, run_paths(config, run_id)).clear_done()
    return latest.run_id


@flow(name="sluice-train", log_prints=True)
def train(
    config: RunConfig | None = None, run_id: str | None = None, resume: bool = False
) -> dict[str, Any]:
    """Asynchronous RL: rollout, reward, train and evaluate roles run concurrently.

    `config` defaults to flows/configs/default.yaml. With `resume`, `run_id` names an
    earlier run that continues from its newest committed version: ledgers say what was
    consumed, the rollout side re-bases its staleness gate and re-issues groups that
    were in flight.
    """
    config = config or load_config("default")
    logger = get_run_logger()
    if resume and not run_id:
        raise ResumeError("resume needs the run id of an earlier run")
    run_id = run_id or new_run_id(config)
    paths = run_paths(config, run_id)
    previous_mlflow_run = prepare_resume(config, run_id) if resume else None
    mlflow_run_id = start_or_resume_run(
        config.tracking.uri,
        config.tracking.experiment,
        run_name=run_id,
        run_id=previous_mlflow_run,
        artifact_location=config.tracking.artifact_location,
    )
    log_config(config.tracking.uri, mlflow_run_id, config.model_dump(mode="json"))
    config_path = write_resolved_config(config, run_id)
    logger.info(
        "%s run %s: storage %s, MLflow run %s",
        "resuming" if resume else "starting",
        run_id,
        paths.prefix,
        mlflow_run_id,
    )

    prepare_policy(config.model_dump(mode="json"), run_id, mlflow_run_id)

    log_dir = str(Path(config.workdir) / "runs" / run_id / "logs")
    futures = {
        role: run_role.with_options(name=ROLE_TASK_NAMES[role]).submit(
            role, str(config_path), run_id, mlflow_run_id, log_dir
        )
        for role in ROLES
    }
    watch_progress(config, run_id, futures)
    for future in futures.values():
        future.result()  # raises if a role failed after its retries
    return publish_summary(config.model_dump(mode="json"), run_id, mlflow_run_id)


def run_from_cli(config: RunConfig, resume: str | None = None, sync: bool = False) -> int:
    if sync:
        from flows.train_sync import train_sync

        result = train_sync(config)
    else:
        try:
            result = train(config, run_id=resume, resume=bool(resume))
        except ResumeError as err:
            print(f"sluice: error: {err}", file=sys.stderr)
            return 2
    print_where_to_look(config, result)
    return 0


def print_where_to_look(config: RunConfig, result: dict[str, Any]) -> None:
    uri = config.tracking.uri
    print("\nDone.", file=sys.stdout)
    for key in ("held_out_reward_start", "held_out_reward_final"):
        if key in result:
            print(f"  {key.replace('_', ' ')}: {result[key]:.3f}")
    print(f"  checkpoint:  {result.get('checkpoint_uri', '-')}")
    print(
        f"  MLflow UI:   mlflow ui --backend-store-uri {uri}   (then open {result.get('mlflow_run_url', '')})"
    )
    print("  Prefect UI:  prefect server start   (flow runs at http://127.0.0.1:4200/runs)")
