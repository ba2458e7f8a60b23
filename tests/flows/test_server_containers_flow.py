"""`sluice train` with `servers.launch=docker`: the rollouts go through Sluice's server
in a container on host networking; a server killed mid-run is restarted and the run
finishes; nothing of the run is left running afterwards."""

from __future__ import annotations

import threading
import time

import pytest

from sluice.infra.config.run import load_config
from sluice.infra.registry import CheckpointRegistry
from sluice.tasks.run.paths import registered_model_name, run_paths
from sluice.tasks.run.status import read_statuses
from tests.flows.conftest import tiny_run_overrides

pytestmark = [pytest.mark.flows, pytest.mark.docker]


def kill_server_when_generating(config, run_id: str, killed: list[str], stop: threading.Event):
    """Kill the run's server container once it has loaded a policy version past the first
    (so the restarted one, which starts from the first, must be brought forward)."""
    from sluice.infra.docker_servers import LABEL, docker_client

    client = docker_client()  # sized for a cold vfs engine, as the run's own client
    paths = run_paths(config, run_id)
    while not stop.is_set():
        if read_statuses(config, paths).get("rollout", {}).get("weight_updates", 0) >= 1:
            for container in client.containers.list(filters={"label": f"{LABEL}={run_id}"}):
                container.kill()
                killed.append(container.name)
            return
        time.sleep(0.2)


@pytest.fixture
def run_id():
    """The run's id; whatever containers of it a failed test left are removed after it
    (the run itself must leave none: the test asserts that before this runs)."""
    from sluice.infra.docker_servers import remove_run_servers

    yield "served"
    remove_run_servers("served")


def test_rollouts_go_through_a_server_container_that_is_restarted_after_a_kill(
    prefect_api, sluice_image, tmp_path, run_id
):
    from sluice.flows.train import train
    from sluice.infra.docker_servers import LABEL, docker_client

    config = load_config(
        "default",
        tiny_run_overrides(tmp_path, **{"servers.launch": "docker", "trainer.total_steps": 12}),
    )
    killed: list[str] = []
    stop = threading.Event()
    killer = threading.Thread(
        target=kill_server_when_generating, args=(config, run_id, killed, stop), daemon=True
    )
    killer.start()
    try:
        state = train(config, run_id=run_id, return_state=True)
    finally:
        stop.set()
        killer.join(timeout=10)
    assert state.is_completed(), state.message

    # The run trained to its last version with the server killed once on the way.
    registry = CheckpointRegistry(config.tracking.uri, registered_model_name(config, run_id))
    assert registry.newest_servable().policy_version == config.trainer.total_steps
    assert killed == [f"sluice-{run_id}-server-0"]
    rollout = read_statuses(config, run_paths(config, run_id))["rollout"]
    assert rollout["server_recoveries"] >= 1
    assert rollout["weight_updates"] >= 1

    # Generation ran in the containers, not in a server of the rollout role's own: the
    # first container's log ends at the kill, the second's at the end of the run.
    logs = tmp_path / "work" / "runs" / run_id / "logs"
    assert not (logs / "inference-server.log").exists()
    before_kill = (logs / "inference-server-0.restart1.log").read_text()
    after_restart = (logs / "inference-server-0.log").read_text()
    assert "POST /generate" in before_kill
    # The restarted server came up on the run's first weights and was brought to the
    # served version before it generated again.
    first_update = after_restart.index("POST /update_weights_from_disk")
    assert "POST /generate" not in after_restart[:first_update]
    assert "POST /generate" in after_restart[first_update:]

    left = docker_client().containers.list(all=True, filters={"label": f"{LABEL}={run_id}"})
    assert left == []
