"""Fixtures for integration tests: real servers on loopback, started once per session.

``moto_s3`` runs moto's S3 server in a thread on 127.0.0.1 (a real HTTP endpoint, so s3fs
and boto3 talk the S3 protocol to it exactly as they would to AWS or MinIO).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

BUCKET = "sluice-integration"


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
