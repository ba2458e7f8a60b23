"""Inference servers as Ray actors (`servers.launch: ray`).

Each server is one `ServerActor`, placed by `cluster.servers` on whatever node of the
cluster offers it. The actor is the server's agent on that node: it fetches the
weights the server loads into the node's own cache (the storage every node reaches
is the only thing nodes share), starts the server process listening on the node's
address, and says whether that process still runs.

Two sides use the actors:
- the flow (`RayServers`, run by `run_ray_servers` in tasks/process/servers.py):
  starts them on the run's newest version, publishes their URLs and actor names in
  the run's `servers.json`, starts a server again (a new actor, wherever there is
  room) when its process exited or its actor or node was lost, and kills them all
  when the run stops;
- the rollout role (`ServerActors`): reads `servers.json`, and before each weight
  update asks every actor to fetch the version onto its node, then sends each server
  the path on its own node. A restarted server starts from the newest committed version;
  the rollout role brings it to the version it serves (tasks/rollout/role.py,
  `recover_servers`), as for containers.

A server listens on the address its node registered with Ray, not on every interface,
and asks for the run's token: the flow hands it to each actor as a call argument, and
the actor writes it to a 0600 file on its own node for the server to read
(tasks/run/credential.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sluice.infra.config.cluster import RolePlacement
from sluice.infra.config.run import RunConfig
from sluice.infra.docker_servers import ServerLaunchError, healthy
from sluice.infra.registry import CommittedVersion
from sluice.tasks.process.inference_server import server_spec
from sluice.tasks.process.ports import free_port
from sluice.tasks.process.ray_ranks import NAMESPACE, RAY_ADDRESS_ENV, node_address
from sluice.tasks.run.control import SERVERS_FILE
from sluice.tasks.run.credential import verified_servers, write_run_token, write_signed_servers
from sluice.tasks.run.paths import read_json, run_paths
from sluice.tasks.run.versions import fetch_update

log = logging.getLogger(__name__)

NODE_ADDRESS_ENV = "SLUICE_NODE_ADDRESS"
"""The address this node registered with Ray, set for the roles a Ray node runs
(tasks/process/supervisor.py, `run_role_on_node`): what their listeners bind."""
CALL_TIMEOUT_S = 30.0
"""How long the flow waits for an actor to say whether its server runs."""
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # A server whose actor died (its worker killed) must not keep the node's GPU.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def private_address() -> str:
    """The address a listener of this process binds on a cluster: the node's as Ray
    reports it, never every interface (0.0.0.0 would answer on public ones too)."""
    address = os.environ.get(NODE_ADDRESS_ENV)
    if address:
        return address
    try:
        import ray

        if ray.is_initialized():
            return node_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def cluster_addresses() -> tuple[str, ...]:
    """Loopback and the address of every live node of the Ray cluster: where a trainer's
    weight sender may form a weight group from (a node that joins later is not among
    them; its sender's versions then load from disk)."""
    import ray

    nodes = [n.get("NodeManagerAddress") for n in ray.nodes() if n.get("Alive")]
    return ("127.0.0.1", "::1", *sorted({a for a in nodes if a}))


class RayServerLost(RuntimeError):
    """A server's actor (or its node) is gone: the flow starts it again elsewhere."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(message)
        self.url = url


class ServersNotPlaced(ServerLaunchError):
    """No node took a server actor (or its server did not start) within the deadlines."""


class ServerActor:
    """One inference server on the node Ray placed this actor on."""

    def __init__(self, config_json: dict[str, Any], run_id: str, index: int, token: str) -> None:
        self.config = RunConfig.model_validate(config_json)
        self.run_id = run_id
        self.index = index
        # This node's copy of the run's token, read by the server (never on its argv).
        self.token_file = write_run_token(self.config, run_id, token)
        local = Path(self.config.workdir) / "runs" / run_id
        self.cache_dir = local / f"server-{index}-weights"
        self.log_path = local / "logs" / f"inference-server-{index}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.url: str | None = None

    def prefetch(self, version_json: dict[str, Any]) -> str:
        """`version`'s weights on this node (fetched once; the newest two are kept)."""
        version = CommittedVersion.model_validate(version_json)
        return str(fetch_update(self.config, version, self.cache_dir, keep_latest=2).resolve())

    def start(self, version_json: dict[str, Any]) -> str:
        """Start the server on `version` and wait until it answers; its URL."""

        model_dir = Path(self.prefetch(version_json))
        host = node_address()  # the node's private address, the one other nodes reach
        port = free_port(host)
        gpus = tuple(range(self.config.servers.gpus_per_server))  # Ray set CUDA_VISIBLE_DEVICES
        version = int(version_json["policy_version"])
        spec = server_spec(
            self.config,
            port,
            model_dir,
            version,
            gpus,
            host=host,
            api_key_file=self.token_file,
            weight_master_addresses=cluster_addresses(),
        )
        argv = [sys.executable, *spec.command()[1:]]  # this node's Python, not the PATH's
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **spec.env},
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads run the fork here
            )
        self.url = f"http://{host}:{port}"
        deadline = time.monotonic() + self.config.servers.start_timeout_s
        while not healthy(self.url):
            code = self.process.poll()
            if code is not None:
                raise ServerLaunchError(
                    f"inference server {self.index} exited with code {code} before it "
                    f"answered:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ServerLaunchError(
                    f"inference server {self.index} did not answer within "
                    f"{self.config.servers.start_timeout_s:g} s:\n{self.tail()}"
                )
            time.sleep(0.5)
        return self.url

    def exit_code(self) -> int | None:
        """The server process's exit code; None while it runs."""
        return None if self.process is None else self.process.poll()

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def server_placement(config: RunConfig) -> RolePlacement:
    """What one server actor asks of its node: `cluster.servers`, its GPUs defaulting to
    `servers.gpus_per_server`."""
    placement = config.cluster.servers
    if not placement.num_gpus and config.servers.gpus_per_server:
        placement = placement.model_copy(update={"num_gpus": config.servers.gpus_per_server})
    return placement


