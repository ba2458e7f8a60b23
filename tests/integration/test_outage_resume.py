"""A persistent outage of the object store, then of the tracking server, during a real
`sluice train` on S3 (moto's server) and an MLflow server: each run stops with one line
naming the service and `--resume`, and the resumed run finishes with clean books."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.benchmarks.bench_load import S3_ENV, S3Server
from tests.integration.sluice_cli import Cli, run_id_of, wait_for_step
from tests.soak.soak import MlflowServer, soak_overrides

pytestmark = pytest.mark.integration

STEPS = 9
OUTAGE_TIMEOUT_S = 6


@pytest.mark.usefixtures("shared_prefect_api")  # three runs, one API
def test_a_persistent_outage_stops_the_run_in_one_line_and_resume_finishes_it(tmp_path) -> None:
    from sluice.infra.config.run import load_config
    from sluice.tasks.run.audit import audit_run

    os.environ.update(S3_ENV)
    s3 = S3Server()
    mlflow = None
    runs: list[Cli] = []
    try:
        mlflow = MlflowServer(tmp_path)
        overrides = soak_overrides(tmp_path, s3, mlflow, STEPS)
        storage = {
            "client_kwargs": s3.options()["client_kwargs"],
            # Give up on a hung endpoint in half a minute, not many: the test waits for
            # it. s3fs tries a call 5 times, so one attempt of 5 s each in botocore. Not
            # much less: on a loaded CI box moto itself can take seconds to answer.
            "config_kwargs": {
                "connect_timeout": 5,
                "read_timeout": 5,
                "retries": {"total_max_attempts": 1},
            },
        }
        overrides = [
            o for o in overrides if not o.startswith(("storage.options=", "role_retries="))
        ]
        overrides += [
            f"storage.options={json.dumps(storage)}",
            f"outage_timeout_s={OUTAGE_TIMEOUT_S}",
            "role_retries=0",  # an outage waited out must cost no retry
        ]
        config = load_config("default", overrides)
        env = {
            **os.environ,
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
            "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        }
        args = [part for o in overrides for part in ("--set", o)]

        first = Cli(args, tmp_path, env)
        runs.append(first)
        run_id = run_id_of(first)
        wait_for_step(first, config, run_id, 3)
        os.kill(s3.process.pid, signal.SIGSTOP)  # hung, and stays hung until the run stops
        try:
            code = first.wait(300)
        finally:
            os.kill(s3.process.pid, signal.SIGCONT)
        print(first.output()[-3000:])
        assert code == 75, first.output()[-4000:]
        line = first.error_line()
        assert line.startswith(f"sluice: error: run {run_id} stopped: the object store s3://"), line
        assert line.endswith(f"continue with: sluice train --resume {run_id}"), line
        stopped_at = audit_run(config, run_id)
        assert stopped_at.incomplete_versions == [] and stopped_at.duplicated == 0
        assert stopped_at.versions == list(range(len(stopped_at.versions)))

        second = Cli([*args, "--resume", run_id], tmp_path, env)
        runs.append(second)
        wait_for_step(second, config, run_id, stopped_at.versions[-1] + 2)
        mlflow.stop()  # refused, and stays down until the run stops
        try:
            code = second.wait(300)
        finally:
            mlflow.start()
        print(second.output()[-3000:])
        assert code == 75, second.output()[-4000:]
        line = second.error_line()
        assert line.startswith(f"sluice: error: run {run_id} stopped: the tracking server "), line

        third = Cli([*args, "--resume", run_id], tmp_path, env)
        runs.append(third)
        assert third.wait(300) == 0, third.output()[-4000:]
        audit = audit_run(config, run_id)
        assert audit.problems() == [], audit.problems()
    finally:
        for cli in runs:  # a failed assertion leaves no run behind
            cli.stop()
        if mlflow is not None:
            mlflow.stop()
        s3.close()
