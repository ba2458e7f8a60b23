"""What every long-lived role shares: where the run lives, how it stops, how it reports.

Roles talk only through storage URLs and the tracking URI (docs/design.md §2), so the
only shared state here is naming: stream and checkpoint locations under
``{storage.url}/{run}``, a control prefix for the stop marker, and one status
document per role that the flow reads to draw progress. Status and control live on
the same object storage as the streams, so a role on another machine reports the
same way. `tasks/role.py` puts these pieces together into the one shape every role has.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import fsspec

from infra.config import RunConfig
from infra.storage import open_filesystem, put_atomic

if TYPE_CHECKING:
    from infra.registry import CheckpointRegistry

ROLES = ("rollout", "reward", "train", "evaluate")
ROLLOUTS, SCORED = "rollouts", "scored"
"""The two trajectory streams: generated groups, then the same groups with rewards."""
log = logging.getLogger("sluice")


@dataclass(frozen=True)
class RunPaths:
    """Every location of one run, derived from the storage root and the run id."""

    root: str
    run: str

    @property
    def prefix(self) -> str:
        return f"{self.root.rstrip('/')}/{self.run}"

    @property
    def checkpoints(self) -> str:
        return f"{self.prefix}/checkpoints"

    def checkpoint(self, policy_version: int) -> str:
        return f"{self.checkpoints}/v{policy_version:06d}"

    @property
    def control(self) -> str:
        return f"{self.prefix}/_control"

    def status(self, role: str) -> str:
        return f"{self.prefix}/_status/{role}.json"


def run_paths(config: RunConfig, run_id: str) -> RunPaths:
    return RunPaths(root=config.storage.url, run=run_id)


def registered_model_name(config: RunConfig, run_id: str) -> str:
    """One registered model per run, so policy versions of two runs never collide."""
    return f"{config.tracking.registered_model}-{run_id}"


def run_registry(config: RunConfig, run_id: str) -> CheckpointRegistry:
    """The checkpoint registry of one run (its own registered model, the run's alias)."""
    from infra.registry import CheckpointRegistry  # MLflow: imported by the roles that need it

    return CheckpointRegistry(
        config.tracking.uri,
        registered_model_name(config, run_id),
        alias=config.tracking.alias,
        storage_options=config.storage.options,
    )


def filesystem(config: RunConfig, url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of a run file, opened with the run's storage options."""
    return open_filesystem(url, config.storage.options)


def write_json(config: RunConfig, url: str, payload: dict[str, Any]) -> None:
    """Whole-object write: a reader sees the old document or the new one, never half."""
    fs, path = filesystem(config, url)
    put_atomic(fs, path, json.dumps(payload, default=str).encode())


def read_json(config: RunConfig, url: str) -> dict[str, Any] | None:
    """The JSON document at `url`, None when it is missing or not (yet) valid JSON."""
    fs, path = filesystem(config, url)
    try:
        return json.loads(fs.cat_file(path))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class RunControl:
    """Stop signals for a role: SIGTERM/SIGINT, or the run's `done` marker on storage."""

    def __init__(self, config: RunConfig, paths: RunPaths):
        self.config = config
        self.paths = paths
        self._stop = threading.Event()
        self._last_marker_check = 0.0

    def install_signal_handlers(self) -> None:
        def handle(signum: int, _frame: Any) -> None:
            log.info("received signal %s: flushing and stopping", signum)
            self._stop.set()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def request_stop(self) -> None:
        self._stop.set()

    def mark_done(self, reason: str) -> None:
        write_json(
            self.config, f"{self.paths.control}/done.json", {"reason": reason, "at": time.time()}
        )

    def clear_done(self) -> None:
        """Remove the stop marker (a resumed run starts without one)."""
        fs, path = filesystem(self.config, f"{self.paths.control}/done.json")
        if fs.exists(path):
            fs.rm(path)

    def done_marker(self) -> dict[str, Any] | None:
        return read_json(self.config, f"{self.paths.control}/done.json")

    def stop_requested(self) -> bool:
        """Whether a stop was already seen (a signal, `request_stop`, or the done marker
        found by `should_stop`); never reads storage."""
        return self._stop.is_set()

    def should_stop(self, check_marker_every_s: float = 1.0) -> bool:
        """`stop_requested`, or the run's done marker (read at most every
        `check_marker_every_s` seconds)."""
        if self._stop.is_set():
            return True
        now = time.monotonic()
        if now - self._last_marker_check >= check_marker_every_s:
            self._last_marker_check = now
            if self.done_marker() is not None:
                self._stop.set()
        return self._stop.is_set()

    def sleep(self, seconds: float) -> None:
        """Sleep `seconds`, waking at once when a stop is requested."""
        self._stop.wait(seconds)


class StatusReporter:
    """Writes a role's small status document at most every `interval_s` seconds."""

    def __init__(self, config: RunConfig, paths: RunPaths, role: str, interval_s: float = 1.0):
        self.config = config
        self.url = paths.status(role)
        self.role = role
        self.interval_s = interval_s
        self.started_at = time.time()
        self._last = 0.0
        self.fields: dict[str, Any] = {"role": role, "pid": os.getpid(), "state": "starting"}

    def update(self, force: bool = False, **fields: Any) -> None:
        self.fields.update(fields)
        now = time.monotonic()
        if force or now - self._last >= self.interval_s:
            self._last = now
            self.fields["updated_at"] = time.time()
            self.fields["uptime_s"] = time.time() - self.started_at
            try:
                write_json(self.config, self.url, self.fields)
            except OSError as err:  # status is best effort; the data plane is not
                log.warning("could not write status %s: %s", self.url, err)


def read_statuses(config: RunConfig, paths: RunPaths) -> dict[str, dict[str, Any]]:
    out = {}
    for role in ROLES:
        status = read_json(config, paths.status(role))
        if status is not None:
            out[role] = status
    return out


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


class RetryLogOnce(logging.Filter):
    """Log the first retry of an outage, not every one.

    urllib3 logs each retry of each request, and MLflow's client rides out an outage of
    its server by retrying with backoff through urllib3: a few seconds down fill every
    role's log with a line per attempt per call. The first retry passes (with a note);
    later ones within `quiet_s` are counted and the count rides on the next line let
    through.
    """

    def __init__(self, quiet_s: float = 60.0) -> None:
        super().__init__()
        self.quiet_s = quiet_s
        self._last: float | None = None
        self._suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith("Retrying ("):
            return True
        now = time.monotonic()
        if self._last is not None and now - self._last < self.quiet_s:
            self._suppressed += 1
            return False
        self._last = now
        earlier = f"; {self._suppressed} retries since the last note" if self._suppressed else ""
        record.msg = (
            f"{message} [retried with backoff; more retries in the next {self.quiet_s:g} s "
            f"are not logged{earlier}]"
        )
        record.args = ()
        self._suppressed = 0
        return True


def configure_logging(role: str) -> None:
    logging.basicConfig(
        level=os.environ.get("SLUICE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {role:>8} %(levelname).1s %(message)s",
        datefmt="%H:%M:%S",
    )
    # One line per HTTP request to the inference server buries the role's own log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("urllib3.connectionpool").addFilter(RetryLogOnce())