def actor_options(config: RunConfig) -> dict[str, Any]:
    """Ray options of one server actor."""
    options = server_placement(config).ray_options()
    # Threaded: the rollout role's prefetch must not queue behind the flow's checks.
    return {**options, "namespace": NAMESPACE, "max_restarts": 0, "max_concurrency": 4}


class RayServers:
    """The run's server actors, from the flow's side (a Ray driver)."""

    def __init__(self, config: RunConfig, run_id: str, token: str) -> None:
        self.config = config
        self.shipped = config.model_dump(mode="json")
        self.run_id = run_id
        self._token = token  # each actor's call argument: it writes its node's file
        count = config.servers.count
        self.actors: list[Any] = [None] * count
        self.names: list[str] = [""] * count
        self.urls: list[str] = [""] * count
        self.restarts = [0] * count
        self._generation = 0

    def _create(self, index: int, version: CommittedVersion) -> Any:
        import ray

        self._generation += 1
        name = f"sluice-{self.run_id}-server-{index}-{self._generation}"
        actor = (
            ray.remote(ServerActor)
            .options(name=name, **actor_options(self.config))
            .remote(self.shipped, self.run_id, index, self._token)
        )
        self.actors[index], self.names[index] = actor, name
        return actor.start.remote(version.model_dump(mode="json"))

    def start(self, version: CommittedVersion, indices: list[int] | None = None) -> float:
        """Start servers `indices` (all) on `version`, wait for them and publish their
        URLs; seconds waited. A server no node takes in time, or that fails, raises."""
        import ray

        started = time.monotonic()
        indices = list(range(len(self.actors))) if indices is None else indices
        pending = {self._create(i, version): i for i in indices}
        timeout = self.config.cluster.placement_timeout_s + self.config.servers.start_timeout_s
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout)
        failed: Exception | None = None
        for ref in ready:
            try:
                self.urls[pending[ref]] = ray.get(ref)
            except Exception as exc:  # the actor's own error, or its node lost meanwhile
                failed = failed or exc
        # Published before any error: the servers that did start are the ones to use.
        write_signed_servers(self.config, self.run_id, list(self.urls), actors=self.names)
        if failed is not None:
            raise failed
        if len(ready) < len(pending):
            missing = sorted(i for ref, i in pending.items() if ref not in ready)
            raise ServersNotPlaced(
                f"inference server(s) {missing} not running after {timeout:g} s: no node "
                f"took {actor_options(self.config)} (cluster.servers) within "
                f"cluster.placement_timeout_s, or the server did not start within "
                f"servers.start_timeout_s"
            )
        return time.monotonic() - started

    def dead(self) -> list[int]:
        """Servers whose process exited, or whose actor (or its node) is gone."""
        import ray

        refs = {actor.exit_code.remote(): i for i, actor in enumerate(self.actors)}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=CALL_TIMEOUT_S)
        found = []
        for ref in ready:
            try:
                code = ray.get(ref)
            except ray.exceptions.RayError as exc:  # actor or node lost
                log.warning("inference server %d lost: %s", refs[ref], str(exc).splitlines()[0])
                found.append(refs[ref])
                continue
            if code is not None:
                found.append(refs[ref])
        return sorted(found)

    def restart_dead(self, newest: Any) -> list[int]:
        """Start again, on the newest committed version (`newest()`), each server that
        died; which ones. Past `servers.max_restarts` for one server, raises."""
        import ray

        dead = self.dead()
        if not dead:
            return []
        for index in dead:
            if self.restarts[index] >= self.config.servers.max_restarts:
                raise ServerLaunchError(
                    f"inference server {index} died after {self.restarts[index]} restarts "
                    f"(servers.max_restarts)"
                )
            self.restarts[index] += 1
            with contextlib.suppress(Exception):
                ray.kill(self.actors[index])
        try:
            self.start(newest(), dead)
        except ServersNotPlaced:
            raise  # no node took it in time: the run cannot go on
        except (ray.exceptions.RayError, ServerLaunchError) as exc:
            # Lost again while starting, or it failed: the next check finds it dead and
            # starts it again, within servers.max_restarts.
            log.warning("inference server(s) %s did not start again: %s", dead, exc)
        return dead

    def stop(self) -> None:
        import ray

        for actor in self.actors:
            if actor is None:
                continue
            with contextlib.suppress(Exception):
                ray.get(actor.stop.remote(), timeout=CALL_TIMEOUT_S)
            with contextlib.suppress(Exception):
                ray.kill(actor)


