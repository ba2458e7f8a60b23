"""A role's threads: torch's thread count per role and one background worker for
bookkeeping."""

from __future__ import annotations

import os
import sys
from typing import Any

from sluice.infra.config import RunConfig


class Background:
    """One worker thread for a role's bookkeeping (checkpoint upload, registry commit,
    metric logging), so the next step's compute overlaps it. Jobs run in submission
    order; `wait()` blocks until all are done and re-raises the first failure, so an
    error surfaces in the role's own thread one step late, never silently."""

    def __init__(self, name: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._futures: list[Any] = []

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        future = self._executor.submit(fn, *args, **kwargs)
        self._futures.append(future)
        return future

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
