"""Inference servers the run launches as containers (`servers.launch: docker`).

The flow picks the servers' ports and writes their URLs for the rollout role
(`plan_servers`), then runs `serve_inference` beside the roles: a long-lived Prefect
task that starts the containers on the run's starting version, waits until they
answer, restarts one that dies, and removes them all when the run stops. The
containers themselves are `sluice.infra.docker_servers`.
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

from sluice.infra.config import RunConfig
from sluice.infra.docker_servers import (
    SLUICE_IMAGE,
    ServerContainers,
    ServerSpec,
    remove_run_servers,
)
from sluice.tasks.process.inference_server import free_port, write_launched_servers
from sluice.tasks.run.control import RunControl
from sluice.tasks.run.paths import run_paths, run_registry
from sluice.tasks.run.threads import role_threads
from sluice.tasks.run.versions import fetch_policy

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
    config: RunConfig, ports: list[int], model_dir: Path, weight_version: int
) -> list[ServerSpec]:
    launch = config.servers
    per = launch.gpus_per_server
    mounts = server_mounts(config)
    return [
        ServerSpec(
            engine=launch.engine,
            image=launch.image or SLUICE_IMAGE,
            model_dir=str(model_dir.resolve()),
            port=port,
            weight_version=weight_version,
            mounts=mounts,
            gpus=tuple(range(i * per, (i + 1) * per)),
            seed=config.seed,
            dtype=config.rollout.dtype,
            device="cuda" if per else "cpu",
            max_batch_size=config.rollout.max_batch_size,
            max_seq_len=config.rollout.max_seq_len,
            num_threads=None if per else role_threads(config, "rollout"),
            extra_args=tuple(launch.extra_args),
        )
        for i, port in enumerate(ports)
    ]


@contextmanager
def planned_servers(config: RunConfig, run_id: str) -> Iterator[list[int]]:
    """Ports of the servers this run launches (none for `servers.launch: embedded`),
    announced to the rollout role; on the way out, whatever containers of the run are
    left are removed, even when the flow fails before `serve_inference` could."""
    if config.servers.launch != "docker":
        yield []
        return
    ports = [free_port() for _ in range(config.servers.count)]
    write_launched_servers(config, run_id, [f"http://127.0.0.1:{port}" for port in ports])
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
    start = run_registry(config, run_id).latest()
    if start is None:
        raise RuntimeError(f"run {run_id} has no committed policy version to serve")
    local = Path(config.workdir) / "runs" / run_id
    model_dir = fetch_policy(config, start, local / "server-weights", keep_latest=1)
    servers = ServerContainers(
        server_specs(config, ports, model_dir, start.policy_version),
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


@task(name="serve-inference", cache_policy=NO_CACHE, persist_result=False)
def serve_inference(config_json: dict[str, Any], run_id: str, ports: list[int]) -> dict[str, Any]:
    """The run's inference server containers, for as long as the run lasts."""
    return run_servers(RunConfig.model_validate(config_json), run_id, ports)
