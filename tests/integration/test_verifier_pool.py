"""A verifier plugin cannot take the reward role down: one that kills its worker,
calls sys.exit() or hangs scores incorrect and the pool is rebuilt for the next batch;
the deadline is per call, so a batch of slow-but-legal calls all count."""

from __future__ import annotations

import pytest

from sluice.tasks.reward import VerifierPool

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
