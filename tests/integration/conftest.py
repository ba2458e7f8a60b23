"""Fixtures for integration tests: real servers on loopback, started once per session.

``moto_s3`` runs moto's S3 server in a thread on 127.0.0.1 (a real HTTP endpoint, so s3fs
and boto3 talk the S3 protocol to it exactly as they would to AWS or MinIO).

A test that starts a process (a server, a worker, `sluice train`, a role) starts it in a
session of its own (``start_new_session=True``) and ends it with ``stop_process_group``
in a ``finally`` or a fixture's teardown, so a failing test leaves nothing running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

BUCKET = "sluice-integration"


def stop_process_group(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """End `process` and everything it started: SIGTERM to its process group, SIGKILL to
    whatever is left of the group after `grace_s` (children that outlived their parent
    included). `process` must lead its own group (``start_new_session=True``), never the
    test's. Never raises, so it is safe in a ``finally`` after a failed assertion."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(grace_s)
    # A group outlives its leader while any member lives, and its id is not reused
    # before then, so this reaches only what the process started.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(10)


@dataclass(frozen=True)
class S3Endpoint:
    """A running S3-compatible endpoint with one empty bucket."""

    endpoint_url: str
    """http://127.0.0.1:<port> of the server."""
    bucket: str
    """Bucket created for the session."""

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """fsspec/s3fs options that reach this endpoint with the fake credentials."""
        return {
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
            "key": "testing",
            "secret": "testing",
            **extra,
        }


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[S3Endpoint]:
    """moto's S3 server on a free loopback port, with fake credentials in the environment."""
    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    fake_env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {name: os.environ.get(name) for name in fake_env}
    os.environ.update(fake_env)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint_url = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1").create_bucket(
            Bucket=BUCKET
        )
        yield S3Endpoint(endpoint_url=endpoint_url, bucket=BUCKET)
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def s3_root(moto_s3: S3Endpoint) -> tuple[str, dict[str, Any]]:
    """A fresh ``s3://`` root (its own key prefix) and the storage options to reach it."""
    return f"s3://{moto_s3.bucket}/t-{uuid.uuid4().hex[:10]}", moto_s3.storage_options()


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Any]:
    """A Docker sandbox with two warm containers (256 MB each), shared by a module's
    tests; skips with the reason where no Docker engine or base image answers."""
    from sluice.infra.docker_sandbox import DockerSandbox, SandboxUnavailable

    try:
        box = DockerSandbox(pool_size=2, memory_mb=256)
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    box.wait_warm()
    yield box
    box.close()


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`prefect server start` on a free loopback port with a database of its own, once
    per session: the API URL. A `sluice train` with PREFECT_API_URL set reports there
    instead of starting a temporary server of its own (10-20 s cold on a 2-core box)."""
    import socket
    import sys
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    home = tmp_path_factory.mktemp("prefect-server")
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "wb")  # noqa: SIM115 - closed at teardown
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1"]
        + ["--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "prefect server did not start:\n" + (home / "server.log").read_text()
                    ) from None
                time.sleep(0.3)
        yield url
    finally:
        stop_process_group(process, grace_s=10)
        log.close()


@pytest.fixture
def shared_prefect_api(prefect_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point every `sluice train` this test starts (they inherit os.environ) at the
    session's Prefect server. The tests of the temporary server a user gets without
    PREFECT_API_URL (the interrupt and shadowing tests) do not use this."""
    monkeypatch.setenv("PREFECT_API_URL", prefect_server)
    return prefect_server
