"""Contract: our client and server speak SGLang's own HTTP schema.

SGLang ships its JSON contract as generated types (``sglang/api/v1/api_types.py``,
msgspec structs with the server's exact decode rules). The file is loaded by
path, without importing the ``sglang`` package (which needs CUDA and a large
dependency tree), after ``pip install --no-deps sglang==0.5.23 msgspec``.
Control-plane request types live in ``srt/managers/io_struct.py``, which
imports half of SGLang, so their field names are read from its syntax tree.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from transformers import LlamaConfig

from sluice.engines.inference.engine import InferenceEngine
from sluice.infra.serving import protocol
from sluice.infra.serving.client import InferenceClient
from sluice.infra.serving.protocol import SGLANG_SAMPLING_KEYS
from sluice.infra.serving.server import create_app


def _sglang_root() -> Path | None:
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _load_api_types() -> ModuleType:
    root = _sglang_root()
    if root is None:
        pytest.skip(
            "sglang is not installed; `pip install --no-deps sglang==0.5.23 msgspec` enables this test"
        )
    path = root / "api" / "v1" / "api_types.py"
    if not path.is_file():
        pytest.skip(
            f"{path} not found; this contract test needs sglang 0.5.23's generated API types"
        )
    if importlib.util.find_spec("msgspec") is None:
        pytest.skip("msgspec is not installed; SGLang's API types need it")
    spec = importlib.util.spec_from_file_location("_sglang_api_types_v1", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _io_struct_fields(class_name: str) -> set[str]:
    root = _sglang_root()
    assert root is not None
    tree = ast.parse((root / "srt" / "managers" / "io_struct.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            }
    raise AssertionError(f"{class_name} not found in SGLang's io_struct.py")


@pytest.fixture(scope="module")
def api() -> ModuleType:
    return _load_api_types()


@pytest.fixture(scope="module")
def model_dir(random_model_dir: Callable[..., Path]) -> Path:
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=1,
    )
    return random_model_dir(seed=0, config=config, peaked=False)


class _Recorder(httpx.AsyncBaseTransport):
    """Passes requests to the in-process ASGI app and keeps each JSON body exchanged."""

    def __init__(self, app: Any) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.exchanges: list[tuple[str, Any, int, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content) if request.content else None
        response = await self.inner.handle_async_request(request)
        content = await response.aread()
        received = json.loads(content) if content else None
        self.exchanges.append((request.url.path, sent, response.status_code, received))
        return httpx.Response(response.status_code, headers=response.headers, content=content)


@pytest.fixture(scope="module")
def exchanges(model_dir: Path) -> list[tuple[str, Any, int, Any]]:
    """Drive our server with our client (no sockets) and record every body."""
    engine = InferenceEngine(model_dir, max_batch_size=4, max_seq_len=64)
    engine.start()
    recorder = _Recorder(create_app(engine))

    async def drive() -> None:
        async with InferenceClient(
            ["http://sluice.test"], timeout_s=60, transport=recorder
        ) as client:
            await client.generate(
                [3, 4, 5], {"max_new_tokens": 6, "temperature": 0.7, "top_p": 0.9, "top_k": 5}
            )
            await client.generate_group(
                [6],
                3,
                {
                    "max_new_tokens": 4,
                    "stop_token_ids": [1],
                    "ignore_eos": False,
                    "sampling_seed": 2,
                },
            )
            await client.generate([7], {"max_new_tokens": 3}, return_logprob=False)
            # An on-policy batch: two groups in one request, each with its own seed.
            await client.generate_groups(
                [[8, 9], [10]],
                2,
                [
                    {"max_new_tokens": 3, "sampling_seed": 5},
                    {"max_new_tokens": 3, "sampling_seed": 9},
                ],
            )
            await client.pause("retract")
            await client.update_weights_from_disk(str(model_dir), 1)
            await client.continue_()
            await client.pause("in_place")
            await client.continue_()
            await client.model_info()
            await client.health()

    try:
        asyncio.run(drive())
    finally:
        engine.shutdown()
    return recorder.exchanges


def test_our_sampling_keys_are_exactly_sglangs(api: ModuleType) -> None:
    assert set(SGLANG_SAMPLING_KEYS) == set(api.SamplingParams.__struct_fields__)


def test_client_generate_requests_decode_as_sglang_generate_requests(
    api: ModuleType, exchanges: list
) -> None:
    bodies = [sent for path, sent, _, _ in exchanges if path == "/generate"]
    # A group of 3 samples is one request with SGLang's `n`, not three requests.
    assert len(bodies) == 4
    assert bodies[1]["sampling_params"]["n"] == 3
    assert [p["n"] for p in bodies[3]["sampling_params"]] == [2, 2]  # a batch: n per prompt
    for body in bodies:
        decoded = api.GenerateRequest.from_json_value(
            body
        )  # raises JsonContractError on a violation
        # GenerateRequest ignores unknown top-level keys, so check the names too.
        assert set(body) <= set(api.GenerateRequest.__struct_fields__)
        assert decoded.input_ids == body["input_ids"]


def test_server_generate_responses_decode_as_sglang_generate_responses(
    api: ModuleType, exchanges: list
) -> None:
    answers = [
        (sent, one)
        for path, sent, status, received in exchanges
        if path == "/generate" and status == 200
        # A request with n > 1 is answered with a list: one response per sample.
        for one in (received if isinstance(received, list) else [received])
    ]
    assert len(answers) == 9
    for sent, received in answers:
        decoded = api.GenerateResponse.from_json_value(received)
        assert set(received) <= set(api.GenerateResponse.__struct_fields__)
        assert set(received["meta_info"]) <= set(api.GenerateMetaInfo.__struct_fields__)
        meta = decoded.meta_info
        assert isinstance(meta.finish_reason, api.FinishStop | api.FinishLength | api.FinishAbort)
        assert meta.completion_tokens == len(decoded.output_ids)
        assert meta.weight_versions and meta.weight_versions[-1].end == len(decoded.output_ids)
        assert meta.weight_version == meta.weight_versions[-1].version
        if sent["return_logprob"]:
            assert [e.token_id for e in meta.output_token_logprobs] == decoded.output_ids
        else:
            assert meta.output_token_logprobs is None


def test_control_requests_use_only_sglang_fields(api: ModuleType, exchanges: list) -> None:
    base = _io_struct_fields("BaseReq")
    allowed = {
        "/pause_generation": _io_struct_fields("PauseGenerationReqInput") | base,
        "/continue_generation": _io_struct_fields("ContinueGenerationReqInput") | base,
        "/update_weights_from_disk": _io_struct_fields("UpdateWeightFromDiskReqInput") | base,
    }
    seen = set()
    for path, sent, status, received in exchanges:
        if path in allowed:
            seen.add(path)
            assert status == 200
            assert set(sent) <= allowed[path], f"{path} sent {set(sent) - allowed[path]}"
        if path == "/pause_generation":
            assert sent["mode"] in ("abort", "retract", "in_place")
        if path == "/update_weights_from_disk":
            assert isinstance(sent["weight_version"], str)  # SGLang types it Optional[str]
            assert received["success"] is True
    assert seen == set(allowed)


def test_model_info_decodes_as_sglang_model_info(api: ModuleType, exchanges: list) -> None:
    (received,) = [r for path, _, _, r in exchanges if path == "/model_info"]
    decoded = api.GetModelInfoResponse.from_json_value(received)
    assert decoded.weight_version == "1" and decoded.is_generation


def test_unknown_sampling_key_is_refused_like_sglang(api: ModuleType, model_dir: Path) -> None:
    body = {"input_ids": [3], "sampling_params": {"max_new_tokens": 2, "top_q": 0.5}}
    with pytest.raises(api.JsonContractError, match="top_q"):
        api.GenerateRequest.from_json_value(body)
    engine = InferenceEngine(model_dir, max_batch_size=1, max_seq_len=32)

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://sluice.test") as http:
            return await http.post("/generate", json=body)

    response = asyncio.run(post())
    assert response.status_code == 400
    assert "unknown field `top_q`" in response.json()["error"]


def test_client_reads_sglang_encoded_responses(api: ModuleType) -> None:
    """A response as SGLang encodes it (spans, typed finish reason) parses to per-token versions."""
    response = api.GenerateResponse(
        text="abc",
        output_ids=[5, 6, 7],
        meta_info=api.GenerateMetaInfo(
            id="r1",
            prompt_tokens=2,
            completion_tokens=3,
            finish_reason=api.FinishStop(matched=7),
            output_token_logprobs=[
                api.LogprobEntry(logprob=-0.5, token_id=5),
                api.LogprobEntry(logprob=-1.0, token_id=6),
                api.LogprobEntry(logprob=-0.25, token_id=7),
            ],
            weight_version="4",
            weight_versions=[
                api.WeightVersionSpan(version="default", start=0, end=1),
                api.WeightVersionSpan(version="4", start=1, end=3),
            ],
        ),
    ).to_json_value()

    def handler(request: httpx.Request) -> httpx.Response:
        api.GenerateRequest.from_json_value(json.loads(request.content))
        return httpx.Response(200, json=response)

    async def go() -> Any:
        async with InferenceClient(
            ["http://sglang.test"], default_weight_version=3, transport=httpx.MockTransport(handler)
        ) as client:
            return await client.generate([1, 2], {"max_new_tokens": 3})

    result = asyncio.run(go())
    assert result.output_token_ids == [5, 6, 7]
    assert result.behaviour_logprobs == [-0.5, -1.0, -0.25]
    assert result.token_versions == [3, 4, 4]
    assert result.finish_reason == "stop" and result.text == "abc" and result.weight_version == 4


def test_every_turn_of_an_episode_is_a_plain_sglang_generate_request(
    api: ModuleType, model_dir: Path
) -> None:
    """Multi-turn episodes need nothing SGLang lacks: each turn is a /generate request
    on token ids (the conversation so far, never re-tokenized text) that also stops at
    the call's closing token."""
    from sluice.engines.env.episodes import EpisodeSpec, ToolResult, run_group

    close, observation = 9, [5, 6]
    spec = EpisodeSpec("", str(close), close, max_turns=4, max_total_tokens=40)
    engine = InferenceEngine(model_dir, max_batch_size=4, max_seq_len=64)
    engine.start()
    recorder = _Recorder(create_app(engine))

    async def tool(_call: str) -> ToolResult:
        return ToolResult("ok")

    async def drive() -> list:
        async with InferenceClient(
            ["http://sluice.test"], timeout_s=60, transport=recorder
        ) as client:

            def sample(j: int):
                async def turn(input_ids: list[int], max_new_tokens: int):
                    params = {
                        "max_new_tokens": max_new_tokens,
                        "stop_token_ids": [close],
                        "ignore_eos": True,
                        "sampling_seed": j * 1000 + len(input_ids),
                    }
                    return await client.generate(input_ids, params)

                return turn

            return await run_group(
                [3, 4], 6, spec, sample, tool, lambda _t: observation, lambda ids: str(ids)
            )

    try:
        episodes = asyncio.run(drive())
    finally:
        engine.shutdown()
    bodies = [sent for path, sent, _, _ in recorder.exchanges if path == "/generate"]
    assert len(bodies) == sum(len(e.turns) for e in episodes)
    assert any(e.tool_calls for e in episodes), "no episode called: pick another closing token"
    for body in bodies:
        decoded = api.GenerateRequest.from_json_value(body)
        assert set(body) <= set(api.GenerateRequest.__struct_fields__)
        assert "text" not in body and decoded.input_ids[:2] == [3, 4]
        assert decoded.sampling_params.stop_token_ids == [close]
    later_turns = [b["input_ids"] for b in bodies if len(b["input_ids"]) > 2]
    for episode in episodes:
        for t in range(1, len(episode.turns)):
            # Turn t sees the prompt and every token before it, observations included.
            seen = sum(r.generated_tokens + r.observation_tokens for r in episode.turns[:t])
            assert [3, 4, *episode.response_token_ids[:seen]] in later_turns


