"""The weight routes' one-at-a-time slot (infra/serving/weight_routes.py): a call that
has answered has freed the slot, so the caller's next call is never refused as busy
(a refused bucket leaves the trainer's broadcast waiting out its timeout)."""

import asyncio
import sys
import threading

from sluice.infra.serving.weight_routes import _OneAtATime


def test_a_call_that_answered_never_leaves_the_slot_taken():
    slot = _OneAtATime("collective")

    def work():
        return 1

    async def calls():
        return [await slot.run(work, 5.0) for _ in range(300)]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: the race shows
    try:
        answers = asyncio.run(calls())
    finally:
        sys.setswitchinterval(interval)
    assert answers == [1] * 300


def test_a_second_call_while_one_runs_is_refused_at_once():
    slot = _OneAtATime("group")
    release = threading.Event()

    async def both():
        first = asyncio.create_task(slot.run(release.wait, 5.0))
        await asyncio.sleep(0.05)
        second = await slot.run(lambda: True, 5.0)
        release.set()
        return await first, second

    assert asyncio.run(both()) == (True, None)
