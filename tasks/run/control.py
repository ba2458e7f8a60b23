"""How a role stops: SIGTERM/SIGINT, or the run's `done` marker on storage."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from sluice.infra.config.run import RunConfig
from sluice.tasks.run.paths import RunPaths, filesystem, read_json, write_json

log = logging.getLogger("sluice")


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