# ------------------------------------------------- weights from a trainer process


@pytest.fixture
def io_struct_fields() -> Callable[[str], set[str]]:
    """`_io_struct_fields`, skipping where SGLang is not installed."""
    if _sglang_root() is None:
        pytest.skip(
            "sglang is not installed; `pip install --no-deps sglang==0.5.23` enables this test"
        )
    return _io_struct_fields


@pytest.mark.parametrize(
    ("ours", "sglang_class"),
    [
        ("INIT_GROUP_FIELDS", "InitWeightsUpdateGroupReqInput"),
        ("DESTROY_GROUP_FIELDS", "DestroyWeightsUpdateGroupReqInput"),
        ("DISTRIBUTED_FIELDS", "UpdateWeightsFromDistributedReqInput"),
        ("TENSOR_FIELDS", "UpdateWeightsFromTensorReqInput"),
    ],
)
def test_weight_sync_routes_take_exactly_sglangs_fields(
    io_struct_fields: Callable[[str], set[str]], ours: str, sglang_class: str
) -> None:
    fields = getattr(protocol, ours)
    assert len(fields) == len(set(fields))
    assert set(fields) == io_struct_fields(sglang_class) | io_struct_fields("BaseReq")


@pytest.fixture(scope="module")
def weight_engine(model_dir: Path) -> InferenceEngine:
    """An engine never started: these requests are refused before any generation."""
    return InferenceEngine(model_dir, max_batch_size=1, max_seq_len=32)


