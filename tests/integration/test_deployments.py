"""prefect.yaml deploys as the README says against a real local `prefect server start`."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


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
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/api/health", timeout=2
            ) as response:
                if response.status == 200:
                    break
        except OSError:
            time.sleep(1)
    else:
        server.kill()
        pytest.fail("prefect server did not become healthy in 120 s")
    yield env
    server.terminate()
    server.wait(30)


def test_deploy_all_creates_train_and_scheduled_reproduce(prefect_server):
    env = prefect_server
    made = prefect("work-pool", "create", "sluice-process", "--type", "process", env=env)
    assert made.returncode == 0, made.stderr
    deployed = prefect("--no-prompt", "deploy", "--all", env=env, timeout=300)
    assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]

    def get(path):
        request = urllib.request.Request(
            env["PREFECT_API_URL"] + path, data=b"{}", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    deployments = {d["name"]: d for d in get("/deployments/filter")}
    assert {"train", "train-sync", "reproduce-nightly"} <= set(deployments)
    assert deployments["train"]["work_pool_name"] == "sluice-process"
    schedules = deployments["reproduce-nightly"]["schedules"]
    assert [s["schedule"]["cron"] for s in schedules] == ["0 3 * * *"]
    # The pull step points at this checkout, so a process worker runs this code.
    assert str(REPO) in json.dumps(deployments["train"]["pull_steps"])
