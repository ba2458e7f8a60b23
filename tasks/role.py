"""The one shape every long-lived role has: a `Role` subclass with a `run()` method.

The base gives a role the run's locations (`paths`, `local_dir`), its stop control
(SIGTERM/SIGINT and the run's `done` marker), its status document, the run's checkpoint
registry, one wait for the first committed policy version that a stop interrupts
(`wait_for_first_version`), and one loop that consumes a stream shard by shard
(`consume`). `Role.main` is what a role process runs: build the role, install the
signal handlers, run it. A stop that arrives while the role waits raises
`StopRequested`, which ends the role cleanly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from sluice.infra.checkpoints import CheckpointIncomplete
from sluice.infra.config.run import RunConfig
from sluice.infra.outages import EXIT_OUTAGE, describe, outage_cause
from sluice.infra.streams.errors import CorruptShardError
from sluice.infra.streams.names import ShardRef
from sluice.infra.streams.reader import StreamReader
from sluice.infra.streams.writer import StreamWriter
from sluice.tasks.run.control import RunControl
from sluice.tasks.run.paths import run_paths, run_registry
from sluice.tasks.run.status import StatusReporter
from sluice.tasks.run.threads import role_threads

if TYPE_CHECKING:
    import pyarrow as pa

    from sluice.infra.registry import CommittedVersion

log = logging.getLogger("sluice")


EXIT_DAMAGED = 65
"""Exit code of a role process that found a committed checkpoint damaged (EX_DATAERR):
deleted or altered after its commit. Restarting cannot repair it; the run stops."""
EXIT_CANNOT_START = 78
"""Exit code of a role process that failed before its loop began (EX_CONFIG): its
imports, config or a plugin. A restart would meet the same error; the run stops."""
EXIT_WATCHDOG = 66
"""Exit code of a train role the mismatch watchdog stopped (`trainer.watchdog` action
`stop`): the run stops, resumable from its last good version."""
CANNOT_START_MARK = "cannot start: "
WATCHDOG_MARK = "mismatch watchdog: "
OUTAGE_MARK = "a service stopped answering"
DAMAGED_MARK = "a committed checkpoint is damaged: "
"""What the role's last error line says, for its supervisor to find in the log."""


def stop_on_lasting_failure(role: str, exc: BaseException) -> None:
    """End the role process with a code its supervisor acts on instead of restarting it:
    `EXIT_OUTAGE` when a service stopped answering (after its client's own retries),
    `EXIT_DAMAGED` when a committed checkpoint is missing a file or has a wrong one.
    Returns for anything else (a crash, which the supervisor retries).

    One log line names the cause; the traceback goes to debug.
    """
    cause = outage_cause(exc)
    if cause is not None:
        log.debug("%s: outage", role, exc_info=exc)
        log.error(
            f"%s stops: {OUTAGE_MARK} (%s); raised as %s",
            role,
            describe(cause),
            describe(exc) if exc is not cause else "itself",
        )
        raise SystemExit(EXIT_OUTAGE) from None
    if isinstance(exc, CheckpointIncomplete):
        log.debug("%s: damaged checkpoint", role, exc_info=exc)
        log.error(f"%s stops: {DAMAGED_MARK}%s", role, exc)
        raise SystemExit(EXIT_DAMAGED) from None


def cannot_start(role: str, exc: BaseException) -> NoReturn:
    """End a role process that failed before its loop began with `EXIT_CANNOT_START` and
    one line naming the cause (the traceback goes to debug)."""
    log.debug("%s: failed to start", role, exc_info=exc)
    log.error(f"%s {CANNOT_START_MARK}%s: %s", role, type(exc).__name__, exc)
    raise SystemExit(EXIT_CANNOT_START) from None


class StopRequested(Exception):
    """The role was told to stop (a signal, or the run's done marker) while it waited."""


