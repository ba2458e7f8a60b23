"""The inference server's Prometheus `/metrics` over real loopback sockets.

The text is parsed by `prometheus_client`'s own parser (what a Prometheus-compatible
scraper reads), and the numbers are watched move: tokens after a generation, the queue
while generation is paused, the served version and the pause counters across a
pause -> update -> continue, as the rollout role does it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.engines.inference.engine import InferenceEngine
from sluice.infra.serving.server import ServerThread, create_app

pytestmark = pytest.mark.integration


@dataclass
class Served:
    url: str
    engine: InferenceEngine
    v0: Path
    v1: Path


@pytest.fixture(scope="module")
def served(one_torch_thread: None, random_model_dir: Callable[..., Path]) -> Iterator[Served]:
    v0, v1 = random_model_dir(seed=0), random_model_dir(seed=1)
    engine = InferenceEngine(v0, max_batch_size=2, max_seq_len=64, seed=0)
    app = create_app(engine, served_model_name="tiny", shutdown_engine_on_exit=True)
    server = ServerThread(app)
    url = server.start()
    yield Served(url, engine, v0, v1)
    server.stop()


@pytest.fixture
def http(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=60) as client:
        yield client


def scrape(http: httpx.Client) -> dict[str, float]:
    """Sample name -> value, after checking the content type and every sample's label."""
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            assert sample.labels == {"model_name": "tiny"}, sample
            values[sample.name] = sample.value
    return values


def test_metrics_are_valid_exposition_text_with_help_and_type_per_family(http) -> None:
    text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # The parser names a counter's family without `_total`.
    assert families["sluice_generation_tokens"].type == "counter"
    assert families["sluice_num_running_reqs"].type == "gauge"
    assert families["sluice_weight_version"].type == "gauge"
    for name, family in families.items():
        assert family.documentation, name
        assert text.count(f"# TYPE {family.samples[0].name} ") == 1
    assert text.endswith("\n")


def test_token_counters_move_after_a_generation_request(http) -> None:
    before = scrape(http)
    answer = http.post(
        "/generate",
        json={
            "input_ids": [7, 8, 9, 10],
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True},
        },
    )
    assert answer.status_code == 200
    after = scrape(http)
    assert after["sluice_generation_tokens_total"] - before["sluice_generation_tokens_total"] == 6
    assert after["sluice_prefill_tokens_total"] - before["sluice_prefill_tokens_total"] == 4
    assert after["sluice_gen_throughput"] > 0
    assert after["sluice_num_running_reqs"] == after["sluice_num_queue_reqs"] == 0


def test_waiting_requests_show_as_queue_depth_while_generation_is_paused(http, served) -> None:
    assert http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    body = {"sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    with ThreadPoolExecutor(3) as pool:
        calls = [
            pool.submit(http.post, "/generate", json={"input_ids": [11 + i], **body})
            for i in range(3)
        ]
        deadline = time.monotonic() + 30
        while scrape(http)["sluice_num_queue_reqs"] < 3:
            assert time.monotonic() < deadline, "the three requests never queued"
            time.sleep(0.02)
        paused = scrape(http)
        assert paused["sluice_paused"] == 1 and paused["sluice_num_running_reqs"] == 0
        assert http.post("/continue_generation", json={}).status_code == 200
        assert all(call.result().status_code == 200 for call in calls)
    done = scrape(http)
    assert done["sluice_num_queue_reqs"] == done["sluice_num_running_reqs"] == 0
    assert done["sluice_paused"] == 0


def test_a_weight_update_moves_the_version_and_counts_its_pause(http, served) -> None:
    before = scrape(http)
    version = int(before["sluice_weight_version"]) + 1
    assert http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    time.sleep(0.05)  # a pause long enough to measure
    update = http.post(
        "/update_weights_from_disk", json={"model_path": str(served.v1), "weight_version": version}
    )
    assert update.json()["success"] is True
    assert http.post("/continue_generation", json={}).status_code == 200
    after = scrape(http)
    assert after["sluice_weight_version"] == version
    assert after["sluice_weight_updates_total"] == before["sluice_weight_updates_total"] + 1
    stall = "sluice_weight_update_stall_seconds_total"
    assert after[stall] > before[stall]
    assert after["sluice_generation_pauses_total"] == before["sluice_generation_pauses_total"] + 1
    paused_s = after["sluice_generation_paused_seconds_total"]
    assert paused_s - before["sluice_generation_paused_seconds_total"] >= 0.05
    assert after["sluice_paused"] == 0
    # The pause is over: its seconds stay put.
    assert scrape(http)["sluice_generation_paused_seconds_total"] == paused_s
