"""A role's threads: torch's thread count per role and one background worker for
bookkeeping."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from sluice.infra.config.run import RunConfig


class Background:
    """One worker thread for a role's bookkeeping (checkpoint upload, registry commit,
    metric logging), so the next step's compute overlaps it. Jobs run in submission
    order; `wait()` blocks until all are done and re-raises the first failure, so an
    error surfaces in the role's own thread one step late, never silently.

    Its work is off the role's critical path, so it is not one of the role's time
    states (`tasks/run/state_timer.py`): `report()` gives its busy and CPU seconds and
    how late its newest job finished after it was submitted."""

    def __init__(self, name: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._futures: list[Any] = []
        self.busy_s = 0.0
        """Wall seconds the worker spent running jobs."""
        self.cpu_s = 0.0
        """CPU seconds of the worker thread while it ran jobs (its own thread only)."""
        self.lag_s: float | None = None
        """Of the newest finished job: seconds from its submission to its end (the wait
        behind earlier jobs included); None before one finished."""

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        future = self._executor.submit(self._timed, time.monotonic(), fn, *args, **kwargs)
        self._futures.append(future)
        return future

    def _timed(self, submitted: float, fn: Any, *args: Any, **kwargs: Any) -> Any:
        started, cpu = time.monotonic(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            # One worker thread: these sums are only written here, one job at a time.
            end = time.monotonic()
            self.busy_s += end - started
            self.cpu_s += time.thread_time() - cpu
            self.lag_s = end - submitted

    def report(self, prefix: str = "background/") -> dict[str, float]:
        """The worker's busy and CPU seconds so far and the newest job's lag."""
        out = {f"{prefix}busy_s": self.busy_s, f"{prefix}cpu_s": self.cpu_s}
        if self.lag_s is not None:
            out[f"{prefix}lag_s"] = self.lag_s
        return out

    def pending(self) -> bool:
        """Whether a job submitted since the last wait has not finished."""
        return any(not f.done() for f in self._futures)

    def wait(self) -> list[Any]:
        """Results of every job submitted since the last wait, in order."""
        futures, self._futures = self._futures, []
        return [f.result() for f in futures]

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)


def role_threads(config: RunConfig, role: str) -> int:
    """torch threads for one role process: the busy roles share the cores, never oversubscribe.

    The count also fixes how float reductions are split, so seeded runs are bit-identical
    only at the same count: `None` follows the machine's cores, a number pins it.
    """
    if config.threads_per_role is not None:
        return config.threads_per_role
    cores = os.cpu_count() or 1
    return cores if role == "sync" else max(1, cores // 2)


def limit_threads(threads: int) -> None:
    """Cap torch (and any OpenMP/BLAS pool a child process starts) at `threads`.

    torch reads these variables when it is first imported, so a role that has not
    imported torch yet (the rollout and reward roles may never need to) pays nothing.
    """
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