def _post(
    engine: InferenceEngine,
    route: str,
    body: Any,
    client: tuple[str, int] = ("127.0.0.1", 123),
) -> httpx.Response:
    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(engine), client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://sluice.test") as http:
            return await http.post(route, json=body)

    return asyncio.run(post())


def _refusal(response: httpx.Response) -> str:
    """The message of a 400 in SGLang's weight-route shape: `{success: false, message}`."""
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"success", "message"} and body["success"] is False
    return body["message"]


def _evil_handles(marker: Path) -> str:
    """Base64 of a pickle that would run `touch marker` (os.system) as it loads."""
    return base64.b64encode(f"(lcos\nsystem\n(Vtouch {marker}\ntRa.".encode()).decode()


_GROUP = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
_ONE_TENSOR = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]]}


@pytest.mark.parametrize(
    "route",
    [
        protocol.INIT_WEIGHTS_UPDATE_GROUP,
        protocol.DESTROY_WEIGHTS_UPDATE_GROUP,
        protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED,
        protocol.UPDATE_WEIGHTS_FROM_TENSOR,
    ],
)
def test_an_unknown_field_on_a_weight_route_is_refused_as_sglangs_contract_does(
    weight_engine: InferenceEngine, route: str
) -> None:
    response = _post(weight_engine, route, {"group_nam": "typo"})
    assert response.status_code == 400
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)
    assert body["error"].startswith("unknown field `group_nam`, expected one of `")


