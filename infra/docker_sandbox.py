"""Code rewards in containers (``reward.sandbox: docker``), through the Docker SDK.

Each run of model-written code gets a fresh container from the pinned base image
(``infra/docker/engine.sh`` builds it): no network, a read-only root with a small
tmpfs work directory, memory without swap, a CPU quota, a pids limit, every capability
dropped, no privilege escalation, the ``nobody`` user. Inside, the process sandbox's own
runner (``sluice.engines.env.sandbox``) runs as before, so its Python-level guards stay as an inner
layer; the container is what holds when code steps around them (ctypes, or a kernel
limit that only binds a non-root user such as ``RLIMIT_NPROC``).

The deadline is enforced from outside: past it the container is killed, whatever runs
inside. Output is capped inside the container (a small boot script reads the runner's
pipes and stops it past the cap) and again by the log driver's size limit. Every
container serves one run and is removed.

Verdicts (`open_server`, used by ``sluice.engines.env.judge``): the container becomes
the function server, and the container's own stdin and stdout, held attached by the
parent, are the protocol's pipes; the tests run in the reward process, never in here.

Warm pool: starting a container costs about two seconds under the vfs storage driver
(which copies the image), far more than a verifier run. ``DockerSandbox`` keeps
``pool_size`` containers started ahead, each blocked on its stdin waiting for one run's
payload; a background thread starts a replacement as each is taken.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

from sluice.engines.env.sandbox import (
    RUNNER_ENV,
    MultiplexedChannel,
    SandboxResult,
    attached_channel,
    classify,
    make_payload,
    runner_source,
    server_source,
)
from sluice.infra.docker_servers import api_timeout_s
from sluice.infra.extras import missing_extra_message
from sluice.infra.lease import pid_alive

log = logging.getLogger(__name__)

DEFAULT_IMAGE = "sluice-base:bookworm"
LABEL = "sluice.sandbox"
"""Every sandbox container carries this label; its value names the owning process
(``host:pid``), so a later sandbox on the host removes what a killed one left."""
IDLE_EXIT_S = 3600
"""A started container nobody sends a run to exits after this long (its owner died)."""
API_TIMEOUT_S = 120
"""Seconds one Docker API call may take (the SDK's default is 60). Under the vfs storage
driver a container starts from its own copy of the ~120 MB base image, seconds when the
engine is idle and longer on a loaded or just-started one; a run's own deadline is
enforced apart from this (its wait has its own timeout), so this only bounds how long a
reward waits on a wedged engine. `DOCKER_CLIENT_TIMEOUT` overrides it."""
_MAX_OUTPUT_BYTES = 1 << 20
_WORKDIR = "/work"

# PID 1 of a sandbox container: wait for one request on stdin (a 4-byte length, then
# JSON; read exactly, so nothing after it is consumed), write the payload in /work, then
# either become the function server (mode "serve": its stdin/stdout are the container's,
# which the parent holds attached) or run the runner with stdin from a file, read its
# pipes up to the cap (killing it past the cap), and print one JSON line. The outer
# deadline kills the container, so none is kept here.
_BOOT = r"""
import json, os, selectors, signal, struct, subprocess, sys
signal.alarm(IDLE_EXIT_S)

def read_exactly(size):
    data = bytearray()
    while len(data) < size:
        chunk = os.read(0, size - len(data))
        if not chunk:
            sys.exit(0)
        data += chunk
    return bytes(data)

request = json.loads(read_exactly(struct.unpack(">I", read_exactly(4))[0]))
signal.alarm(0)
os.chdir("/work")
with open("payload.json", "w", encoding="utf-8") as fh:
    json.dump(request["payload"], fh)
if request["mode"] == "serve":
    python = sys.executable
    os.execve(python, [python, "-I", "-c", request["runner"]], request["env"])
with open("stdin.txt", "w", encoding="utf-8") as fh:
    fh.write(request["stdin"])
cap = request["max_output_bytes"]
with open("stdin.txt", "rb") as stdin:
    proc = subprocess.Popen([sys.executable, "-I", "-c", request["runner"]], stdin=stdin,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=request["env"])
chunks = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
over = False
with selectors.DefaultSelector() as selector:
    selector.register(proc.stdout, selectors.EVENT_READ)
    selector.register(proc.stderr, selectors.EVENT_READ)
    while selector.get_map() and not over:
        for key, _ in selector.select():
            data = os.read(key.fd, 65536)
            if not data:
                selector.unregister(key.fileobj)
                continue
            room = cap - len(chunks[key.fd])
            chunks[key.fd].extend(data[:room])
            over = over or len(data) > room
if over:
    proc.kill()
returncode = proc.wait()
print(json.dumps({
    "stdout": chunks[proc.stdout.fileno()].decode("latin-1"),
    "stderr": chunks[proc.stderr.fileno()].decode("latin-1"),
    "returncode": returncode,
    "over": over,
}), flush=True)
"""


def _framed(request: dict[str, Any]) -> bytes:
    """A request to the boot script: its JSON, after a 4-byte big-endian length."""
    body = json.dumps(request).encode()
    return struct.pack(">I", len(body)) + body


class SandboxUnavailable(RuntimeError):
    """No Docker engine answers, or the sandbox image is missing."""


class DockerSandbox:
    """``run_python`` in fresh, locked-down containers, started ahead in a warm pool."""

    def __init__(
        self,
        image: str = DEFAULT_IMAGE,
        *,
        pool_size: int = 2,
        memory_mb: int = 512,
        cpus: float = 1.0,
        pids_limit: int = 64,
        tmpfs_mb: int = 16,
        client: Any = None,
    ) -> None:
        """Checks the engine and the image (``SandboxUnavailable`` with the fix if not)
        and starts filling the pool (``pool_size`` 0: each run starts its container).
        ``memory_mb`` is the container's hard limit; each run's own ``memory_mb`` is its
        runner's address-space limit inside it."""
        try:
            import docker
        except ImportError as exc:  # `auto` then takes the process sandbox, as without an engine
            raise SandboxUnavailable(
                missing_extra_message("reward.sandbox=docker", "docker")
            ) from exc
        try:
            self.client = client or docker.from_env(timeout=api_timeout_s(API_TIMEOUT_S))
            self.client.ping()
        except Exception as exc:
            raise SandboxUnavailable(
                f"reward.sandbox=docker needs a Docker engine ({exc}); "
                "start one with `bash infra/docker/engine.sh`"
            ) from exc
        try:
            self.image_id = self.client.images.get(image).id
        except docker.errors.ImageNotFound as exc:
            raise SandboxUnavailable(
                f"sandbox image {image!r} is missing; build it with `bash infra/docker/engine.sh`"
            ) from exc
        self.image = image
        self.pool_size = pool_size
        self._limits = {
            "mem_limit": f"{memory_mb}m",
            "memswap_limit": f"{memory_mb}m",  # the same: no swap
            "nano_cpus": int(cpus * 1e9),
            "pids_limit": pids_limit,
            "tmpfs": {_WORKDIR: f"size={tmpfs_mb}m,mode=1777,noexec,nosuid,nodev"},
        }
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{id(self)}"
        self._remove_orphans()
        self._pool: queue.Queue[Any] = queue.Queue()
        self._closed = threading.Event()
        self._wanted = threading.Semaphore(pool_size)
        self._filler = threading.Thread(target=self._fill, name="sandbox-pool", daemon=True)
        self._filler.start()
        # Removing a used container (deleting its copy of the image) is off the
        # verifier's path too.
        self._used: queue.Queue[Any] = queue.Queue()
        self._remover = threading.Thread(target=self._remove_used, daemon=True)
        self._remover.start()
        log.info("docker sandbox: image %s (%s), warm pool of %d", image, self.image_id, pool_size)

    # ------------------------------------------------------------------ the pool

    def _start_container(self) -> Any:
        from docker.types import LogConfig

        api = self.client.api
        host_config = api.create_host_config(
            network_mode="none",
            read_only=True,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            log_config=LogConfig(type="json-file", config={"max-size": "16m", "max-file": "1"}),
            **self._limits,
        )
        # The low-level call, not detached: with stdin open it sets StdinOnce, so stdin
        # closes when the one writer detaches (how the boot learns the request is whole).
        created = api.create_container(
            self.image,
            ["/usr/bin/python3", "-I", "-c", _BOOT.replace("IDLE_EXIT_S", str(IDLE_EXIT_S))],
            stdin_open=True,
            user="65534:65534",
            # No working_dir: Docker would re-create /work root-owned 0755 over the
            # tmpfs's mode; the boot script changes into it.
            # An imported image carries no environment: PATH is set here.
            environment={"HOME": _WORKDIR, "LANG": "C.UTF-8", "PATH": "/usr/bin:/bin"},
            labels={LABEL: self._owner},
            host_config=host_config,
        )
        try:
            api.start(created["Id"])
            return self.client.containers.get(created["Id"])
        except Exception:
            with contextlib.suppress(Exception):
                api.remove_container(created["Id"], force=True)
            raise

    def _fill(self) -> None:
        while not self._closed.is_set():
            if not self._wanted.acquire(timeout=0.2):
                continue
            try:
                container = self._start_container()
            except Exception as exc:  # the engine went away: retry, do not die
                log.warning("docker sandbox: could not start a container: %s", exc)
                self._wanted.release()
                self._closed.wait(1.0)
                continue
            if self._closed.is_set():
                self._remove(container)
                return
            self._pool.put(container)

    def wait_warm(self, timeout_s: float = 120.0) -> bool:
        """Block until the pool holds ``pool_size`` started containers; False if it does
        not within ``timeout_s``. A run then takes a started container instead of paying
        for a cold start (seconds under the vfs storage driver, which copies the image)."""
        deadline = time.monotonic() + timeout_s
        while self._pool.qsize() < self.pool_size:
            if self._closed.is_set() or time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _take(self) -> Any:
        try:
            container = self._pool.get_nowait()
        except queue.Empty:
            container = self._start_container()  # a cold start: the pool ran dry
        else:
            self._wanted.release()  # the filler starts its replacement
        return container

    @staticmethod
    def _remove(container: Any) -> None:
        with contextlib.suppress(Exception):
            container.remove(force=True)

    def _remove_orphans(self) -> None:
        """Remove sandbox containers whose owning process on this host is gone."""
        host = socket.gethostname()
        # Sparse: a full listing inspects each container, and one removed in the
        # background between the listing and its inspection would raise NotFound.
        listed = self.client.containers.list(all=True, sparse=True, filters={"label": LABEL})
        for container in listed:
            labels = container.attrs.get("Labels") or {}
            owner_host, _, rest = labels.get(LABEL, "").partition(":")
            pid = rest.partition(":")[0]
            if owner_host == host and pid.isdigit() and not pid_alive(int(pid)):
                self._remove(container)

    def _remove_used(self) -> None:
        while True:
            container = self._used.get()
            if container is None:
                return
            self._remove(container)

    def close(self) -> None:
        """Stop filling and remove every container this sandbox started."""
        self._closed.set()
        self._filler.join(timeout=30)
        self._used.put(None)
        self._remover.join(timeout=60)
        while True:
            try:
                self._remove(self._pool.get_nowait())
            except queue.Empty:
                break
        mine = {"label": f"{LABEL}={self._owner}"}
        for container in self.client.containers.list(all=True, sparse=True, filters=mine):
            self._remove(container)

    def __enter__(self) -> DockerSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ one run

    def run_python(
        self,
        code: str,
        tests: str = "",
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        *,
        stdin: str = "",
    ) -> SandboxResult:
        """As ``sluice.engines.env.sandbox.run_python``, in a container of the pool."""
        payload = make_payload(code, tests, timeout_s, memory_mb, stdin)
        request = _framed(
            {
                "mode": "run",
                "payload": payload,
                "stdin": stdin,
                "runner": runner_source(),
                "env": {**RUNNER_ENV, "HOME": _WORKDIR},
                "max_output_bytes": _MAX_OUTPUT_BYTES,
            }
        )
        started = time.monotonic()
        try:
            container = self._take()
        except Exception as exc:
            return SandboxResult(False, "", f"could not start a sandbox container: {exc}", "error")
        try:
            self._send(container, request)
            timed_out = False
            try:
                status = container.wait(timeout=timeout_s + 1.0)  # + the boot script's start
            except Exception:  # the deadline: kill from outside, whatever runs inside
                timed_out = True
                with contextlib.suppress(Exception):
                    container.kill()
                status = {"StatusCode": None}
            duration_s = time.monotonic() - started
            state = container.attrs if timed_out else self._inspect(container)
            logs = b"" if timed_out else container.logs(stdout=True, stderr=False)
        except Exception as exc:
            return SandboxResult(False, "", f"sandbox container failed: {exc}", "error")
        finally:
            with contextlib.suppress(Exception):
                container.kill()  # stopped now; deleted in the background
            self._used.put(container)
        return self._result(logs, status, state, str(payload["token"]), timed_out, duration_s)

    @contextlib.contextmanager
    def open_server(
        self, code: str, timeout_s: float = 10.0, memory_mb: int = 512
    ) -> Iterator[MultiplexedChannel]:
        """A function server in a container of the pool that has loaded `code`, as a
        channel over the container's attached stdin/stdout (see
        `sluice.engines.env.judge`). The container is killed on exit and removed in
        the background. Raises when no container starts or attaches."""
        payload = make_payload(code, "", timeout_s, memory_mb)
        del payload["token"]  # the server has no use for it: nothing it prints is a verdict
        request = _framed(
            {
                "mode": "serve",
                "payload": payload,
                "stdin": "",
                "runner": server_source(),
                "env": {**RUNNER_ENV, "HOME": _WORKDIR},
                "max_output_bytes": _MAX_OUTPUT_BYTES,
            }
        )
        container = self._take()
        raw: Any = None
        try:
            params = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
            attached = container.attach_socket(params=params)
            raw = getattr(attached, "_sock", attached)
            raw.settimeout(max(timeout_s, 1.0))
            raw.sendall(request)
            yield attached_channel(raw.fileno())
        finally:
            if raw is not None:
                with contextlib.suppress(OSError):
                    raw.close()
            with contextlib.suppress(Exception):
                container.kill()
            self._used.put(container)

    @staticmethod
    def _send(container: Any, request: bytes) -> None:
        """Write the request to the container's stdin and close it (the boot reads to EOF)."""
        attached = container.attach_socket(params={"stdin": 1, "stream": 1})
        raw = getattr(attached, "_sock", attached)
        try:
            raw.sendall(request)
            raw.shutdown(socket.SHUT_WR)
        finally:
            with contextlib.suppress(OSError):
                raw.close()

    @staticmethod
    def _inspect(container: Any) -> dict[str, Any]:
        with contextlib.suppress(Exception):
            container.reload()
        return dict(container.attrs)

    @staticmethod
    def _result(
        logs: bytes,
        status: dict[str, Any],
        state: dict[str, Any],
        token: str,
        timed_out: bool,
        duration_s: float,
    ) -> SandboxResult:
        oom = bool(state.get("State", {}).get("OOMKilled"))
        lines = logs.decode("utf-8", errors="replace").strip().splitlines()
        try:
            report = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            report = None
        if report is None:  # the boot itself died (memory, pids) or the deadline hit
            code = status.get("StatusCode")
            return classify(
                b"",
                b"" if timed_out else f"sandbox container exited {code}".encode(),
                code,
                token=token,
                timed_out=timed_out,
                duration_s=duration_s,
                memory_killed=oom or code == 137,
            )
        return classify(
            report["stdout"].encode("latin-1"),
            report["stderr"].encode("latin-1"),
            report["returncode"],
            token=token,
            timed_out=timed_out,
            duration_s=duration_s,
            memory_killed=oom or report["returncode"] == -9,
            output_limited=bool(report["over"]),
        )
