"""Inference servers as containers (``servers.launch: docker``), through the Docker SDK.

``ServerContainers`` starts N server containers on host networking, each on its own
port of the host's loopback, waits until every one answers ``/health``, restarts one
whose container exited (same command, same port: the rollout role brings it back to
the served weights, see ``tasks/rollout/role.py``), and removes them all at the end.

Weights reach a server as paths: the starting model when it starts, and each newer
policy version through ``/update_weights_from_disk``, which names a directory in the
rollout role's weight cache. Both live under the run's workdir, so every container
mounts the workdir read-only at the same absolute path and the paths the rollout role
sends mean the same thing inside.

Two engines:
- ``sluice``: Sluice's own server (``python -m sluice.infra.serving.server``), on CPU from
  ``sluice:local`` (``infra/docker/image.sh``) or on GPUs from a CUDA build of the image;
- ``sglang``: SGLang's ``launch_server`` from an SGLang image, each server with its own
  GPUs (device requests) and tensor parallelism over them.

Both ask every caller for the run's token (SGLang's ``--api-key``). It reaches the
server as a 0600 file under the mounted workdir, never on the command line, where
``docker inspect`` and every user's ``ps`` would show it: Sluice's server reads the file
(``--api-key-file``), and SGLang is started through a two-line Python prologue that
reads it and appends ``--api-key`` to ``sys.argv`` inside the process, so its
``/proc/<pid>/cmdline`` holds the path, not the token.
"""

from __future__ import annotations

import logging
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

SLUICE_IMAGE = "sluice:local"
"""Sluice's own image as `infra/docker/image.sh` tags it: the sluice engine's default."""
SGLANG_WITH_KEY_FILE = (
    "import runpy, sys; path = sys.argv.pop(1); "
    "sys.argv += ['--api-key', open(path).read().strip()]; "
    "runpy.run_module('sglang.launch_server', run_name='__main__')"
)
"""SGLang's launcher, given its token as a file (first argument) instead of a flag."""
LABEL = "sluice.inference-server"
"""Every server container carries this label; its value is the run id, so whatever a
killed flow left behind is found and removed by run."""
API_TIMEOUT_S = 600
"""Seconds one Docker API call may take before the client gives up (the SDK's default
is 60). With the vfs storage driver (infra/docker/engine.sh's fallback where no overlay
mounts) creating a container copies the whole image and removing one deletes that
copy: measured on a busy 2-core box, 53-75 s to create a container of the 1.8 GB sluice:local and 11-15 s to remove one, more
on an engine that has just started. `DOCKER_CLIENT_TIMEOUT` overrides it (in seconds),
as it does for docker-compose and Prefect's Docker worker."""


def api_timeout_s(default: float = API_TIMEOUT_S) -> int:
    """The Docker client timeout: `DOCKER_CLIENT_TIMEOUT` when set, else `default`."""
    raw = os.environ.get("DOCKER_CLIENT_TIMEOUT", "").strip()
    try:
        return max(1, int(float(raw))) if raw else int(default)
    except ValueError as exc:
        raise ValueError(f"DOCKER_CLIENT_TIMEOUT must be seconds, got {raw!r}") from exc


class ServerLaunchError(RuntimeError):
    """A server container could not be started, did not become healthy, or kept dying."""


