"""Multi-turn episodes on the real inference server: each turn is an ordinary /generate
call on token ids, turns of concurrent episodes batch on one engine, and a weight update
that lands mid-episode leaves every token with the version that generated it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sluice.engines.env.episodes import EpisodeSpec, ToolResult, run_group
from sluice.engines.inference.engine import InferenceEngine
from sluice.infra.serving.client import InferenceClient
from sluice.infra.serving.server import ServerThread, create_app

pytestmark = pytest.mark.integration

CLOSE = 7  # the call's closing token; a random 40-token model samples it often enough
OBSERVATION = [5, 6, 5]


@pytest.fixture(scope="module")
def server(
    one_torch_thread: None, random_model_dir: Callable[..., Path]
) -> Iterator[tuple[str, InferenceEngine, Path]]:
    v0 = random_model_dir(seed=0, max_position_embeddings=512)
    v1 = random_model_dir(seed=1, max_position_embeddings=512)
    engine = InferenceEngine(v0, max_batch_size=8, max_seq_len=400, seed=0)
    thread = ServerThread(create_app(engine, shutdown_engine_on_exit=True))
    url = thread.start()
    yield url, engine, v1
    thread.stop()


def test_episodes_keep_per_token_versions_across_a_weight_update_between_turns(server) -> None:
    url, engine, v1 = server
    spec = EpisodeSpec(
        call_open="",
        call_close=str(CLOSE),
        close_token_id=CLOSE,
        max_turns=6,
        max_total_tokens=120,
        max_new_tokens_per_turn=30,
    )
    first_call = asyncio.Event()

    async def tool(call: str) -> ToolResult:
        first_call.set()
        await asyncio.sleep(0.05)  # the update lands while episodes wait on their tools
        return ToolResult("ok")

    async def go() -> tuple[list, int]:
        async with InferenceClient([url], timeout_s=120) as client:

            def sample(j: int):
                async def turn(input_ids: list[int], max_new_tokens: int):
                    params = {
                        "max_new_tokens": max_new_tokens,
                        "stop_token_ids": [CLOSE],
                        "ignore_eos": True,
                        "sampling_seed": 100 * j + len(input_ids),
                    }
                    return await client.generate(input_ids, params)

                return turn

            async def update() -> int:
                await first_call.wait()
                version = engine.weight_version + 1
                await client.pause("retract")
                await client.update_weights_from_disk(str(v1), version)
                await client.continue_()
                return version

            updater = asyncio.create_task(update())
            episodes = await run_group(
                [1, 2, 3],
                8,
                spec,
                sample,
                tool,
                lambda _text: list(OBSERVATION),
                lambda ids: " ".join(map(str, ids)),
            )
            return episodes, await updater

    episodes, new_version = asyncio.run(go())
    called = [e for e in episodes if e.tool_calls]
    assert called, "no episode called its tool: pick another closing token"
    for episode in episodes:
        n = len(episode.response_token_ids)
        assert len(episode.behaviour_logprobs) == len(episode.token_versions) == n
        assert len(episode.loss_mask) == n <= spec.max_total_tokens
        assert episode.token_versions == sorted(episode.token_versions)  # never backwards
        observed = [t for t in range(n) if episode.loss_mask[t] == 0]
        assert len(observed) == len(OBSERVATION) * episode.tool_calls
        assert all(episode.behaviour_logprobs[t] == 0.0 for t in observed)
        assert all(episode.response_token_ids[t] in OBSERVATION for t in observed)
        generated = [t for t in range(n) if episode.loss_mask[t] == 1]
        assert all(episode.behaviour_logprobs[t] < 0.0 for t in generated)
        for t in observed:  # an observation follows the call's closing token
            assert episode.loss_mask[t - 1] == 0 or episode.response_token_ids[t - 1] == CLOSE
    spanning = [e for e in called if len(set(e.token_versions)) > 1]
    assert spanning, "no episode spans the update"
    assert all(set(e.token_versions) <= {new_version - 1, new_version} for e in episodes)
