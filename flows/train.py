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

import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from sluice.flows.cluster import check_placement_fits, role_runner
from sluice.flows.promote import promote_final
from sluice.flows.role_watch import (
    ROLE_TASK_NAMES,
    role_launcher,
    role_results,
    run_roles,
    watch_progress,
)
from sluice.flows.run_claim import (
    claim_new_run,
    flow_run_name,
    new_run_id,
    write_resolved_config,
)
from sluice.flows.run_secrets import take_secrets
from sluice.infra.config.run import RunConfig, load_config
from sluice.infra.config.staleness import describe_mode
from sluice.infra.extras import check_extras
from sluice.infra.tracking import log_config, start_or_resume_run
from sluice.tasks.process.servers import planned_servers, serve_inference
from sluice.tasks.run.control import RunControl, write_start
from sluice.tasks.run.credential import mint_run_token, run_token
from sluice.tasks.run.paths import ROLES, run_paths, run_registry
from sluice.tasks.run.prepare import prepare_policy
from sluice.tasks.run.report import publish_summary
from sluice.tasks.run.status import flow_reporter
from sluice.tasks.run.versions import serving_start


class ResumeError(RuntimeError):
    """A run asked to resume that cannot be (unknown, or nothing left to train)."""


def prepare_resume(config: RunConfig, run_id: str) -> str | None:
    """Check that `run_id` can resume and clear its stop marker; returns its MLflow run id.

    The MLflow run is found through the registry (every committed version carries the
    run that produced it), so metrics of a resumed run continue on the same curve even
    when the earlier flow finished and closed it.
    """
    registry = run_registry(config, run_id)
    latest = registry.newest_durable()
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


@flow(name="sluice-train", flow_run_name=flow_run_name, log_prints=True)
def train(
    config: RunConfig | None = None, run_id: str | None = None, resume: bool = False
) -> dict[str, Any]:
    """Asynchronous RL: rollout, reward, train and evaluate roles run concurrently.

    `config` defaults to flows/configs/default.yaml. With `resume`, `run_id` names an
    earlier run that continues from its newest committed version: ledgers say what was
    consumed, the rollout side re-bases its staleness gate and re-issues groups that
    were in flight.
    """
    started = time.monotonic()
    config = config or load_config("default")
    check_extras(config)  # a deployment run's config comes without the CLI's checks
    with role_launcher(config):  # the roles' imports, once, while this flow sets the run up
        logger = get_run_logger()
        if resume and not run_id:
            raise ResumeError("resume needs the run id of an earlier run")
        run_id = run_id or new_run_id(config)
        config = take_secrets(config, run_id)  # the parameter came redacted (flows/run_secrets.py)
        paths = run_paths(config, run_id)
        if resume:
            previous_mlflow_run = prepare_resume(config, run_id)
        else:
            claim_new_run(config, run_id)
            previous_mlflow_run = None
        mlflow_run_id = start_or_resume_run(
            config.tracking.uri,
            config.tracking.experiment,
            run_name=run_id,
            run_id=previous_mlflow_run,
            artifact_location=config.tracking.artifact_location,
        )
        log_config(config.tracking.uri, mlflow_run_id, config.model_dump(mode="json"))
        config_path = write_resolved_config(config, run_id)
        mint_run_token(config, run_id)  # the one credential every control route asks for
        if config.mode is not None:
            logger.info("%s", describe_mode(config))
        logger.info(
            "%s run %s: storage %s, MLflow run %s",
            "resuming" if resume else "starting",
            run_id,
            paths.prefix,
            mlflow_run_id,
        )

        prepare_policy(config.model_dump(mode="json"), run_id, mlflow_run_id)
        flow_reporter(config, paths).update(state="starting", activity="starting the roles")
        start = serving_start(config, run_registry(config, run_id))
        if start is not None:  # lets the rollout role start its server before its own imports
            write_start(config, run_id, start.policy_version, start.checkpoint_uri)

        log_dir = str(Path(config.workdir) / "runs" / run_id / "logs")
        roles = [r for r in ROLES if r != "evaluate" or config.evaluation.during_run]
        with (
            planned_servers(config, run_id) as ports,  # servers.launch=docker: containers
            role_runner(config, ROLE_TASK_NAMES, run_id, mlflow_run_id) as placed,
        ):
            ray_servers = placed if config.servers.launch == "ray" else None
            if ray_servers is not None:
                check_placement_fits(config, "servers", ray_servers.offered)
            futures = run_roles(
                roles,
                ROLE_TASK_NAMES,
                config.role_retries,
                str(config_path),
                run_id,
                mlflow_run_id,
                log_dir,
                placed,  # cluster.engine=ray: each role on a Ray node
            )
            if ports:
                futures["servers"] = serve_inference.submit(
                    config.model_dump(mode="json"), run_id, ports
                )
            elif ray_servers is not None:
                # Actors started from this process (a driver of the cluster), with the
                # config the nodes read.
                futures["servers"] = serve_inference.submit(
                    ray_servers.shipped, run_id, [], run_token(config, run_id)
                )
            watch_progress(config, run_id, futures, started=started, placed=placed)
            role_results(futures)  # raises if a role failed after its retries
    summary = publish_summary(config.model_dump(mode="json"), run_id, mlflow_run_id)
    promote_final(config, run_id)  # tracking.promote_final_to, when set
    return summary