@dataclass(frozen=True)
class ServerSpec:
    """One server container: what runs, on which port, with which weights and devices."""

    engine: Literal["sluice", "sglang"]
    image: str
    model_dir: str
    port: int
    weight_version: int
    mounts: tuple[str, ...]
    """Host directories mounted read-only at the same path (the run's workdir)."""
    gpus: tuple[int, ...] = ()
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    max_batch_size: int = 64
    max_seq_len: int | None = None
    num_threads: int | None = None
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    """The address the server binds (0.0.0.0 where other machines must reach it)."""
    lora_rank: int = 0
    """A LoRA run's adapter rank (0: none); SGLang reserves room for adapters this large."""
    lora_target_modules: tuple[str, ...] = ()
    """The layers a LoRA run's adapters adapt (SGLang's ``--lora-target-modules``)."""
    api_key_file: str | None = None
    """The run's 0600 token file, at the same path inside (None: a server open to all)."""
    weight_master_addresses: tuple[str, ...] = ()
    """Addresses a weight group's rendezvous may be on (the nodes a trainer's sender can
    run on); empty: the server's default, loopback only. Sluice's engine only."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The server's command line inside the container."""
        if self.engine == "sglang":
            launch = ["-m", "sglang.launch_server"]
            if self.api_key_file:
                launch = ["-c", SGLANG_WITH_KEY_FILE, self.api_key_file]
            argv = [
                "python3", *launch,
                "--model-path", self.model_dir,
                "--host", self.host,
                "--port", str(self.port),
                "--tp-size", str(max(1, len(self.gpus))),
                "--random-seed", str(self.seed),
                "--dtype", self.dtype,
                "--weight-version", str(self.weight_version),
            ]  # fmt: skip
            if self.lora_rank:  # the adapter in use and the one replacing it, at most
                argv += [
                    "--enable-lora",
                    "--max-lora-rank", str(self.lora_rank),
                    "--lora-target-modules", *self.lora_target_modules,
                    "--max-loras-per-batch", "2",
                    "--max-loaded-loras", "2",
                ]  # fmt: skip
        else:
            argv = [
                "python", "-m", "sluice.infra.serving.server",
                "--model", self.model_dir,
                "--host", self.host,
                "--port", str(self.port),
                "--weight-version", str(self.weight_version),
                "--max-batch-size", str(self.max_batch_size),
                "--seed", str(self.seed),
                "--device", self.device,
                "--dtype", self.dtype,
            ]  # fmt: skip
            if self.num_threads:
                argv += ["--num-threads", str(self.num_threads)]
            if self.max_seq_len:
                argv += ["--max-seq-len", str(self.max_seq_len)]
            if self.api_key_file:
                argv += ["--api-key-file", self.api_key_file]
            for address in self.weight_master_addresses:
                argv += ["--weight-master-address", address]
        return argv + list(self.extra_args)

    def run_options(self, run_id: str, index: int) -> dict[str, Any]:
        """Keyword arguments of ``client.containers.run`` for this server."""
        import docker

        options: dict[str, Any] = {
            "command": self.command(),
            "detach": True,
            "name": f"sluice-{run_id}-server-{index}",
            "labels": {LABEL: run_id, f"{LABEL}.index": str(index)},
            "network_mode": "host",
            "volumes": {path: {"bind": path, "mode": "ro"} for path in self.mounts},
            "environment": dict(self.env),
            "log_config": docker.types.LogConfig(
                type="json-file", config={"max-size": "20m", "max-file": "2"}
            ),
        }
        if self.api_key_file:
            # The token file is 0600: the server runs as its owner to read it (the
            # image's own user would be refused).
            owner = os.stat(self.api_key_file)
            options["user"] = f"{owner.st_uid}:{owner.st_gid}"
        if self.gpus:
            options["device_requests"] = [
                docker.types.DeviceRequest(
                    device_ids=[str(g) for g in self.gpus], capabilities=[["gpu"]]
                )
            ]
        if self.engine == "sglang":
            # NCCL between tensor-parallel ranks and the tokenizer workers share memory.
            options["ipc_mode"] = "host"
            options["shm_size"] = "16g"
        return options


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError):
        return False


def docker_client(timeout_s: float | None = None) -> Any:
    """A client of the Docker engine in the environment (`DOCKER_HOST`), checked with a
    ping; each call waits up to `timeout_s` (default `api_timeout_s()`)."""
    import docker

    try:
        client = docker.from_env(timeout=int(timeout_s or api_timeout_s()))
        client.ping()
    except Exception as exc:
        raise ServerLaunchError(
            f"servers.launch=docker needs a Docker engine ({exc}); "
            "start one with `bash infra/docker/engine.sh`"
        ) from exc
    return client


def remove_run_servers(run_id: str, client: Any = None) -> int:
    """Remove every server container of ``run_id``; returns how many there were."""
    client = client or docker_client()
    found = client.containers.list(all=True, sparse=True, filters={"label": f"{LABEL}={run_id}"})
    for container in found:
        try:
            container.remove(force=True)
        except Exception as exc:  # already gone
            log.debug("removing %s: %s", container.name, exc)
    return len(found)


