"""Worker processes for calls that may hang or crash: the reward role's verifiers
(`tasks/reward/role.py`) and the rollout role's user tools (`tasks/tool_runner.py`).

`CallPool` runs calls in spawned processes on pebble's ProcessPool, which gives each
call its own deadline and replaces only the worker a call was stuck in or killed:
that call fails alone (``TimeoutError`` or ``pebble.ProcessExpired``) and every other
call, running or queued, goes on. A call's deadline starts when a worker takes it,
so waiting in the queue, or for a replacement worker to start, never counts against it.

A spawned worker imports this module and the loader it is given, never the role's
module (which pulls in torch and transformers): a replacement worker costs a spawn and
the loader's own imports (well under a second for a plugin verifier or tool).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from pebble import ProcessPool

log = logging.getLogger("sluice.call_pool")

WORKER_START_TIMEOUT_S = 120.0
"""How long a worker may take to start and load what it calls (spawn and imports)."""

KILL_GRACE_S = 10.0
"""How long pebble may take to stop a worker stuck past its deadline (SIGTERM, a
3 s grace, then SIGKILL)."""

_worker_function: Callable[..., Any] | None = None


def _load_in_worker(
    loader: Callable[..., Callable[..., Any]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    global _worker_function
    _worker_function = loader(*args, **kwargs)


def _call_in_worker(*args: Any) -> Any:
    assert _worker_function is not None
    return _worker_function(*args)


def _lost(future: cf.Future[Any]) -> bool:
    """Whether a finished call failed because its pool broke, not by anything it did."""
    return future.cancelled() or (
        future.done() and isinstance(future.exception(), BrokenProcessPool)
    )


class CallPool:
    """`workers` processes, each of which calls ``loader(*args, **kwargs)`` once and
    then runs calls of the function it returned, every call under `timeout_s`.

    Processes start on the first call. Waits are bounded: when no call has finished for
    `stall_s` while some are outstanding, the pool is stuck (no call can run longer
    than its deadline plus a kill, no worker may take longer than
    WORKER_START_TIMEOUT_S to start), so it is replaced and the outstanding calls are
    cancelled.
    """

    def __init__(
        self,
        workers: int,
        timeout_s: float,
        loader: Callable[..., Callable[..., Any]],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self.workers, self.timeout_s = workers, timeout_s
        self.stall_s = timeout_s + WORKER_START_TIMEOUT_S + KILL_GRACE_S
        self._initargs = (loader, args, kwargs)
        self._pool: ProcessPool | None = None
        # Schedules come from the event loop and from threads, done-callbacks from pebble's
        # threads; re-entrant because cancelling a future runs its callback at once.
        self._lock = threading.RLock()
        self._outstanding: set[cf.Future[Any]] = set()
        self._last_finished = time.monotonic()
        self._stopping: list[threading.Thread] = []

    def schedule(self, *args: Any) -> cf.Future[Any]:
        """One call of the workers' function with `args`, as a future."""
        with self._lock:
            try:
                future = self._running().schedule(
                    _call_in_worker, args=args, timeout=self.timeout_s
                )
            except RuntimeError:  # the pool broke since `_running` looked: a fresh one
                self._retire()
                future = self._running().schedule(
                    _call_in_worker, args=args, timeout=self.timeout_s
                )
            self._outstanding.add(future)
        future.add_done_callback(self._finished)
        return future

    def run_all(self, calls: Sequence[tuple[Any, ...]]) -> list[cf.Future[Any]]:
        """Every call, waited for; a call left unfinished by a stuck pool is cancelled.

        A worker that dies before pebble has seen it take its call breaks the whole pool,
        failing calls that never ran: the calls lost that way run once more, on a fresh
        pool.
        """
        futures = [self.schedule(*args) for args in calls]
        if self._wait(futures):
            return futures
        again = [i for i, future in enumerate(futures) if _lost(future)]
        if again:
            log.warning("the worker pool broke; running %d of its calls again", len(again))
            for i in again:
                futures[i] = self.schedule(*calls[i])
            self._wait([futures[i] for i in again])
        return futures

    async def run(self, *args: Any) -> Any:
        """One call's result, awaited; raises what the call raised, TimeoutError past its
        deadline (or when the pool is stuck), ProcessExpired when its worker died."""
        for attempt in (1, 2):
            future = self.schedule(*args)
            try:
                stuck = await self._wait_async(future)
            except asyncio.CancelledError:
                future.cancel()  # pebble stops the worker running it, and no other
                raise
            if stuck:
                raise TimeoutError(f"no call finished in {self.stall_s:g} s")
            if attempt == 1 and _lost(future):
                log.warning("the worker pool broke; running the call again")
                continue
            break
        if future.cancelled():
            raise BrokenProcessPool("the worker pool broke twice")
        return future.result()

    def _wait(self, futures: list[cf.Future[Any]]) -> bool:
        """Whether the pool got stuck (and was replaced) before every call finished."""
        pending = set(futures)
        while pending:
            done, pending = cf.wait(pending, self.stall_s, return_when=cf.FIRST_COMPLETED)
            if not done and self._stuck():
                return True
        return False

    async def _wait_async(self, future: cf.Future[Any]) -> bool:
        waiting = asyncio.wrap_future(future)
        while not waiting.done():
            await asyncio.wait({waiting}, timeout=self.stall_s)
            if not waiting.done() and self._stuck():
                return True
        if not waiting.cancelled():
            waiting.exception()  # the caller reads `future`: asyncio need not warn of it
        return False

    def _stuck(self) -> bool:
        if time.monotonic() - self._last_finished <= self.stall_s:
            return False
        log.warning("no call finished in %g s: replacing the worker pool", self.stall_s)
        with self._lock:
            self._retire()
        return True

    def _finished(self, future: cf.Future[Any]) -> None:
        self._last_finished = time.monotonic()
        with self._lock:
            self._outstanding.discard(future)

    def _running(self) -> ProcessPool:
        # pebble marks a pool it cannot keep workers in (every worker gone at once) as
        # no longer active; its calls have failed with BrokenProcessPool.
        if self._pool is not None and not self._pool.active:
            self._retire()
        if self._pool is None:
            self._pool = ProcessPool(
                self.workers,
                initializer=_load_in_worker,
                initargs=self._initargs,
                # Not fork: the roles run threads (event loop, pebble's own), and a forked
                # child holds whatever locks they held.
                context=multiprocessing.get_context("spawn"),
            )
            self._last_finished = time.monotonic()
        return self._pool

    def _retire(self) -> None:
        """Stop the pool (the next call starts a fresh one) and cancel the calls still
        outstanding in it: a stopped or broken pool never answers them."""
        pool, self._pool = self._pool, None
        outstanding, self._outstanding = self._outstanding, set()
        self._last_finished = time.monotonic()
        for future in outstanding:
            future.cancel()
        if pool is not None:
            pool.stop()
            # Stopping takes up to pebble's kill grace per stuck worker: not on the caller.
            stopping = threading.Thread(
                target=_join, args=(pool,), name="sluice-pool-stop", daemon=True
            )
            stopping.start()
            self._stopping = [t for t in self._stopping if t.is_alive()] + [stopping]

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            outstanding, self._outstanding = self._outstanding, set()
        for future in outstanding:
            future.cancel()
        if pool is not None:
            pool.stop()
            _join(pool)
        for stopping in self._stopping:  # pools retired earlier: their workers end too
            stopping.join(KILL_GRACE_S)


def _join(pool: ProcessPool) -> None:
    try:
        pool.join()
    except Exception as err:  # noqa: BLE001 - a worker that would not die is logged, not raised
        log.warning("a worker pool did not stop cleanly: %r", err)
