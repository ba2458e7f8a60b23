"""`sluice logs [RUN] [--role R] [-f]`: a run's role logs, from the files its processes
write under {workdir}/runs/{run}/logs/ (one per role, the inference server's beside them).

Without --role every log is printed, each line prefixed by its role and the lines
merged by their time stamps (a line without one, a traceback's, stays after the line
before it). `-f` then follows them as `tail -f` does, taking up a log that appears
later (a role started after the others, a restarted server), until Ctrl-C. A run
with no role log yet (its flow is still in a supervised pass or a warm start) is not an
error: what the flow is doing is printed instead, from its status document.
"""

from __future__ import annotations

import contextlib
import heapq
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from sluice.flows.cli_common import fail
from sluice.infra.config.run import RunConfig
from sluice.tasks.run.paths import ROLES, run_paths
from sluice.tasks.run.status import read_flow_status

STAMP = re.compile(r"^(\d\d:\d\d:\d\d) ")
"""The time stamp a role's log line starts with (tasks/run/logs.py)."""


def log_roles(log_dir: Path) -> list[str]:
    """The roles (and servers) a run has logs of: the roles in pipeline order, then the
    rest by name."""
    names = {path.stem for path in log_dir.glob("*.log")}
    return [r for r in ROLES if r in names] + sorted(names - set(ROLES))


def stamped(lines: list[str]) -> Iterator[tuple[str, str]]:
    """(time stamp, line) for merging: an unstamped line takes the stamp of the line
    before it, so a traceback stays under the line that logged it."""
    stamp = ""
    for line in lines:
        found = STAMP.match(line)
        stamp = found.group(1) if found else stamp
        yield stamp, line


def prefix_width(roles: list[str]) -> int:
    """Room for the longest role name, at least the roles' own (a log that appears
    later rarely moves the column)."""
    return max(len(name) for name in (*ROLES, *roles))


def prefixed(role: str, width: int | None, line: str) -> str:
    """`line` under its role's name, padded to `width` (None: the line alone)."""
    return line if width is None else f"{role:<{width}} | {line}"


class LogTail:
    """The lines appended to one log since the last read (whole lines only)."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path = path
        self.offset = offset
        self.partial = b""

    def read_lines(self, final: bool = False) -> list[str]:
        """The whole lines appended since the last read; with `final`, a last line
        without its newline too (nothing will be appended to it that is waited for)."""
        lines = self._read()
        if final and self.partial:
            lines.append(self.partial.decode(errors="replace"))
            self.partial = b""
        return lines

    def _read(self) -> list[str]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:  # truncated or replaced: read it again from the start
            self.offset, self.partial = 0, b""
        if size == self.offset:
            return []
        with self.path.open("rb") as log:
            log.seek(self.offset)
            data = self.partial + log.read(size - self.offset)
        self.offset = size
        *whole, self.partial = data.split(b"\n")
        return [line.decode(errors="replace") for line in whole]


def print_logs(
    log_dir: Path,
    roles: list[str],
    prefix: bool,
    out: TextIO | None = None,
    final: bool = True,
) -> dict[str, LogTail]:
    """Print what the roles' logs hold now, merged by time; returns where each ends.
    `final`: nothing follows, so a last line without its newline is printed too."""
    out = out or sys.stdout
    width = prefix_width(roles) if prefix else None
    tails = {role: LogTail(log_dir / f"{role}.log") for role in roles}
    per_role = [
        [(stamp, role, line) for stamp, line in stamped(tail.read_lines(final))]
        for role, tail in tails.items()
    ]
    for _, role, line in heapq.merge(*per_role, key=lambda item: item[0]):
        out.write(prefixed(role, width, line) + "\n")
    out.flush()
    return tails


def follow_logs(
    log_dir: Path,
    tails: dict[str, LogTail],
    prefix: bool,
    out: TextIO | None = None,
    poll_s: float = 0.5,
    keep_going: Callable[[], bool] = lambda: True,
) -> None:
    """Print lines as they are appended, until `keep_going()` says no (or Ctrl-C).

    With `prefix` (every role), a log that appears later is followed from its start."""
    out = out or sys.stdout
    fixed = not prefix
    while keep_going():
        if not fixed:
            for role in log_roles(log_dir):
                tails.setdefault(role, LogTail(log_dir / f"{role}.log"))
        width = prefix_width(list(tails)) if prefix else None
        for role, tail in tails.items():
            for line in tail.read_lines():
                out.write(prefixed(role, width, line) + "\n")
        out.flush()
        time.sleep(poll_s)


def check_role(run_id: str, log_dir: Path, role: str | None, follow: bool) -> list[str]:
    """The roles to print; ValueError with one line when there are none or `role` is
    not one of them (a role that has not logged yet may be followed)."""
    have = log_roles(log_dir)
    if role is None:
        if not have and not follow:
            raise ValueError(f"run {run_id} has no logs yet (none in {log_dir})")
        return have
    if role in have or (follow and role in (*ROLES, "sync")):
        return [role]
    known = ", ".join(have) if have else f"none yet in {log_dir}"
    raise ValueError(f"run {run_id} has no role '{role}'; its roles: {known}")


def flow_activity(config: RunConfig, run_id: str) -> str | None:
    """What the run's flow says it is doing (its newest progress line), None when it
    has not said (or its storage does not answer)."""
    try:
        flow = read_flow_status(config, run_paths(config, run_id))
    except OSError:
        return None
    if not flow or not flow.get("activity"):
        return None
    return f"the flow is {flow.get('state', 'running')}: {flow['activity']}"


def run_logs(
    run_id: str,
    run_dir: Path,
    role: str | None,
    follow: bool,
    config: RunConfig | None = None,
) -> int:
    """Print a run's logs (exit 2 with one line for a role it does not have); with
    `follow`, go on printing until Ctrl-C. Before any role has a log, what the flow
    does (read with `config`) is printed instead, and the exit is 0."""
    log_dir = run_dir / "logs"
    if role is None and not follow and not log_roles(log_dir) and config is not None:
        activity = flow_activity(config, run_id)
        if activity is not None:
            print(f"run {run_id} has no role logs yet; {activity}")
            return 0
    try:
        roles = check_role(run_id, log_dir, role, follow)
    except ValueError as err:
        return fail(err)
    tails = print_logs(log_dir, roles, prefix=role is None, final=not follow)
    if follow:
        with contextlib.suppress(KeyboardInterrupt):  # how following is meant to end
            follow_logs(log_dir, tails, prefix=role is None)
    return 0
