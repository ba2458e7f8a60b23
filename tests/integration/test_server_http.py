"""The SGLang-compatible HTTP server driven by the async client over real loopback sockets."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from transformers import LlamaForCausalLM

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.profile import StepProfile
from sluice.engines.inference.types import GenerationRequest, SamplingParams
from sluice.infra.serving.client import (
    InferenceClient,
    InferenceServerError,
    InferenceServerUnreachableError,
)
from sluice.infra.serving.server import ServerThread, create_app

pytestmark = pytest.mark.integration

VOCAB = 40  # the suite's small Llama (tests/conftest.py small_llama_config)


@dataclass
class Served:
    url: str
    engine: InferenceEngine
    v0: Path
    v1: Path


@pytest.fixture(scope="module")
def served(one_torch_thread: None, random_model_dir: Callable[..., Path]) -> Iterator[Served]:
    # Room for 400-token sequences.
    v0 = random_model_dir(seed=0, max_position_embeddings=512)
    v1 = random_model_dir(seed=1, max_position_embeddings=512)
    engine = InferenceEngine(v0, max_batch_size=4, max_seq_len=400, seed=0)
    server = ServerThread(create_app(engine, shutdown_engine_on_exit=True))
    url = server.start()
    yield Served(url, engine, v0, v1)
    server.stop()


def _run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def _fresh_logprobs(model_dir: Path, prompt: list[int], output: list[int]) -> list[float]:
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_generate_returns_tokens_logprobs_and_versions(served: Served) -> None:
    async def go() -> None:
        async with InferenceClient([served.url], timeout_s=60) as client:
            result = await client.generate([5, 6, 7], {"max_new_tokens": 12, "temperature": 0.0})
            assert (
                len(result.output_token_ids)
                == len(result.behaviour_logprobs)
                == len(result.token_versions)
            )
            assert result.prompt_tokens == 3 and result.server_url == served.url
            assert set(result.token_versions) == {served.engine.weight_version}
            assert result.finish_reason in ("stop", "length")
            direct = InferenceEngine(served.v0, max_batch_size=1, max_seq_len=400).generate(
                [GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=12, temperature=0.0))]
            )[0]
            assert result.output_token_ids == direct.output_token_ids
            assert result.behaviour_logprobs == pytest.approx(direct.behaviour_logprobs, abs=1e-5)

    if served.engine.weight_version != 0:
        pytest.skip("weights were already updated by an earlier test in this module")
    _run(go())


def test_batched_and_parallel_sampling_follow_sglang_shapes(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=60) as http:
        batch = http.post(
            "/generate",
            json={
                "input_ids": [[3, 4], [5], [6, 7, 8]],
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "sampling_seed": 1},
                "return_logprob": True,
                "rid": ["a", "b", "c"],
            },
        )
        assert batch.status_code == 200
        body = batch.json()
        assert [r["meta_info"]["id"] for r in body] == ["a", "b", "c"]
        assert [r["meta_info"]["prompt_tokens"] for r in body] == [2, 1, 3]
        for r in body:
            assert len(r["output_ids"]) == 4 and r["meta_info"]["finish_reason"] == {
                "type": "length",
                "length": 4,
            }
            assert [e[1] for e in r["meta_info"]["output_token_logprobs"]] == r["output_ids"]
            assert r["meta_info"]["weight_versions"][0]["start"] == 0
            assert r["meta_info"]["weight_versions"][-1]["end"] == 4
        parallel = http.post(
            "/generate",
            json={
                "input_ids": [9, 10],
                "sampling_params": {"max_new_tokens": 6, "n": 3, "ignore_eos": True},
            },
        ).json()
        assert isinstance(parallel, list) and len(parallel) == 3
        assert (
            "output_token_logprobs" not in parallel[0]["meta_info"]
        )  # return_logprob defaults to off
        assert len({tuple(r["output_ids"]) for r in parallel}) > 1


def test_generate_group_samples_distinct_responses(served: Served) -> None:
    async def go() -> list:
        async with InferenceClient([served.url], timeout_s=60) as client:
            return await client.generate_group(
                [11, 12], 4, {"max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 7}
            )

    group = _run(go())
    assert len(group) == 4 and len({tuple(r.output_token_ids) for r in group}) == 4
    again = _run(go())
    # Seeded: reproducible.
    assert [r.output_token_ids for r in again] == [r.output_token_ids for r in group]


def test_pause_update_continue_switches_versions_mid_response(served: Served) -> None:
    engine = served.engine
    new_version = engine.weight_version + 1
    new_dir = served.v1 if new_version % 2 else served.v0

    async def go() -> tuple:
        async with InferenceClient([served.url], timeout_s=120) as client:
            task = asyncio.create_task(
                client.generate(
                    [3, 14], {"max_new_tokens": 300, "ignore_eos": True, "sampling_seed": 3}
                )
            )
            start = engine.generated_tokens
            while engine.generated_tokens < start + 20 and not task.done():
                await asyncio.sleep(0.002)
            await client.pause("retract")
            paused = await client.update_weights_from_disk(str(new_dir), new_version)
            await client.continue_()
            result = await task
            info = await client.model_info()
            states = await client.server_states()
            return result, paused, info, states

    result, paused, info, states = _run(go())
    assert paused == {served.url: 1}
    # The server reports its measured step costs, the 300 decode steps included, and
    # its peak memory (at least the weights it holds).
    assert StepProfile.from_dict(states[served.url]["step_profile"]).decode_steps >= 299
    assert states[served.url]["peak_rss_mb"] > 1
    assert info[served.url]["weight_version"] == str(new_version)
    assert info[served.url]["model_path"] == str(new_dir)
    switch = result.token_versions.index(new_version)
    assert 0 < switch < 300
    assert result.token_versions == [new_version - 1] * switch + [new_version] * (300 - switch)
    fresh = _fresh_logprobs(new_dir, [3, 14], result.output_token_ids)
    assert result.behaviour_logprobs[switch:] == pytest.approx(fresh[switch:], abs=1e-4)


def test_a_weight_update_gets_through_while_more_than_100_requests_are_paused(
    served: Served,
) -> None:
    # A rollout keeps ~128 /generate calls open; a paused server holds them all. The
    # pause → update → continue calls must not queue behind them for a connection.
    engine = served.engine
    new_version = engine.weight_version + 1
    new_dir = served.v1 if new_version % 2 else served.v0

    async def go() -> tuple:
        async with InferenceClient([served.url], timeout_s=60) as client:
            await client.pause("retract")
            tasks = [
                asyncio.create_task(
                    client.generate([3, 5 + i % 7], {"max_new_tokens": 2, "sampling_seed": i})
                )
                for i in range(130)
            ]
            while engine.num_waiting + engine.num_running < 130:
                await asyncio.sleep(0.01)
            await asyncio.wait_for(
                client.update_weights_from_disk(str(new_dir), new_version), timeout=20
            )
            await asyncio.wait_for(client.continue_(), timeout=20)
            return await asyncio.gather(*tasks)

    results = _run(go())
    assert len(results) == 130
    assert all(r.token_versions == [new_version] * len(r.output_token_ids) for r in results)


def test_pause_abort_returns_partial_response(served: Served) -> None:
    engine = served.engine

    async def go():
        async with InferenceClient([served.url], timeout_s=60) as client:
            task = asyncio.create_task(
                client.generate([4], {"max_new_tokens": 350, "ignore_eos": True})
            )
            start = engine.generated_tokens
            while engine.generated_tokens < start + 5 and not task.done():
                await asyncio.sleep(0.002)
            await client.pause("abort")
            result = await task
            await client.continue_()
            after = await client.generate([4], {"max_new_tokens": 3, "ignore_eos": True})
            return result, after

    result, after = _run(go())
    assert result.finish_reason == "abort" and 0 < len(result.output_token_ids) < 350
    assert len(result.token_versions) == len(result.output_token_ids)
    assert after.finish_reason == "length" and len(after.output_token_ids) == 3


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (
            {"input_ids": [3], "sampling_params": {"max_new_tokens": 2, "temperatur": 1.0}},
            400,
            "temperatur",
        ),
        ({"input_ids": [3], "sampling_params": {"regex": "a+"}}, 400, "regex"),
        ({"input_ids": [3], "sampling_params": {"temperature": -1}}, 400, "temperature"),
        ({"input_ids": [3], "sampling_params": {"max_new_tokens": "many"}}, 400, "max_new_tokens"),
        ({"input_ids": [3, 4000]}, 400, "vocabulary"),
        ({"input_ids": []}, 400, "at least one token"),
        ({"text": "hello"}, 400, "tokenizer"),
        ({"sampling_params": {}}, 400, "input_ids"),
        ({"input_ids": [3], "stream": True}, 400, "stream"),
        ([1, 2, 3], 400, "JSON object"),
    ],
)
def test_bad_generate_requests_get_400_naming_the_problem(
    served: Served, body: object, status: int, needle: str
) -> None:
    with httpx.Client(base_url=served.url, timeout=30) as http:
        response = http.post("/generate", json=body)
        assert response.status_code == status
        assert needle in response.text
        assert http.get("/health").status_code == 200


def test_malformed_bodies_and_bad_control_requests_get_400(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=30) as http:
        response = http.post(
            "/generate", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert response.status_code == 400 and "not valid JSON" in response.text
        assert http.post("/pause_generation", json={"mode": "sideways"}).status_code == 400
        update = http.post(
            "/update_weights_from_disk", json={"model_path": "/no/such/dir", "weight_version": "9"}
        )
        assert update.status_code == 400 and update.json()["success"] is False
        assert "does not exist" in update.json()["message"]
        assert (
            http.post(
                "/update_weights_from_disk",
                json={"model_path": str(served.v0), "weight_version": "v9"},
            ).status_code
            == 400
        )
        assert http.get("/health").status_code == 200
    assert served.engine.weight_version != 9


def test_client_errors_name_the_server(served: Served) -> None:
    async def go() -> None:
        async with InferenceClient([served.url], timeout_s=30) as client:
            with pytest.raises(InferenceServerError, match="temperatur") as info:
                await client.generate([3], {"temperatur": 0.5})
            assert info.value.status_code == 400 and info.value.url == served.url
            with pytest.raises(InferenceServerError, match="/no/such/dir"):
                await client.update_weights_from_disk("/no/such/dir", 5)

    _run(go())


def test_unreachable_server_raises_a_clear_error() -> None:
    dead = f"http://127.0.0.1:{_free_port()}"

    async def go() -> None:
        async with InferenceClient([dead], timeout_s=5) as client:
            with pytest.raises(InferenceServerUnreachableError, match=dead.replace(".", r"\.")):
                await client.generate([3], {"max_new_tokens": 2})
            assert await client.health() == {dead: False}

    _run(go())


def test_a_client_moved_to_a_restarted_servers_new_url_serves_from_there(
    served: Served,
) -> None:
    """A server started again elsewhere (a Ray actor on another node): the rollout role
    points its client at the new URL; the old one is no longer a server of the client."""
    dead = f"http://127.0.0.1:{_free_port()}"

    async def go() -> None:
        async with InferenceClient([dead], timeout_s=30) as client:
            with pytest.raises(InferenceServerUnreachableError):
                await client.generate([3], {"max_new_tokens": 2})
            client.set_urls([served.url + "/"])
            assert await client.health() == {served.url: True}
            result = await client.generate([3], {"max_new_tokens": 2})
            assert result.server_url == served.url
            with pytest.raises(ValueError, match="not servers of this client"):
                await client.update_weights_from_disk(str(served.v0), 0, urls=[dead])
            with pytest.raises(ValueError, match="at least one base URL"):
                client.set_urls([])

    _run(go())


def test_requests_spread_over_servers(served: Served, tmp_path: Path) -> None:
    second_engine = InferenceEngine(served.v0, max_batch_size=4, max_seq_len=400)
    second = ServerThread(create_app(second_engine, shutdown_engine_on_exit=True))
    second_url = second.start()
    try:

        async def go() -> list:
            async with InferenceClient([served.url, second_url], timeout_s=60) as client:
                assert await client.health() == {served.url: True, second_url: True}
                return list(
                    await asyncio.gather(
                        *(
                            client.generate([3 + i], {"max_new_tokens": 20, "ignore_eos": True})
                            for i in range(8)
                        )
                    )
                )

        results = _run(go())
    finally:
        second.stop()
    by_server = {r.server_url for r in results}
    assert by_server == {served.url, second_url}
    assert sum(r.server_url == served.url for r in results) == 4


def test_cli_module_serves(served: Served, tmp_path: Path) -> None:
    """``python -m sluice.infra.serving.server`` comes up and answers /model_info."""
    import subprocess
    import sys

    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sluice.infra.serving.server",
            "--model",
            str(served.v0),
            "--port",
            str(port),
            "--max-batch-size",
            "2",
            "--max-seq-len",
            "64",
            "--num-threads",
            "1",
            "--log-level",
            "warning",
        ],
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                info = httpx.get(f"http://127.0.0.1:{port}/model_info", timeout=2).json()
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.2)
        assert info["weight_version"] == "0" and info["is_generation"] is True
        out = httpx.post(
            f"http://127.0.0.1:{port}/generate",
            json={"input_ids": [3], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
            timeout=30,
        ).json()
        assert len(out["output_ids"]) == 3
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a server that ignores SIGTERM is not left behind
            process.kill()
            process.wait()


def test_text_prompts_use_the_model_directorys_tokenizer(served: Served, tmp_path: Path) -> None:
    import shutil

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sluice.infra.serving.server import load_tokenizer

    model_dir = tmp_path / "with_tokenizer"
    shutil.copytree(served.v0, model_dir)
    chars = ["<pad>", "<eos>", "<unk>", *"abcdefghijklmnopqrstuvwxyz "]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    ).save_pretrained(model_dir)
    tokenizer = load_tokenizer(str(model_dir))
    engine = InferenceEngine(model_dir, max_batch_size=2, max_seq_len=64)
    server = ServerThread(create_app(engine, tokenizer=tokenizer, shutdown_engine_on_exit=True))
    url = server.start()
    try:
        body = {"text": "hi there", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
        answer = httpx.post(f"{url}/generate", json=body, timeout=30).json()
    finally:
        server.stop()
    assert answer["meta_info"]["prompt_tokens"] == len("hi there")
    assert answer["text"] == tokenizer.decode(answer["output_ids"], skip_special_tokens=True)


def test_server_watchdog_stops_the_server_when_its_parent_is_gone() -> None:
    """A rollout role killed with SIGKILL cannot stop its server: the server stops itself."""
    script = (
        "import sys, time\n"
        "from sluice.infra.serving.server import exit_with_parent\n"
        "exit_with_parent(int(sys.argv[1]), poll_s=0.05)\n"
        "time.sleep(60)\n"
    )
    # Watching its real parent (this test), the process keeps running...
    alive = subprocess.Popen([sys.executable, "-c", script, str(os.getpid())])
    # ...watching a process that is not its parent, it stops itself with SIGTERM.
    orphan = subprocess.Popen([sys.executable, "-c", script, "1"])
    try:
        assert orphan.wait(timeout=30) == -signal.SIGTERM
        assert alive.poll() is None
    finally:
        for proc in (alive, orphan):
            proc.kill()
            proc.wait()
