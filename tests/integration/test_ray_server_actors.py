"""Inference servers as Ray actors (`servers.launch: ray`) on a one-node Ray instance:
the flow's side starts them and publishes where they answer, the rollout's side finds
each version's weights on every server's node, and a server whose process dies is
started again at a new URL. (Node loss on a cluster of several nodes:
tests/integration/test_cluster.py.)"""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sluice.infra.checkpoints import save_checkpoint
from sluice.infra.config.run import RunConfig
from sluice.infra.docker_servers import healthy
from sluice.infra.registry import CommittedVersion

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    import ray

    ray.init("local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="sluice")
    try:
        yield
    finally:
        ray.shutdown()


def committed(config: RunConfig, model_dir: Path, policy_version: int) -> CommittedVersion:
    url = f"{config.storage.url}/run/checkpoints/v{policy_version:06d}"
    return CommittedVersion(
        policy_version=policy_version,
        checkpoint_uri=save_checkpoint(model_dir, url),
        model_version=policy_version + 1,
        trainer_step=policy_version,
        run_id=None,
        checkpoint_digest=None,
        created_at_ms=0,
        tags={},
    )


TOKEN = "the-run-token-" + os.urandom(8).hex()


def model_info(url: str) -> dict:
    import json

    request = urllib.request.Request(
        f"{url}/get_model_info", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def refused_without_token(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/get_model_info", timeout=10)
    except urllib.error.HTTPError as error:
        return error.code == 401
    return False


def test_server_actors_start_publish_prefetch_and_come_back_after_a_death(
    ray_instance: None,
    tmp_path: Path,
    local_run_config: Callable[..., RunConfig],
    random_model_dir: Callable[..., Path],
) -> None:
    from sluice.tasks.process.ray_servers import RayServers, ServerActors
    from sluice.tasks.run.control import launched_server_urls

    config = local_run_config(
        tmp_path,
        "cluster.engine=ray",
        "servers.launch=ray",
        "servers.count=2",
        "cluster.servers.num_cpus=0.5",
        "rollout.max_batch_size=4",
        "servers.start_timeout_s=120",
        "cluster.placement_timeout_s=60",
    )
    v0 = committed(config, random_model_dir(seed=0), 0)
    v1 = committed(config, random_model_dir(seed=1), 1)
    servers = RayServers(config, "run", TOKEN)
    try:
        servers.start(v0)
        urls = launched_server_urls(config, "run")
        assert urls == servers.urls and len(set(urls)) == 2
        assert all(healthy(url) for url in urls)
        assert {model_info(url)["weight_version"] for url in urls} == {"0"}
        # Each actor wrote the token it was handed to a 0600 file of its node; the
        # servers ask for it, and listen on the node's address, not on every interface.
        assert all(refused_without_token(url) for url in urls)
        assert not any(url.startswith("http://0.0.0.0") for url in urls)
        token_file = Path(config.workdir) / "runs" / "run" / "run.token"
        assert token_file.read_text() == TOKEN and token_file.stat().st_mode & 0o777 == 0o600
        assert servers.dead() == []

        # The rollout's side: each server's node holds v1 after a prefetch, at a path
        # of that node (here one machine, so each actor's own cache directory).
        actors = ServerActors(config, "run")
        assert actors.read() == urls
        paths = actors.prefetch(v1)
        assert set(paths) == set(urls)
        for path in paths.values():
            assert (Path(path) / "config.json").is_file()

        # A server process dies: found dead, started again (a new actor) elsewhere.
        server_pids = [
            pid
            for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
            if _is_server_on(pid, urls[0])
        ]
        assert len(server_pids) == 1
        os.kill(server_pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while servers.dead() != [0]:  # the signal lands a moment later
            assert time.monotonic() < deadline, "the killed server was never found dead"
            time.sleep(0.2)
        old_name = servers.names[0]
        assert servers.restart_dead(lambda: v1) == [0]
        assert servers.restarts == [1, 0]
        moved = launched_server_urls(config, "run")
        assert moved[1] == urls[1] and moved[0] != urls[0]
        assert servers.names[0] != old_name
        assert healthy(moved[0]) and model_info(moved[0])["weight_version"] == "1"
        assert actors.read() == moved  # the rollout's side follows it
    finally:
        servers.stop()
    assert not any(healthy(url) for url in servers.urls)


def _is_server_on(pid: int, url: str) -> bool:
    port = url.rsplit(":", 1)[1]
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"sluice.infra.serving.server" in argv and port.encode() in argv