class ServerActors:
    """The run's server actors, from the rollout role's side: their URLs, and each
    version's weights fetched onto every server's node."""

    def __init__(self, config: RunConfig, run_id: str) -> None:
        import ray

        self.config = config
        self.run_id = run_id
        self.urls: list[str] = []
        self.names: list[str] = []
        self._handles: dict[str, Any] = {}
        if not ray.is_initialized():
            address = os.environ.get(RAY_ADDRESS_ENV)
            if not address:
                raise RuntimeError(
                    f"servers.launch=ray: the rollout role was not told the Ray cluster "
                    f"({RAY_ADDRESS_ENV}); it runs under `sluice train` with cluster.engine=ray"
                )
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)

    def read(self) -> list[str]:
        """The servers' URLs as the flow last published them (empty: not started yet)."""
        document = read_json(
            self.config, f"{run_paths(self.config, self.run_id).control}/{SERVERS_FILE}"
        )
        if document and document.get("actors"):
            verified_servers(self.config, self.run_id, document)  # before a URL gets the token
            self.urls = [str(u) for u in document["urls"]]
            self.names = [str(n) for n in document["actors"]]
        return list(self.urls)

    def wait(self, timeout_s: float, should_stop: Any) -> list[str]:
        """The servers' URLs, once the flow has started them all."""
        deadline = time.monotonic() + timeout_s
        while not self.read():
            if should_stop() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"servers.launch=ray: the run's inference servers were not started "
                    f"within {timeout_s:g} s (servers.start_timeout_s); see the flow's log"
                )
            time.sleep(1.0)
        return list(self.urls)

    def prefetch(self, version: CommittedVersion) -> dict[str, str]:
        """`version` fetched onto every server's node: per server URL, the path there."""
        import ray

        self.read()
        paths = {}
        for url, name in zip(self.urls, self.names, strict=True):
            try:
                ref = self._handle(name).prefetch.remote(version.model_dump(mode="json"))
                paths[url] = ref
            except ValueError as exc:  # no actor of that name any more
                raise RayServerLost(url, f"inference server actor {name} is gone: {exc}") from exc
        for url, ref in paths.items():
            try:  # a deadline: an actor that never answers must not hold the role
                paths[url] = ray.get(ref, timeout=self.config.servers.start_timeout_s)
            except (
                ray.exceptions.RayActorError,
                ray.exceptions.ActorUnavailableError,
                ray.exceptions.GetTimeoutError,
            ) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise RayServerLost(url, f"inference server at {url} lost: {first}") from exc
        return paths

    def _handle(self, name: str) -> Any:
        import ray

        if name not in self._handles:
            self._handles[name] = ray.get_actor(name, namespace=NAMESPACE)
        return self._handles[name]
