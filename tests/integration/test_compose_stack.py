"""infra/docker/compose.yaml brought up for real: the Prefect server, the MLflow server,
an S3 endpoint and a `sluice train` wired to all three, each in its own container.

What stands in for registry images here: `sluice:local` (infra/docker/Dockerfile.local
on the local Debian base) for the image compose.yaml builds from python:3.11-slim, and
`sluice-s3:local` (moto's S3 server answering on MinIO's port and healthcheck) for
MinIO. The compose file itself runs unchanged; the run is the compose file's own
`sluice` command with a tiny model and three steps appended.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.docker]
REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "infra" / "docker" / "compose.yaml"


@pytest.fixture(scope="module")
def stack(sluice_image):
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (bash infra/docker/engine.sh installs it)")
    subprocess.run(["bash", "infra/docker/image.sh", "s3"], cwd=REPO, check=True, timeout=900)
    from sluice.infra.docker_servers import api_timeout_s

    project = f"sluice-test-{uuid.uuid4().hex[:6]}"
    # Compose's client gives up on an API call after 60 s by default: less than creating
    # a container of sluice:local takes under the vfs storage driver (a copy of the image).
    client_timeout_s = str(api_timeout_s())
    env = dict(
        os.environ,
        COMPOSE_PROJECT_NAME=project,
        SLUICE_IMAGE=sluice_image,
        MINIO_IMAGE="sluice-s3:local",
        COMPOSE_HTTP_TIMEOUT=client_timeout_s,
    )

    def compose(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["docker-compose", "-f", str(COMPOSE_FILE), *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    try:
        up = compose("up", "-d", "--no-build", "prefect-server", "mlflow", "create-bucket")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        # The run below goes in with --no-deps, so nothing else waits for the servers'
        # health checks (compose.yaml's `sluice` service does, through depends_on):
        # a run started before MLflow answered failed with "unreachable: timed out".
        wait_healthy(compose, ("prefect-server", "mlflow"), deadline_s=300)
        yield compose
    finally:  # also after `up` failed or timed out half-way
        compose("down", "-v", "--remove-orphans", timeout=900)


def wait_healthy(compose, services: tuple[str, ...], *, deadline_s: float) -> None:
    """Until each service's container reports its health check healthy; fails naming
    the services that are not, with their last health-check output, at the deadline."""
    deadline = time.monotonic() + deadline_s
    states: dict[str, str] = {}
    while True:
        for service in services:
            ids = compose("ps", "-q", service, timeout=120).stdout.split()
            if not ids:
                states[service] = "no container"
                continue
            inspect = subprocess.run(
                ["docker", "inspect", "-f", "{{json .State.Health}}", ids[0]],
                capture_output=True,
                text=True,
                timeout=120,
            )
            health = json.loads(inspect.stdout or "null") or {}
            states[service] = health.get("Status", "no health check")
            if states[service] != "healthy" and health.get("Log"):
                states[service] += f" ({health['Log'][-1].get('Output', '').strip()[-300:]})"
        if all(state == "healthy" for state in states.values()):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the stack is not healthy after {deadline_s:.0f} s: {states}")
        time.sleep(2)


def test_sluice_trains_through_the_stack_prefect_mlflow_and_s3(stack) -> None:
    import s3fs
    from mlflow import MlflowClient

    from sluice.infra.registry import CheckpointRegistry
    from tests.flows.conftest import tiny_run_overrides

    command = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["sluice"]["command"]
    tiny = tiny_run_overrides(None, name="composed")  # the stack places the run's files
    extra = [part for arg in tiny for part in ("--set", arg)]
    run = stack("run", "--rm", "--no-deps", "sluice", *command, *extra, timeout=900)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "step 3/3" in output

    # MLflow (the stack's server, through its published port) holds the run's versions.
    mlflow_uri = "http://127.0.0.1:5000"
    (model,) = MlflowClient(mlflow_uri).search_registered_models(
        "name LIKE 'sluice-policy-composed-%'"
    )
    registry = CheckpointRegistry(mlflow_uri, model.name)
    assert [v.policy_version for v in registry.versions()] == [0, 1, 2, 3]

    # The streams and checkpoints went to the S3 endpoint, not a local disk.
    run_id = model.name.removeprefix("sluice-policy-")
    fs = s3fs.S3FileSystem(
        key="sluice",
        secret="sluice-secret",
        client_kwargs={"endpoint_url": "http://127.0.0.1:9000", "region_name": "us-east-1"},
    )
    stored = fs.ls(f"sluice/runs/{run_id}")
    assert {f"sluice/runs/{run_id}/{d}" for d in ("checkpoints", "rollouts", "scored")} <= set(
        stored
    )
