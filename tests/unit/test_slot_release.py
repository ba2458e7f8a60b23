"""Closing the gaps finished sequences leave in the KV slots (``SlotBatch.release``)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.types import GenerationRequest, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(random_model_dir: Callable[..., Path]) -> Path:
    return random_model_dir(seed=0)


def _fill(engine: InferenceEngine, prompt_lengths: list[int], rng: random.Random) -> None:
    for i, n in enumerate(prompt_lengths):
        prompt = [rng.randrange(3, 40) for _ in range(n)]
        params = SamplingParams(max_new_tokens=80, ignore_eos=True, seed=i)
        engine.submit(GenerationRequest(prompt, params))
    engine.step()  # admits every prompt and decodes once


def _kv_by_request(engine: InferenceEngine) -> dict[str, list[torch.Tensor]]:
    batch = engine._batch
    out = {}
    for slot, seq in enumerate(batch.running):
        keys, values = batch.cache.snapshot(slot, seq.num_tokens - 1)
        out[seq.request_id] = keys + values
    return out


@pytest.mark.parametrize(
    "prompt_range",
    [(20, 30), (2, 60)],
    ids=["similar lengths: gaps filled from the tail", "spread lengths: survivors shift up"],
)
def test_release_keeps_every_survivors_kv_and_frees_exactly_the_finished_slots(
    model_dir: Path, prompt_range: tuple[int, int]
) -> None:
    rng = random.Random(sum(prompt_range))
    for trial in range(6):
        engine = InferenceEngine(model_dir, max_batch_size=24, max_seq_len=96, seed=0)
        lengths = [rng.randint(*prompt_range) for _ in range(24)]
        # Longest first, as the scheduler admits a recompute: lengths fall slot by slot.
        _fill(engine, sorted(lengths, reverse=True), rng)
        batch = engine._batch
        before = _kv_by_request(engine)
        leaving = rng.sample(batch.running, rng.randint(1, 12))
        expected = [s.request_id for s in batch.running if s not in leaving]

        batch.release(leaving)

        assert sorted(s.request_id for s in batch.running) == sorted(expected), trial
        after = _kv_by_request(engine)
        for request_id in expected:
            for got, want in zip(after[request_id], before[request_id], strict=True):
                assert torch.equal(got, want), (trial, request_id)
        kv_lengths = [s.num_tokens for s in batch.running]
        if 2 * min(kv_lengths) < max(kv_lengths):
            # Spread lengths keep admission order, which decode attention buckets by.
            assert kv_lengths == sorted(kv_lengths, reverse=True), trial
        engine.shutdown()


def test_release_then_decode_matches_the_uninterrupted_outputs(model_dir: Path) -> None:
    """Sequences that finish at random steps leave the others' tokens unchanged."""
    rng = random.Random(3)
    requests = [
        GenerationRequest(
            [rng.randrange(3, 40) for _ in range(rng.randint(18, 26))],
            SamplingParams(max_new_tokens=rng.randint(2, 20), ignore_eos=True, seed=i),
        )
        for i in range(16)
    ]
    together = InferenceEngine(model_dir, max_batch_size=16, max_seq_len=96, seed=0)
    alone = InferenceEngine(model_dir, max_batch_size=1, max_seq_len=96, seed=0)
    for request, got in zip(requests, together.generate(requests), strict=True):
        want = alone.generate([request])[0]
        assert got.output_token_ids == want.output_token_ids
        assert got.behaviour_logprobs == pytest.approx(want.behaviour_logprobs, abs=1e-5)