class Role:
    """One long-lived role of one run; subclasses set `name` and write `run()`."""

    name = "role"
    """The status document the role writes (`_status/{name}.json`)."""
    thread_role = ""
    """The role `sluice.tasks.run.threads.role_threads` counts threads for (empty: `name`)."""

    @property
    def poll_interval_s(self) -> float:
        """Seconds between polls while there is nothing to do; roles with a setting override it."""
        return 0.5

    def __init__(self, config: RunConfig, run_id: str, mlflow_run_id: str) -> None:
        self.config = config
        self.run_id = run_id
        self.mlflow_run_id = mlflow_run_id
        self.paths = run_paths(config, run_id)
        self.control = RunControl(config, self.paths)
        self.status = StatusReporter(config, self.paths, self.name)
        # The thread count this role runs with, for readers on another machine (the
        # capacity planner), where the config's "None = follow the cores" means otherwise.
        self.status.fields["threads"] = role_threads(config, self.thread_role or self.name)
        self.registry = run_registry(config, run_id)

    @classmethod
    def main(cls, config: RunConfig, run_id: str, mlflow_run_id: str, **options: Any) -> None:
        """A role process: build the role, stop it on SIGTERM/SIGINT, run it."""
        try:
            role = cls(config, run_id, mlflow_run_id, **options)
        except Exception as exc:
            stop_on_lasting_failure(cls.name, exc)
            cannot_start(cls.name, exc)
        role.control.install_signal_handlers()
        try:
            role.run()
        except StopRequested:
            log.info("%s stopped before there was anything to do", role.name)
            role.status.update(force=True, state="stopped")
        except Exception as exc:
            stop_on_lasting_failure(role.name, exc)
            raise
        finally:
            role.close()

    def run(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the role holds beyond its process (run once `run` returns or fails)."""

    # ------------------------------------------------------------ where things are

    def local_dir(self, name: str) -> Path:
        """Local directory `name` of this run ({workdir}/runs/{run}/{name}): weight caches,
        snapshots, logs."""
        return Path(self.config.workdir) / "runs" / self.run_id / name

    def stream_reader(self, stream: str, consumer: str) -> StreamReader:
        return StreamReader(
            self.config.storage.url,
            self.run_id,
            stream,
            consumer=consumer,
            storage_options=self.config.storage.options,
        )

    def stream_writer(self, stream: str, writer_id: str) -> StreamWriter:
        return StreamWriter(
            self.config.storage.url,
            self.run_id,
            stream,
            writer_id=writer_id,
            storage_options=self.config.storage.options,
        )

    # ------------------------------------------------------------ waiting and consuming

    def wait_for_first_version(self, timeout_s: float | None = None) -> CommittedVersion:
        """The newest committed policy version, once there is one.

        Polls the registry every `poll_interval_s`; raises `StopRequested` as soon
        as a stop is requested, and TimeoutError after `timeout_s` (None: no limit).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self.control.should_stop():
                raise StopRequested
            latest = self.registry.newest_durable()
            if latest is not None:
                return latest
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no committed policy version appeared in the registry in {timeout_s:g} s"
                )
            self.control.sleep(self.poll_interval_s)

    def consume(
        self,
        reader: StreamReader,
        handle: Callable[[ShardRef, pa.Table], None],
        idle: Callable[[], None],
        done: Callable[[], bool] = lambda: False,
    ) -> bool:
        """Hand each new shard of `reader` to `handle` until `done()` or a stop request.

        `idle()` runs whenever a poll finds nothing new (it should sleep). A shard that
        turns out corrupt is quarantined by the reader, logged and skipped: the stream
        goes on. Returns True when `done()` ended the loop, False on a stop request.
        """
        while not done():
            if self.control.should_stop():
                return False
            refs = reader.poll()
            for ref in refs:
                try:
                    table = reader.read(ref)
                except CorruptShardError as err:
                    log.error("%s", err)
                    continue
                handle(ref, table)
                if self.control.should_stop():
                    break
            if not refs:
                idle()
        return True
