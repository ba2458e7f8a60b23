"""A caller who reaches a server's port asks for more than a server should give: huge
``n``, huge batches, huge or endless bodies, a flooded queue, a body that is not
JSON, a temperature that breaks the arithmetic, a stale weight version. Each is sent
over real loopback HTTP to Sluice's built-in server and refused in one line, and the
server goes on serving (``infra/serving/limits.py``, ``request_parsing.py``,
``versions.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from sluice.engines.inference.engine import InferenceEngine
from sluice.infra.serving import protocol
from sluice.infra.serving.limits import ServerLimits
from sluice.infra.serving.server import ServerThread, create_app
from sluice.infra.serving.versions import update_label

pytestmark = pytest.mark.integration

LIMITS = ServerLimits(
    max_n=16, max_prompts_per_call=8, max_request_bytes=64_000, max_queued_requests=6
)


@dataclass
class Served:
    url: str
    engine: InferenceEngine
    model_dir: Path


@pytest.fixture(scope="module")
def served(one_torch_thread: None, tiny_dir: Path) -> Iterator[Served]:
    engine = InferenceEngine(tiny_dir, max_batch_size=2, max_seq_len=32, seed=0)
    server = ServerThread(create_app(engine, shutdown_engine_on_exit=True, limits=LIMITS))
    url = server.start()
    yield Served(url, engine, tiny_dir)
    server.stop(timeout_s=10)


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as client:
        yield client


def _one_line_400(response: httpx.Response, *fragments: str) -> str:
    assert response.status_code == 400, (response.status_code, response.text[:300])
    message = protocol.error_message(response.json())
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def _healthy(http: httpx.Client, url: str) -> None:
    assert http.get(f"{url}/health", timeout=2).status_code == 200


def test_a_huge_n_is_refused_at_once_and_health_stays_up(
    served: Served, http: httpx.Client
) -> None:
    # Before: n=100000 expanded, validated and queued 100000 samples on the event loop
    # (/health blocked 8 s, the server's memory doubled).
    started = time.monotonic()
    answer = http.post(
        f"{served.url}/generate",
        json={"input_ids": [3, 4], "sampling_params": {"n": 100_000, "max_new_tokens": 2}},
    )
    assert time.monotonic() - started < 2
    _one_line_400(answer, "n is 100000, over this server's bound 16")
    assert served.engine.num_waiting == 0
    _healthy(http, served.url)


def test_too_many_prompts_in_one_call_are_refused(served: Served, http: httpx.Client) -> None:
    body = {"input_ids": [[3, 4]] * 9, "sampling_params": {"max_new_tokens": 1}}
    _one_line_400(http.post(f"{served.url}/generate", json=body), "9 prompts, over", "bound 8")
    texts = {"text": ["a"] * 9}  # refused before a tokenizer is asked for
    _one_line_400(http.post(f"{served.url}/generate", json=texts), "9 prompts, over")


def test_prompts_times_n_past_the_queue_bound_are_refused(
    served: Served, http: httpx.Client
) -> None:
    body = {"input_ids": [[3, 4]] * 4, "sampling_params": {"n": 2, "max_new_tokens": 1}}
    _one_line_400(http.post(f"{served.url}/generate", json=body), "8 samples, over")


def test_max_new_tokens_past_the_models_context_is_refused(
    served: Served, http: httpx.Client
) -> None:
    body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 10**12}}
    _one_line_400(http.post(f"{served.url}/generate", json=body), "over the model's context")


def test_a_body_declared_over_the_bound_is_refused_unread(
    served: Served, http: httpx.Client
) -> None:
    big = b'{"input_ids": [' + b"3, " * 40_000 + b"3]}"
    answer = http.post(
        f"{served.url}/generate", content=big, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 413
    assert "over 64000 bytes (120018 declared)" in protocol.error_message(answer.json())
    _healthy(http, served.url)


def test_a_chunked_body_without_a_length_is_cut_off_at_the_bound(
    served: Served, http: httpx.Client
) -> None:
    sent = 0

    def endless() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"input_ids": ['
        while sent < 10_000_000:  # would be 10 MB; the server stops reading at 64 kB
            sent += 8_000
            yield b"3, " * 2_666
        yield b"3]}"

    try:
        answer = http.post(f"{served.url}/update_weights_from_disk", content=endless())
    except httpx.HTTPError:
        pass  # the server may close the connection while the client still writes
    else:
        assert answer.status_code == 413
        assert "read so far" in protocol.error_message(answer.json())
    assert sent < 10_000_000
    _healthy(http, served.url)


def test_a_call_past_the_queue_bound_gets_503_and_queues_nothing(
    served: Served, http: httpx.Client
) -> None:
    url = served.url

    async def go() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            await client.post(f"{url}/pause_generation", json={"mode": "in_place"})
            first = asyncio.create_task(
                client.post(
                    f"{url}/generate",
                    json={"input_ids": [3, 4], "sampling_params": {"n": 4, "max_new_tokens": 1}},
                )
            )
            while served.engine.num_waiting < 4:
                await asyncio.sleep(0.01)
            flood = await client.post(
                f"{url}/generate",
                json={"input_ids": [3, 4], "sampling_params": {"n": 3, "max_new_tokens": 1}},
            )
            assert flood.status_code == 503
            assert "the request queue is full" in protocol.error_message(flood.json())
            assert served.engine.num_waiting == 4
            await client.post(f"{url}/continue_generation", json={})
            assert (await first).status_code == 200

    asyncio.run(asyncio.wait_for(go(), 60))


@pytest.mark.parametrize("temperature", ["Infinity", "-Infinity", "NaN"])
def test_a_non_finite_sampling_value_is_refused(
    served: Served, http: httpx.Client, temperature: str
) -> None:
    body = f'{{"input_ids": [3, 4], "sampling_params": {{"temperature": {temperature}}}}}'
    answer = http.post(
        f"{served.url}/generate", content=body, headers={"content-type": "application/json"}
    )
    _one_line_400(answer, f"{temperature.lstrip('-')} is not a JSON number")


def test_a_vanishing_temperature_decodes_greedily(served: Served, http: httpx.Client) -> None:
    # Before: 1e-39 divided the logits into inf, NaN logprobs, and a 500 after generating.
    def generate(temperature: float) -> dict:
        params = {"temperature": temperature, "max_new_tokens": 6, "ignore_eos": True}
        answer = http.post(
            f"{served.url}/generate",
            json={"input_ids": [3, 4, 5], "sampling_params": params, "return_logprob": True},
        )
        assert answer.status_code == 200, answer.text[:300]
        return answer.json()

    greedy = generate(0.0)
    for tiny in (1e-39, 1e-300, 5e-6):
        assert generate(tiny)["output_ids"] == greedy["output_ids"]
        tiny_logprobs = generate(tiny)["meta_info"]["output_token_logprobs"]
        assert tiny_logprobs == greedy["meta_info"]["output_token_logprobs"]


MALFORMED = [
    b"[",
    b'"a string"',
    b"[1, 2]",
    b"\xff\xfe",
    b"[" * 30_000 + b"]" * 30_000,  # past a parser's recursion limit
    b'{"weight_version": [1]}',
]
ROUTES = [
    protocol.GENERATE,
    protocol.UPDATE_WEIGHTS_FROM_DISK,
    protocol.INIT_WEIGHTS_UPDATE_GROUP,
    protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED,
    protocol.UPDATE_WEIGHTS_FROM_TENSOR,
    protocol.DESTROY_WEIGHTS_UPDATE_GROUP,
]
TYPE_CONFUSED = {
    protocol.INIT_WEIGHTS_UPDATE_GROUP: {
        "master_address": "127.0.0.1", "master_port": 10**30, "rank_offset": 1, "world_size": 2
    },
    protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED: {
        "names": [["a"]], "dtypes": [{}], "shapes": [[1.5]]
    },
    protocol.UPDATE_WEIGHTS_FROM_TENSOR: {
        "serialized_named_tensors": ["e30="], "weight_version": {"r": 1}
    },
    protocol.UPDATE_WEIGHTS_FROM_DISK: {"model_path": ["x"], "weight_version": "r-1/v2"},
    protocol.GENERATE: {"input_ids": [[3, "x"]], "sampling_params": {"temperature": "hot"}},
}  # fmt: skip


@pytest.mark.parametrize("route", ROUTES)
def test_a_body_that_does_not_parse_is_a_400_in_one_line_never_a_500(
    served: Served, http: httpx.Client, route: str
) -> None:
    version = served.engine.weight_version
    bodies = [*MALFORMED]
    if route in TYPE_CONFUSED:
        import json

        bodies.append(json.dumps(TYPE_CONFUSED[route]).encode())
    for body in bodies:
        answer = http.post(
            f"{served.url}{route}", content=body, headers={"content-type": "application/json"}
        )
        assert answer.status_code == 400, (route, body[:40], answer.status_code, answer.text[:200])
        text = protocol.error_message(answer.json())
        assert isinstance(text, str) and "\n" not in text and "internal error" not in text
    assert served.engine.weight_version == version
    _healthy(http, served.url)


def _load(http: httpx.Client, served: Served, label: object) -> httpx.Response:
    return http.post(
        f"{served.url}/update_weights_from_disk",
        json={"model_path": str(served.model_dir), "weight_version": label},
    )


def test_weight_versions_only_move_forward_in_incarnation_and_step_order(
    served: Served, http: httpx.Client
) -> None:
    assert _load(http, served, "5").status_code == 200
    # A bare step (today's senders) within the incarnation served: not below it.
    _one_line_400(_load(http, served, "3"), "weight version 3 is older than the served r0/v5")
    assert served.engine.weight_version == 5
    assert _load(http, served, 5).status_code == 200  # the same version again: a retry
    # A trainer restarted from an older durable version: a lower step, a higher incarnation.
    assert _load(http, served, "r1/v2").status_code == 200
    assert served.engine.weight_version == 2
    _one_line_400(_load(http, served, "r0/v9"), "r0/v9 is older than the served r1/v2")
    _one_line_400(_load(http, served, "1"), "1 is older than the served r1/v2")
    assert _load(http, served, "3").status_code == 200  # a bare step: incarnation 1's
    answer = http.get(f"{served.url}/get_weight_version").json()
    assert answer == {"weight_version": "3"}
    # The rollout going back to the run's durable version 0 after a crash names it above
    # what the servers hold (update_label); the same bare step is refused.
    _one_line_400(_load(http, served, "0"), "0 is older than the served r1/v3")
    assert _load(http, served, update_label((0, 0), (1, 3))).status_code == 200
    assert served.engine.weight_version == 0