def test_a_group_without_its_address_is_refused_naming_the_field(
    weight_engine: InferenceEngine,
) -> None:
    body = {k: v for k, v in _GROUP.items() if k != "master_address"}
    response = _post(weight_engine, protocol.INIT_WEIGHTS_UPDATE_GROUP, body)
    assert response.status_code == 400
    assert response.json() == {"error": "master_address is required"}


def test_tensor_lists_of_different_lengths_are_refused(weight_engine: InferenceEngine) -> None:
    body = {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [2]]}
    response = _post(weight_engine, protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED, body)
    assert response.status_code == 400
    assert "as long as each other, got 2, 1 and 2" in protocol.error_message(response.json())


def test_an_unknown_dtype_is_refused_before_any_collective(weight_engine: InferenceEngine) -> None:
    body = {**_ONE_TENSOR, "dtypes": ["complex64"]}
    response = _post(weight_engine, protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED, body)
    assert response.status_code == 400
    assert "dtype 'complex64' is not one of" in protocol.error_message(response.json())


@pytest.mark.parametrize("backend", [{"backend": "nccl"}, {}], ids=["nccl", "sglang-default"])
def test_a_cpu_server_refuses_an_nccl_group_in_one_line(
    weight_engine: InferenceEngine, backend: dict[str, str]
) -> None:
    # SGLang's default backend is nccl: a body that names none asks for it too.
    response = _post(weight_engine, protocol.INIT_WEIGHTS_UPDATE_GROUP, {**_GROUP, **backend})
    message = _refusal(response)
    assert "backend 'nccl' needs a GPU" in message and "\n" not in message


def test_receiving_on_a_group_that_does_not_exist_is_refused(
    weight_engine: InferenceEngine,
) -> None:
    body = {**_ONE_TENSOR, "group_name": "never_made", "weight_version": "1"}
    message = _refusal(_post(weight_engine, protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED, body))
    assert "weight group 'never_made' does not exist" in message
    assert weight_engine.weight_version == 0


def test_destroying_a_group_that_does_not_exist_answers_as_sglang_does(
    weight_engine: InferenceEngine,
) -> None:
    response = _post(weight_engine, protocol.DESTROY_WEIGHTS_UPDATE_GROUP, {})
    assert _refusal(response) == "The group to be destroyed does not exist."


def test_tensor_handles_from_another_host_are_refused_unread(
    weight_engine: InferenceEngine, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    body = {"serialized_named_tensors": [_evil_handles(marker)], "weight_version": "1"}
    response = _post(
        weight_engine, protocol.UPDATE_WEIGHTS_FROM_TENSOR, body, client=("203.0.113.5", 123)
    )
    assert response.status_code == 403
    assert "not from 203.0.113.5" in protocol.error_message(response.json())
    assert not marker.exists() and weight_engine.weight_version == 0


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (["QUJD", "QUJD"], "must hold one base64 string"),
        ([], "must hold one base64 string"),
        ([7], "must hold one base64 string"),
        (["not base64!"], "is not base64"),
    ],
    ids=["two", "none", "not-a-string", "not-base64"],
)
def test_tensor_handles_other_than_one_base64_entry_are_refused(
    weight_engine: InferenceEngine, entries: list[Any], message: str
) -> None:
    body = {"serialized_named_tensors": entries, "weight_version": "1"}
    response = _post(weight_engine, protocol.UPDATE_WEIGHTS_FROM_TENSOR, body)
    assert response.status_code == 400
    assert message in protocol.error_message(response.json())


def test_tensor_handles_naming_os_system_are_refused_and_nothing_runs(
    weight_engine: InferenceEngine, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    body = {"serialized_named_tensors": [_evil_handles(marker)], "weight_version": "1"}
    message = _refusal(_post(weight_engine, protocol.UPDATE_WEIGHTS_FROM_TENSOR, body))
    # Handles are a JSON document now: a pickle is never unpickled, whatever it names.
    assert "are not a sluice.tensor_handles/1 JSON document" in message and "\n" not in message
    assert not marker.exists() and weight_engine.weight_version == 0
