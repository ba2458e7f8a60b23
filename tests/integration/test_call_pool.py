"""The worker pool under the verifier and tool pools (tasks/call_pool.py), on real
processes: waits are bounded even when no worker ever takes a call."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest

from sluice.tasks.call_pool import CallPool
from tests.integration.verifier_plugins import never_ready

pytestmark = pytest.mark.integration


@pytest.fixture
def stuck_pool():
    pool = CallPool(1, 1.0, never_ready)
    pool.stall_s = 1.5  # not the two minutes a real worker may take to start
    yield pool
    pool.close()
    assert multiprocessing.active_children() == []  # the replaced pool's worker too


def test_calls_come_back_cancelled_when_no_worker_ever_starts(stuck_pool) -> None:
    started = time.monotonic()
    futures = stuck_pool.run_all([("a",), ("b",)])
    assert [future.cancelled() for future in futures] == [True, True]
    assert time.monotonic() - started < 10


def test_an_awaited_call_on_a_stuck_pool_times_out(stuck_pool) -> None:
    async def call() -> None:
        await asyncio.wait_for(stuck_pool.run("a"), 30)

    with pytest.raises(TimeoutError, match="no call finished"):
        asyncio.run(call())