class ServerContainers:
    """N server containers of one run: start, wait healthy, restart the dead, remove."""

    def __init__(
        self,
        specs: list[ServerSpec],
        run_id: str,
        *,
        log_dir: Path,
        max_restarts: int = 3,
        client: Any = None,
    ) -> None:
        if not specs:
            raise ValueError("ServerContainers needs at least one server")
        self.specs = specs
        self.run_id = run_id
        self.log_dir = Path(log_dir)
        self.max_restarts = max_restarts
        self.restarts = [0] * len(specs)
        self.client = client or docker_client()
        self.containers: list[Any] = [None] * len(specs)
        self._check_image()

    @property
    def urls(self) -> list[str]:
        return [spec.url for spec in self.specs]

    def _check_image(self) -> None:
        import docker

        for image in sorted({spec.image for spec in self.specs}):
            try:
                self.client.images.get(image)
            except docker.errors.ImageNotFound as exc:
                hint = (
                    "build it with `bash infra/docker/image.sh`"
                    if image == SLUICE_IMAGE
                    else "pull or build it on this Docker host first"
                )
                raise ServerLaunchError(
                    f"inference server image {image!r} is missing: {hint}"
                ) from exc

    def start(self) -> list[str]:
        """Start every container (a leftover of the same run is replaced); their URLs."""
        remove_run_servers(self.run_id, self.client)
        for index in range(len(self.specs)):
            self._start(index)
        return self.urls

    def _start(self, index: int) -> None:
        spec = self.specs[index]
        self.containers[index] = self.client.containers.run(
            spec.image, **spec.run_options(self.run_id, index)
        )
        log.info("inference server %d: container %s on %s", index, spec.image, spec.url)

    def wait_healthy(self, timeout_s: float, indices: list[int] | None = None) -> float:
        """Block until the servers answer /health; seconds waited. A container that exits
        meanwhile or a deadline passed raises with its last log lines."""
        started = time.monotonic()
        waiting = list(range(len(self.specs)) if indices is None else indices)
        while waiting:
            for index in list(waiting):
                if healthy(self.specs[index].url):
                    waiting.remove(index)
                elif self._exited(index) is not None:
                    raise ServerLaunchError(
                        f"inference server {index} exited before it was healthy:\n"
                        f"{self._tail(index)}"
                    )
            if waiting and time.monotonic() - started > timeout_s:
                raise ServerLaunchError(
                    f"inference server {waiting[0]} not healthy after {timeout_s:g} s "
                    f"({self.specs[waiting[0]].url}):\n{self._tail(waiting[0])}"
                )
            if waiting:
                time.sleep(0.5)
        return time.monotonic() - started

    def _exited(self, index: int) -> int | None:
        """The exit code of server ``index``'s container, None while it runs."""
        import docker

        container = self.containers[index]
        try:
            container.reload()
        except docker.errors.NotFound:
            return -1
        if container.status in ("exited", "dead"):
            return int(container.attrs["State"]["ExitCode"])
        return None

    def _tail(self, index: int, lines: int = 20) -> str:
        try:
            return self.containers[index].logs(tail=lines).decode(errors="replace")
        except Exception as exc:
            return f"(no logs: {exc})"

    def restart_dead(self, health_timeout_s: float) -> list[int]:
        """Start a new container for each server whose container exited; which ones."""
        restarted = []
        for index in range(len(self.specs)):
            code = self._exited(index)
            if code is None:
                continue
            if self.restarts[index] >= self.max_restarts:
                raise ServerLaunchError(
                    f"inference server {index} died (exit {code}) after "
                    f"{self.restarts[index]} restarts (servers.max_restarts):\n{self._tail(index)}"
                )
            self.restarts[index] += 1
            log.warning(
                "inference server %d exited with code %d; restarting (%d of %d)",
                index, code, self.restarts[index], self.max_restarts,
            )  # fmt: skip
            self._save_logs(index, suffix=f".restart{self.restarts[index]}")
            self._remove(index)
            self._start(index)
            restarted.append(index)
        if restarted:
            self.wait_healthy(health_timeout_s, restarted)
        return restarted

    def _save_logs(self, index: int, suffix: str = "") -> None:
        """Keep a container's output in the run's log directory before it is removed."""
        try:
            output = self.containers[index].logs()
        except Exception:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / f"inference-server-{index}{suffix}.log").write_bytes(output)

    def _remove(self, index: int) -> None:
        try:
            self.containers[index].remove(force=True)
        except Exception as exc:
            log.debug("removing server %d: %s", index, exc)

    def stop(self) -> None:
        """Save every container's log and remove them all (and any leftover of the run)."""
        for index, container in enumerate(self.containers):
            if container is not None:
                self._save_logs(index)
                self._remove(index)
        remove_run_servers(self.run_id, self.client)
