"""A role process's log lines: its name on each, and one note per outage instead of one
per retry."""

from __future__ import annotations

import logging
import os
import time


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
