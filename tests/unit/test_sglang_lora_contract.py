"""Contract: a LoRA run's servers are driven through SGLang's own LoRA API.

The rollout loads each adapter version with ``/load_lora_adapter``, names it in every
``/generate`` request's ``lora_path`` and unloads old ones with ``/unload_lora_adapter``;
Sluice's server answers the same routes. The bodies exchanged with Sluice's server are
checked against SGLang 0.5.23's request types (the generated API types for
``/generate``, the field names of ``io_struct.py`` for the LoRA routes), and the launch
flags against the names SGLang's server arguments declare.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.rl.lora import LoraSettings, apply_lora, save_adapter
from sluice.infra.docker_servers import ServerSpec
from sluice.infra.serving.client import InferenceClient, InferenceServerError
from sluice.infra.serving.server import create_app
from tests.unit.test_sglang_contract import (
    _io_struct_fields,
    _load_api_types,
    _Recorder,
    _sglang_root,
    model_dir,  # noqa: F401 - the fixture
)


@pytest.fixture(scope="module")
def api() -> ModuleType:
    return _load_api_types()


def _adapter(base_dir: Path, out: Path) -> Path:
    """A LoRA adapter for `base_dir` whose B is random (a fresh one's is 0)."""
    from transformers import AutoModelForCausalLM

    peft_model = apply_lora(
        AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True),
        LoraSettings(rank=2, alpha=4, target_modules=("q_proj", "v_proj")),
    )
    generator = torch_generator()
    for name, parameter in peft_model.named_parameters():
        if ".lora_B." in name:  # a fresh adapter's B is 0: make it change something
            parameter.data.copy_(
                0.5 * parameter.new_empty(parameter.shape).normal_(generator=generator)
            )
    save_adapter(peft_model, out)
    return out


def torch_generator() -> Any:

    return torch.Generator().manual_seed(0)


@pytest.fixture(scope="module")
def lora_exchanges(
    model_dir: Path,  # noqa: F811 - the fixture imported above
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[list[tuple[str, Any, int, Any]], dict[str, Any]]:
    adapter = _adapter(model_dir, tmp_path_factory.mktemp("adapter") / "v1")
    engine = InferenceEngine(model_dir, max_batch_size=4, max_seq_len=64)
    engine.start()
    recorder = _Recorder(create_app(engine))
    seen: dict[str, Any] = {}

    async def drive() -> None:
        async with InferenceClient(
            ["http://sluice.test"], timeout_s=60, transport=recorder
        ) as client:
            seen["base"] = await client.generate([3, 4], {"max_new_tokens": 4, "sampling_seed": 1})
            await client.load_lora_adapter(str(adapter), 1)
            client.use_adapter(1)
            seen["adapted"] = await client.generate(
                [3, 4], {"max_new_tokens": 4, "sampling_seed": 1}
            )
            seen["group"] = await client.generate_group([5], 2, {"max_new_tokens": 3})
            await client.unload_lora_adapter(1)
            try:
                await client.generate([3], {"max_new_tokens": 2})
            except InferenceServerError as exc:
                seen["refused"] = exc
            await client.unload_lora_adapter(1)  # not loaded any more: tolerated

    try:
        asyncio.run(drive())
    finally:
        engine.shutdown()
    return recorder.exchanges, seen


def test_lora_routes_send_and_answer_only_sglang_fields(lora_exchanges: Any) -> None:
    exchanges, _ = lora_exchanges
    base = _io_struct_fields("BaseReq")
    allowed = {
        "/load_lora_adapter": _io_struct_fields("LoadLoRAAdapterReqInput") | base,
        "/unload_lora_adapter": _io_struct_fields("UnloadLoRAAdapterReqInput") | base,
    }
    answer_fields = _io_struct_fields("LoRAUpdateOutput") | base
    routes = [path for path, *_ in exchanges if path in allowed]
    assert routes == ["/load_lora_adapter", "/unload_lora_adapter", "/unload_lora_adapter"]
    for path, sent, _status, received in exchanges:
        if path not in allowed:
            continue
        assert set(sent) <= allowed[path] and sent["lora_name"] == "1"
        assert set(received) <= answer_fields
    (load,) = [e for e in exchanges if e[0] == "/load_lora_adapter"]
    assert load[1]["lora_path"].endswith("v1") and load[2] == 200
    assert load[3]["success"] is True and load[3]["loaded_adapters"] == {"1": load[1]["lora_path"]}
    unloads = [e for e in exchanges if e[0] == "/unload_lora_adapter"]
    assert [e[2] for e in unloads] == [200, 400]
    assert unloads[1][3]["success"] is False and "is not loaded" in unloads[1][3]["error_message"]


def test_requests_name_their_adapter_as_sglang_decodes_it(
    api: ModuleType, lora_exchanges: Any
) -> None:
    exchanges, seen = lora_exchanges
    bodies = [sent for path, sent, _, _ in exchanges if path == "/generate"]
    assert len(bodies) == 4
    decoded = [api.GenerateRequest.from_json_value(body) for body in bodies]
    assert [d.lora_path for d in decoded] == [None, "1", "1", "1"]
    # Served with the adapter: every token carries its version, and it changed the model.
    assert seen["adapted"].token_versions == [1] * len(seen["adapted"].output_token_ids)
    assert all(set(r.token_versions) == {1} for r in seen["group"])
    assert seen["base"].token_versions == [0] * len(seen["base"].output_token_ids)
    assert seen["adapted"].behaviour_logprobs != seen["base"].behaviour_logprobs


def test_a_request_naming_an_unloaded_adapter_is_refused(lora_exchanges: Any) -> None:
    exchanges, seen = lora_exchanges
    refused = seen["refused"]
    assert refused.status_code == 400 and "LoRA adapter '1' is not loaded" in str(refused)
    assert exchanges[-2][0] == "/generate" and exchanges[-2][2] == 400


def test_sglang_is_launched_with_room_for_the_runs_adapters(api: ModuleType) -> None:
    spec = ServerSpec(
        engine="sglang",
        image="sglang:test",
        model_dir="/m",
        port=30000,
        weight_version=0,
        mounts=(),
        lora_rank=16,
        lora_target_modules=("q_proj", "v_proj"),
    )
    command = spec.command()
    start = command.index("--enable-lora")
    assert command[start:] == [
        "--enable-lora",
        "--max-lora-rank", "16",
        "--lora-target-modules", "q_proj", "v_proj",
        "--max-loras-per-batch", "2",
        "--max-loaded-loras", "2",
    ]  # fmt: skip
    root = _sglang_root()
    assert root is not None
    tree = ast.parse((root / "srt" / "arg_groups" / "field_order.py").read_text())
    declared = {
        node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
    }  # fmt: skip
    flags = [arg[2:].replace("-", "_") for arg in command if arg.startswith("--")]
    assert set(flags) <= declared, set(flags) - declared
    without = ServerSpec(**{**spec.__dict__, "lora_rank": 0}).command()
    assert "--enable-lora" not in without
