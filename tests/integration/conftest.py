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
