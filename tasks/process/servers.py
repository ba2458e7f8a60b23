"""Inference servers the run launches: containers (`servers.launch: docker`) or Ray
actors (`servers.launch: ray`, tasks/process/ray_servers.py, `run_ray_servers` here).

The flow picks the servers' ports and writes their URLs for the rollout role
(`plan_servers`), then runs `serve_inference` beside the roles: a long-lived Prefect
task that starts the containers on the run's starting version, waits until they
answer, restarts one that dies, and removes them all when the run stops. The
containers themselves are `sluice.infra.docker_servers`. Every server asks for the
run's token: a container reads the flow's 0600 file through the workdir's mount, a Ray
actor is handed the token and writes its own node's file.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from sluice.infra.config.run import RunConfig
from sluice.infra.docker_servers import ServerContainers, ServerSpec, remove_run_servers
from sluice.tasks.process.inference_server import server_spec
from sluice.tasks.process.ports import free_port
from sluice.tasks.process.ray_servers import RayServers
from sluice.tasks.run.control import RunControl
from sluice.tasks.run.credential import (
    run_token,
    token_path,
    write_run_token,
    write_signed_servers,
)
from sluice.tasks.run.paths import run_paths, run_registry
from sluice.tasks.run.versions import fetch_policy, serving_start

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0


def server_mounts(config: RunConfig) -> tuple[str, ...]:
    """Host directories every server must see at the same path: the workdir (start
    weights, the rollout role's weight cache) and a local storage root (the rollout role
    sends local checkpoints by their storage path)."""
    paths = [Path(config.workdir).resolve()]
    url = config.storage.url
    if url.startswith("file://") or "://" not in url:
        paths.append(Path(url.removeprefix("file://")).resolve())
    for path in paths:
        path.mkdir(parents=True, exist_ok=True)
    # A directory inside another is already visible through it.
    kept = [p for p in paths if not any(o != p and o in p.parents for o in paths)]
    return tuple(sorted({str(p) for p in kept}))


def server_specs(
    config: RunConfig,
    ports: list[int],
    model_dir: Path,
    weight_version: int,
    api_key_file: Path | None = None,
) -> list[ServerSpec]:
    """`api_key_file`: the run's token file, under the workdir every container mounts."""
    per = config.servers.gpus_per_server
    mounts = server_mounts(config)
    return [
        server_spec(
            config,
            port,
            model_dir,
            weight_version,
            tuple(range(i * per, (i + 1) * per)),
            mounts,
            api_key_file=api_key_file,
        )
        for i, port in enumerate(ports)
    ]


@contextmanager
def planned_servers(config: RunConfig, run_id: str) -> Iterator[list[int]]:
    """Ports of the servers this run launches (none for `servers.launch: embedded`),
    announced to the rollout role; on the way out, whatever containers of the run are
    left are removed, even when the flow fails before `serve_inference` could."""
    if config.servers.launch == "ray":
        # The actors' URLs are known once they run; until then the rollout role waits
        # (and never reads a resumed run's old servers).
        write_signed_servers(config, run_id, [])
    if config.servers.launch != "docker":
        yield []
        return
    ports = [free_port() for _ in range(config.servers.count)]
    write_signed_servers(config, run_id, [f"http://127.0.0.1:{port}" for port in ports])
    try:
        yield ports
    finally:
        try:
            remove_run_servers(run_id)
        except Exception as exc:  # the engine went away: say so, keep the run's own error
            log.warning("could not remove the inference server containers of %s: %s", run_id, exc)


def run_servers(
    config: RunConfig, run_id: str, ports: list[int], control: RunControl | None = None
) -> dict[str, Any]:
    """Start the containers, keep them alive until the run stops, remove them."""
    logger = get_run_logger()
    start = serving_start(config, run_registry(config, run_id))
    if start is None:
        raise RuntimeError(f"run {run_id} has no committed policy version to serve")
    local = Path(config.workdir) / "runs" / run_id
    model_dir = fetch_policy(config, start, local / "server-weights", keep_latest=1)
    run_token(config, run_id)  # the flow minted it; the containers read its file
    servers = ServerContainers(
        server_specs(config, ports, model_dir, start.policy_version, token_path(config, run_id)),
        run_id,
        log_dir=local / "logs",
        max_restarts=config.servers.max_restarts,
    )
    control = control or RunControl(config, run_paths(config, run_id))
    timeout = config.servers.start_timeout_s
    try:
        servers.start()
        waited = servers.wait_healthy(timeout)
        logger.info(
            "%d %s server container(s) healthy after %.1f s: %s",
            len(ports), config.servers.engine, waited, ", ".join(servers.urls),
        )  # fmt: skip
        while not control.should_stop(check_marker_every_s=CHECK_INTERVAL_S):
            for index in servers.restart_dead(timeout):
                logger.warning("inference server %d died and was restarted", index)
            time.sleep(CHECK_INTERVAL_S)
    finally:
        servers.stop()
    return {"servers": len(ports), "restarts": sum(servers.restarts)}


def run_ray_servers(
    config: RunConfig, run_id: str, control: RunControl | None = None
) -> dict[str, Any]:
    """Start the server actors, start again the ones that die, kill them at the end.
    Runs where the flow runs (a driver of the run's Ray cluster); `config` is the one
    the nodes read."""
    logger = get_run_logger()
    registry = run_registry(config, run_id)
    start = serving_start(config, registry)
    if start is None:
        raise RuntimeError(f"run {run_id} has no committed policy version to serve")

    def newest() -> Any:
        return serving_start(config, registry) or start

    servers = RayServers(config, run_id, run_token(config, run_id))
    control = control or RunControl(config, run_paths(config, run_id))
    try:
        waited = servers.start(start)
        logger.info(
            "%d %s server actor(s) answering after %.1f s: %s",
            config.servers.count, config.servers.engine, waited, ", ".join(servers.urls),
        )  # fmt: skip
        while not control.should_stop(check_marker_every_s=CHECK_INTERVAL_S):
            for index in servers.restart_dead(newest):
                logger.warning(
                    "inference server %d died; started again at %s", index, servers.urls[index]
                )
            time.sleep(CHECK_INTERVAL_S)
    finally:
        servers.stop()
    return {"servers": config.servers.count, "restarts": sum(servers.restarts)}


@task(name="serve-inference", cache_policy=NO_CACHE, persist_result=False)
def serve_inference(
    config_json: dict[str, Any], run_id: str, ports: list[int], token: str | None = None
) -> dict[str, Any]:
    """The run's launched inference servers (containers or Ray actors), for as long as
    the run lasts. `token`: the flow's credential, for actors started with a config whose
    workdir is the nodes' (its file there may not exist yet, or hold another's)."""
    config = RunConfig.model_validate(config_json)
    if config.servers.launch == "ray":
        if token is not None:
            write_run_token(config, run_id, token)
        return run_ray_servers(config, run_id)
    return run_servers(config, run_id, ports)
