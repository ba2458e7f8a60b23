"""prefect.yaml deploys as docs/deployments.md says against a real local `prefect server start`;
its Docker deployment runs a short job to completion in a container of Sluice's image."""

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import stop_process_group

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
SERVER_START_S = 180
"""A cold `prefect server start` (its database created, a 2-core box busy) in ~30-60 s."""
FLOW_RUN_S = 1200
"""The Docker flow run, from its creation to its end on a cold vfs engine: the worker
polls, creates the container (a copy of sluice:local: ~1.5 min on a loaded 2-core box),
and the tiny run imports, starts and trains in it."""


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prefect(*args, env, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = dict(
        os.environ,
        PREFECT_HOME=str(home),
        PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="true",
    )
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/api/health", timeout=2
                ) as response:
                    if response.status == 200:
                        break
            except OSError:
                assert server.poll() is None, f"prefect server exited with {server.returncode}"
                time.sleep(1)
        else:
            pytest.fail(f"prefect server did not become healthy in {SERVER_START_S} s")
        yield env
    finally:
        stop_process_group(server)


def api(env, path, body=None):
    """GET `path` of the server's API, or POST `body` (JSON) to it."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        env["PREFECT_API_URL"] + path, data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def create_pools(env):
    """The two work pools prefect.yaml names (each made once per server)."""
    existing = {p["name"] for p in api(env, "/work_pools/filter", {})}
    for name, kind in (("sluice-process", "process"), ("sluice-docker", "docker")):
        if name not in existing:
            made = prefect("work-pool", "create", name, "--type", kind, env=env)
            assert made.returncode == 0, made.stdout + made.stderr


def remove_flow_run_containers(flow_run_id: str) -> None:
    """Remove the containers Prefect's Docker worker started for a flow run (it labels
    them with the run's id)."""
    import docker

    from sluice.infra.docker_servers import docker_client

    client = docker_client()
    label = f"io.prefect.flow-run-id={flow_run_id}"
    for container in client.containers.list(all=True, sparse=True, filters={"label": label}):
        with contextlib.suppress(docker.errors.APIError):  # auto_remove got there first
            container.remove(force=True)


def test_deploy_all_creates_train_and_scheduled_reproduce(prefect_server):
    env = prefect_server
    create_pools(env)
    deployed = prefect("--no-prompt", "deploy", "--all", env=env, timeout=300)
    assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]

    deployments = {d["name"]: d for d in api(env, "/deployments/filter", {})}
    assert {"train", "train-docker", "train-sync", "reproduce-nightly"} <= set(deployments)
    assert deployments["train"]["work_pool_name"] == "sluice-process"
    assert deployments["train-docker"]["work_pool_name"] == "sluice-docker"
    schedules = deployments["reproduce-nightly"]["schedules"]
    assert [s["schedule"]["cron"] for s in schedules] == ["0 3 * * *"]
    # The pull step points at this checkout, so a process worker runs this code.
    assert str(REPO) in json.dumps(deployments["train"]["pull_steps"])


@pytest.mark.docker
def test_a_docker_worker_runs_train_docker_to_completion_in_sluice_image(
    prefect_server, sluice_image, tmp_path
):
    from sluice.infra.config.run import load_config
    from sluice.infra.docker_servers import api_timeout_s
    from sluice.infra.registry import CheckpointRegistry
    from sluice.tasks.run.paths import registered_model_name
    from tests.flows.conftest import tiny_run_overrides

    env = prefect_server
    create_pools(env)
    deployed = prefect("--no-prompt", "deploy", "--name", "train-docker", env=env, timeout=300)
    assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]
    deployment = api(env, "/deployments/name/sluice-train/train-docker")
    assert deployment["job_variables"]["image"] == sluice_image

    # A tiny run whose files all live under tmp_path, mounted at the same path, so this
    # test reads what the container wrote.
    config = load_config("default", tiny_run_overrides(tmp_path))
    run = api(
        env,
        f"/deployments/{deployment['id']}/create_flow_run",
        {
            "parameters": {"config": config.model_dump(mode="json"), "run_id": "indocker"},
            "job_variables": {"volumes": [f"{tmp_path}:{tmp_path}"]},
        },
    )
    log_path = tmp_path / "worker.log"
    # The worker's Docker client waits as long as Sluice's own (its default is 60 s, less
    # than creating a container of the image takes on a cold vfs engine).
    worker_env = dict(env, DOCKER_CLIENT_TIMEOUT=str(api_timeout_s()))
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", "sluice-docker"],
            cwd=tmp_path,
            env=worker_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + FLOW_RUN_S
        state = api(env, f"/flow_runs/{run['id']}")["state"]
        while state["type"] not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            assert time.monotonic() < deadline, (
                f"flow run still {state['type']} after {FLOW_RUN_S} s\n"
                + log_path.read_text()[-3000:]
            )
            assert worker.poll() is None, log_path.read_text()[-3000:]
            time.sleep(2)
            state = api(env, f"/flow_runs/{run['id']}")["state"]
    finally:
        stop_process_group(worker)
        # A worker stopped mid-run leaves its job's container running.
        remove_flow_run_containers(run["id"])
    output = log_path.read_text()
    assert state["type"] == "COMPLETED", f"{state['message']}\n{output[-3000:]}"

    # The job ran in a container: the worker recorded it as `<engine url>:<container id>`,
    # and the run's versions are in the MLflow store the container wrote.
    flow_run = api(env, f"/flow_runs/{run['id']}")
    assert re.fullmatch(r".+:[0-9a-f]{64}", flow_run["infrastructure_pid"] or ""), flow_run
    registry = CheckpointRegistry(config.tracking.uri, registered_model_name(config, "indocker"))
    assert [v.policy_version for v in registry.versions()] == [0, 1, 2, 3]
