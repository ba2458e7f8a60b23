"""The run's control documents: the one place their names are written, the few a
flow writes for its roles, and how a role stops (SIGTERM/SIGINT, or the `done` marker).

The control documents live under the run's control prefix on storage
(`RunPaths.control`, ``{storage.url}/{run}/_control``), where a role on another machine
finds them. Every room of tasks/ (and the flows) imports their names from here, so two
rooms that meet at a document never import each other for its name.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from sluice.infra.config.run import RunConfig
from sluice.tasks.run.paths import RunPaths, filesystem, read_json, run_paths, write_json

log = logging.getLogger("sluice")

DONE_FILE = "done.json"
"""The stop marker: the reason the run ended (`RunControl.mark_done`); every role stops
when it appears."""
START_FILE = "start.json"
"""The committed version the run (re)started from: the version the rollout role's
servers load first, and a launched container again when restarted. The flow writes it
once the run's starting version is committed (`write_start`)."""
SERVERS_FILE = "servers.json"
"""The servers the run launched (`servers.launch: docker` or `ray`): their URLs, and for
Ray the actors' names (`write_launched_servers`), signed with the run's token."""
SENDER_FILE = "weight_sender.json"
"""The trainer's weight sender's URL (written by the train role, signed with the run's
token; read by the rollout role's fast weight paths)."""
LEASE_FILE = "trainer.lease.json"
"""The run's trainer lease: one trainer at a time trains a run."""
INCARNATION_FILE = "trainer.incarnation.json"
"""The incarnation r the newest trainer start took."""
FAILOVERS_FILE = "failovers.json"
"""The run's trainer failovers, oldest first (tasks/run/failovers.py)."""


def write_start(config: RunConfig, run_id: str, policy_version: int, checkpoint_uri: str) -> None:
    """Tell the rollout role which committed version the run starts from."""
    write_json(
        config,
        f"{run_paths(config, run_id).control}/{START_FILE}",
        {"policy_version": policy_version, "checkpoint_uri": checkpoint_uri},
    )


def write_launched_servers(config: RunConfig, run_id: str, urls: list[str], **more: Any) -> None:
    """Tell the rollout role where the run's launched servers answer (`more`: what else
    it needs of them, such as the names of their Ray actors)."""
    write_json(
        config, f"{run_paths(config, run_id).control}/{SERVERS_FILE}", {"urls": urls, **more}
    )


def launched_server_urls(config: RunConfig, run_id: str) -> list[str]:
    """The URLs of the servers the flow launched for this run (`servers.launch: docker`)."""
    document = read_json(config, f"{run_paths(config, run_id).control}/{SERVERS_FILE}")
    if not document or not document.get("urls"):
        raise RuntimeError(
            f"servers.launch=docker but the run has no {SERVERS_FILE}: "
            "the `train` flow launches the servers (the sync baseline does not)"
        )
    return [str(url) for url in document["urls"]]


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
            self.config, f"{self.paths.control}/{DONE_FILE}", {"reason": reason, "at": time.time()}
        )

    def clear_done(self) -> None:
        """Remove the stop marker (a resumed run starts without one)."""
        fs, path = filesystem(self.config, f"{self.paths.control}/{DONE_FILE}")
        if fs.exists(path):
            fs.rm(path)

    def done_marker(self) -> dict[str, Any] | None:
        return read_json(self.config, f"{self.paths.control}/{DONE_FILE}")

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
