"""A batch of prompt groups sent in one request samples what the synchronous loop samples.

At eta = 0 (`mode: on_policy`) the rollout role sends the B groups of a batch as one
/generate call, each group with n = G and its seed `sample_seed(seed, n, 0)`; the
synchronous loop hands the same B x G requests, seeded `sample_seed(seed, n, j)`, to
an in-process engine. Through the real server app and client (no sockets) the tokens
and behaviour log-probs must come out bit for bit the same, for two batches under two
weight versions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.types import GenerationRequest, SamplingParams
from sluice.engines.rl.groups import sample_seed
from sluice.infra.serving.client import InferenceClient
from sluice.infra.serving.server import create_app
from sluice.tasks.rollout.role import request_groups

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEED, G = 11, 4
PROMPTS = {0: [5, 6, 7], 1: [8, 9], 2: [10, 11, 12, 13], 3: [14]}  # group index -> prompt
SAMPLING = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.95, "top_k": -1}


def engine_of(model_dir: Path) -> InferenceEngine:
    return InferenceEngine(model_dir, max_batch_size=8, max_seq_len=64, seed=SEED)


def sync_batch(engine: InferenceEngine, groups: list[int]) -> list[tuple[list[int], list[float]]]:
    """What tasks/train/sync.py's step does: B x G seeded requests, in (group, sample) order."""
    requests = [
        GenerationRequest(PROMPTS[g], SamplingParams(**SAMPLING, seed=sample_seed(SEED, g, j)))
        for g in groups
        for j in range(G)
    ]
    return [(o.output_token_ids, o.behaviour_logprobs) for o in engine.generate(requests)]


def test_one_request_per_batch_samples_the_sync_loops_tokens_and_logprobs(
    random_model_dir: Callable[..., Path],
) -> None:
    v0, v1 = random_model_dir(seed=0), random_model_dir(seed=1)
    in_process = engine_of(v0)
    expected = [sync_batch(in_process, [0, 1])]
    in_process.update_weights_from_disk(v1, 1)
    expected.append(sync_batch(in_process, [2, 3]))

    served = engine_of(v0)
    served.start()

    async def drive() -> list[list[tuple[list[int], list[float]]]]:
        transport = httpx.ASGITransport(app=create_app(served))
        async with InferenceClient(["http://sluice.test"], transport=transport) as client:
            batches = []
            for version, groups in enumerate(([0, 1], [2, 3])):
                if version:
                    await client.update_weights_from_disk(str(v1), version)
                answers = await client.generate_groups(
                    [PROMPTS[g] for g in groups],
                    G,
                    [{**SAMPLING, "sampling_seed": sample_seed(SEED, g, 0)} for g in groups],
                )
                assert [len(group) for group in answers] == [G] * len(groups)
                batches.append(
                    [
                        (list(a.output_token_ids), list(a.behaviour_logprobs))
                        for group in answers
                        for a in group
                    ]
                )
            return batches

    try:
        got = asyncio.run(drive())
    finally:
        served.shutdown()
    assert got == expected
    # Not vacuous: the samples of a group differ (each has its own seed).
    assert len({tuple(tokens) for tokens, _ in got[0][:G]}) > 1


def test_admitted_groups_go_out_one_request_each_or_one_per_server() -> None:
    admitted = [(n, 100 + n) for n in range(5)]  # (issue number, gate ticket)
    assert request_groups(admitted, one_request=False, servers=1) == [[g] for g in admitted]
    assert request_groups(admitted, one_request=True, servers=1) == [admitted]
    assert request_groups(admitted, one_request=True, servers=2) == [admitted[:3], admitted[3:]]
    assert request_groups(admitted[:1], one_request=True, servers=4) == [admitted[:1]]
    assert request_groups([], one_request=True, servers=2) == []
