"""The engine's measured step costs: the sums a planner fits, and what a server reports."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.profile import StepProfile, bucket_of
from sluice.engines.inference.types import GenerationRequest, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_buckets_are_powers_of_two_holding_their_upper_bound() -> None:
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


def test_decode_sums_are_those_of_the_least_squares_fit() -> None:
    profile = StepProfile()
    profile.add_decode(2, 10, 0.5)
    profile.add_decode(4, 30, 1.5)
    # x = (1, 2, 10) and (1, 4, 30): Σx xᵀ row by row, Σ x t = 0.5 x1 + 1.5 x2.
    assert profile.xx == [[2, 6, 40], [6, 20, 140], [40, 140, 1000]]
    assert profile.xt == [2.0, 7.0, 50.0]
    assert profile.tt == pytest.approx(0.25 + 2.25)
    assert profile.by_rows == {2: [1, 0.5, 2], 4: [1, 1.5, 4]}
    assert profile.decode_steps == 2


def test_merge_adds_and_a_dict_round_trips() -> None:
    a, b = StepProfile(), StepProfile()
    a.add_decode(1, 5, 0.1)
    a.add_prefill(7, 0.07)
    b.add_decode(3, 9, 0.3)
    b.add_prefill(3, 0.02)
    both = StepProfile.from_dict(a.merged(b).as_dict())
    assert both.decode_steps == 2
    assert both.xt[0] == pytest.approx(0.4)
    assert both.by_rows == {1: [1, 0.1, 1], 4: [1, 0.3, 3]}
    assert (both.prefill_tokens, both.prefill_calls) == (10, 2)
    assert both.prefill_s == pytest.approx(0.09)


def test_a_malformed_profile_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="not a step profile"):
        StepProfile.from_dict({"xx": [[1]], "xt": [0.0]})
    with pytest.raises(ValueError, match="xx must be 3x3"):
        StepProfile.from_dict({**StepProfile().as_dict(), "xx": [[0, 0], [0, 0]]})


def test_engine_profiles_every_decode_step_and_prefilled_token(
    random_model_dir: Callable[..., Path],
) -> None:
    engine = InferenceEngine(random_model_dir(seed=0), max_batch_size=4, max_seq_len=64, seed=0)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    lengths = [3, 6, 9]
    requests = [
        GenerationRequest(p, SamplingParams(max_new_tokens=n, ignore_eos=True, seed=i))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    engine.generate(requests)
    profile = engine.profile
    assert profile.decode_steps == engine.decode_forwards
    assert profile.prefill_tokens == engine.prefilled_tokens == sum(map(len, prompts))
    # Rows per step: the first token of each comes from the prefill, then 3 rows decode
    # until the 3-token one is done (2 steps), 2 rows until the 6-token one (3 more),
    # 1 row for the last 3: rows sum to 3*2 + 2*3 + 1*3 = 15, one per sampled token
    # after the first.
    assert profile.xx[0][1] == sum(lengths) - len(lengths) == 15
    assert all(t > 0 for t in profile.xt)
    assert sum(cell[0] for cell in profile.by_rows.values()) == profile.decode_steps
