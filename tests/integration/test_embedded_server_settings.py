"""The rollout's embedded server runs on the run's `device`, `rollout.dtype` and
`rollout.max_seq_len` (its KV slots' length)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from sluice.infra.config.run import load_config
from sluice.tasks.process.inference_server import EmbeddedServer

pytestmark = pytest.mark.integration

SHIPPED = (
    Path(__file__).resolve().parents[2]
    / "engines"
    / "policy"
    / "policies"
    / "longtail_sum-llama-0.9m"
)


def test_embedded_server_reports_the_configured_device_dtype_and_slot_length(tmp_path):
    overrides = ["device=cpu", "rollout.dtype=bfloat16", "rollout.max_seq_len=300"]
    config = load_config("default", overrides)
    server = EmbeddedServer(config, SHIPPED, 0, tmp_path)
    try:
        deadline = time.monotonic() + 120
        info = None
        while time.monotonic() < deadline:
            try:
                info = httpx.get(f"{server.url}/server_info", timeout=2).json()
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert info is not None, (tmp_path / "inference-server.log").read_text()
        assert info["device"] == "cpu"
        assert info["dtype"] == "bfloat16"
        assert info["max_context_length"] == 300  # the model's 512 positions, cut to the setting
    finally:
        server.stop()
