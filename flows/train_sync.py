"""The `train_sync` flow: the colocated synchronous baseline (generate → score → train).

One role process alternates generation and training on the same cores, the way
synchronous RL systems spend a step; the evaluate role runs beside it exactly as in
the async flow, so the two are compared on the same held-out numbers.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow

from sluice.flows.cluster import role_runner
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
from sluice.infra.extras import check_extras
from sluice.infra.tracking import log_config, start_or_resume_run
from sluice.tasks.run.credential import mint_run_token
from sluice.tasks.run.prepare import prepare_policy
from sluice.tasks.run.report import publish_summary


@flow(name="sluice-train-sync", flow_run_name=flow_run_name, log_prints=True)
def train_sync(config: RunConfig | None = None, run_id: str | None = None) -> dict[str, Any]:
    """Synchronous colocated RL on the same config, for side-by-side comparison."""
    started = time.monotonic()
    config = config or load_config("default")
    check_extras(config)  # a deployment run's config comes without the CLI's checks
    with role_launcher(config):  # the roles' imports, once, while this flow sets the run up
        if config.servers.launch != "embedded":
            raise ValueError(
                "train_sync generates inside its training process; servers.launch="
                f"{config.servers.launch} applies to the asynchronous `train` flow only"
            )
        if config.trainer.dynamic_sampling:
            raise ValueError(
                "trainer.dynamic_sampling refills batches from the asynchronous rollout "
                "stream; the colocated train_sync baseline samples one batch per step"
            )
        run_id = run_id or new_run_id(config)
        config = take_secrets(config, run_id)  # the parameter came redacted (flows/run_secrets.py)
        claim_new_run(config, run_id)
        mlflow_run_id = start_or_resume_run(
            config.tracking.uri,
            config.tracking.experiment,
            run_name=run_id,
            artifact_location=config.tracking.artifact_location,
            tags={"sluice.mode": "sync"},
        )
        log_config(config.tracking.uri, mlflow_run_id, config.model_dump(mode="json"))
        config_path = write_resolved_config(config, run_id)
        mint_run_token(config, run_id)  # the one credential every control route asks for
        prepare_policy(config.model_dump(mode="json"), run_id, mlflow_run_id)
        log_dir = str(Path(config.workdir) / "runs" / run_id / "logs")
        roles = ["sync", "evaluate"] if config.evaluation.during_run else ["sync"]
        names = {**ROLE_TASK_NAMES, "sync": "train-synchronously"}
        with role_runner(config, names, run_id, mlflow_run_id) as placed:
            futures = run_roles(
                roles,
                names,
                config.role_retries,
                str(config_path),
                run_id,
                mlflow_run_id,
                log_dir,
                placed,  # cluster.engine=ray: on a Ray node
            )
            watch_progress(config, run_id, futures, started=started, placed=placed)
            role_results(futures)
    summary = publish_summary(config.model_dump(mode="json"), run_id, mlflow_run_id, sync=True)
    promote_final(config, run_id)  # tracking.promote_final_to, when set
    return summary
