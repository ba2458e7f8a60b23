"""A verifier plugin cannot take the reward role down: one that kills its worker,
calls sys.exit() or hangs scores incorrect, alone: the other calls of its batch score
as they would have and the pool goes on; the deadline is per call, so a batch of
slow-but-legal calls all count."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from sluice.tasks.reward.role import VerifierPool

pytestmark = pytest.mark.integration
SPEC = "tests.integration.verifier_plugins:unruly"


@pytest.fixture
def pool():
    verifiers = VerifierPool(SPEC, workers=2, timeout_s=2.0, correct=1.0, incorrect=-1.0)
    yield verifiers
    verifiers.close()


@pytest.mark.parametrize("text", ["die", "exit", "hang"])
def test_a_misbehaving_call_scores_incorrect_and_the_next_batch_is_scored(pool, text) -> None:
    rows = [{"answer": "x"}] * 2
    first = pool.score(rows, [text, "ok"])
    assert first[0] == -1.0
    assert pool.score(rows, ["ok", "ok"]) == [1.0, 1.0]
    if text == "hang":
        assert pool.timeouts >= 1


def test_the_deadline_is_per_call_not_per_batch() -> None:
    pool = VerifierPool(SPEC, workers=1, timeout_s=2.0, correct=1.0, incorrect=-1.0)
    try:
        pool.score([{}], ["ok"])  # the worker is started
        assert pool.score([{}] * 6, ["slow"] * 6) == [1.0] * 6  # 3.6 s in all, 0.6 s each
        assert pool.timeouts == 0
    finally:
        pool.close()


@pytest.fixture
def one_worker():
    # The reward role's default: one worker, so every call of a batch queues behind the
    # one before it.
    verifiers = VerifierPool(SPEC, workers=1, timeout_s=2.0, correct=1.0, incorrect=-1.0)
    yield verifiers
    verifiers.close()
    assert multiprocessing.active_children() == []


def test_a_hung_call_times_out_alone_and_its_neighbours_score(one_worker) -> None:
    started = time.monotonic()
    scores = one_worker.score([{}] * 5, ["ok", "hang", "ok", "slow", "ok"])
    assert scores == [1.0, -1.0, 1.0, 1.0, 1.0]
    assert one_worker.timeouts == 1
    # One deadline, the kill and a fresh worker's start, not a deadline per queued call.
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("text", ["die", "segfault"])
def test_a_call_that_kills_its_worker_fails_alone_and_the_pool_goes_on(one_worker, text) -> None:
    assert one_worker.score([{}] * 4, ["ok", text, "ok", "ok"]) == [1.0, -1.0, 1.0, 1.0]
    assert one_worker.score([{}] * 2, ["ok", "ok"]) == [1.0, 1.0]
    assert one_worker.timeouts == 0
