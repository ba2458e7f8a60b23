"""Each role's small status document, which the flow reads to draw progress, and the
flow's own, which says what a run does before its roles report (a supervised pass, a
warm start, the roles' start)."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from sluice.infra.config.run import RunConfig
from sluice.infra.process_stats import peak_rss_mb
from sluice.tasks.run.paths import ROLES, RunPaths, read_json, write_json

log = logging.getLogger("sluice")
FLOW = "flow"
"""The status document the flow writes (`_status/flow.json`): `state` and `activity`,
its newest progress line."""


class StatusReporter:
    """Writes a role's small status document at most every `interval_s` seconds."""

    def __init__(self, config: RunConfig, paths: RunPaths, role: str, interval_s: float = 1.0):
        self.config = config
        self.url = paths.status(role)
        self.role = role
        self.interval_s = interval_s
        self.started_at = time.time()
        self._last = 0.0
        self.fields: dict[str, Any] = {
            "role": role,
            "pid": os.getpid(),
            "started_at": self.started_at,  # with the pid: this process, on any node
            "host": socket.gethostname(),
            "state": "starting",
        }

    def update(self, force: bool = False, **fields: Any) -> None:
        self.fields.update(fields)
        now = time.monotonic()
        if force or now - self._last >= self.interval_s:
            self._last = now
            self.fields["updated_at"] = time.time()
            self.fields["uptime_s"] = time.time() - self.started_at
            self.fields["peak_rss_mb"] = peak_rss_mb()
            try:
                write_json(self.config, self.url, self.fields)
            except OSError as err:  # status is best effort; the data plane is not
                log.warning("could not write status %s: %s", self.url, err)


def flow_reporter(config: RunConfig, paths: RunPaths) -> StatusReporter:
    """The flow's status document: written on every progress line (they come seconds
    to a minute apart), so `sluice status` and `sluice logs` can say what the run does
    while no role has started."""
    return StatusReporter(config, paths, FLOW, interval_s=0.0)


def read_flow_status(config: RunConfig, paths: RunPaths) -> dict[str, Any] | None:
    return read_json(config, paths.status(FLOW))


def read_statuses(config: RunConfig, paths: RunPaths) -> dict[str, dict[str, Any]]:
    out = {}
    for role in ROLES:
        status = read_json(config, paths.status(role))
        if status is not None:
            out[role] = status
    return out
