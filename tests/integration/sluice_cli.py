"""`sluice train` as a user runs it, for the integration tests that stop, interrupt or
resume a whole run: its output collected line by line, its progress read from storage."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration.conftest import stop_process_group


class Cli:
    """`sluice train` as a user runs it, its output collected line by line. It leads a
    process group of its own (its roles and ephemeral Prefect server are in it), which
    `stop` ends."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sluice.flows.cli", "train", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.process.stdout:  # type: ignore[union-attr]
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def wait(self, timeout_s: float) -> int:
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail("sluice train did not end:\n" + "\n".join(self.lines[-60:]))
        self._reader.join(30)
        return code

    def stop(self) -> None:
        """End the run and everything it started, whatever state it is in."""
        stop_process_group(self.process, grace_s=10)

    def output(self) -> str:
        return "\n".join(self.lines)

    def error_line(self) -> str:
        """The CLI's one error line; no traceback may come with it."""
        errors = [line for line in self.lines if line.startswith("sluice: error:")]
        assert len(errors) == 1, self.output()[-4000:]
        assert not any(line.startswith("Traceback") for line in self.lines), self.output()
        return errors[0]


def train_step(config, run_id: str) -> int:
    from sluice.tasks.run.paths import run_paths
    from sluice.tasks.run.status import read_statuses

    try:
        return int(read_statuses(config, run_paths(config, run_id)).get("train", {}).get("step", 0))
    except Exception:
        return 0


def wait_for_step(cli: Cli, config, run_id: str, step: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while train_step(config, run_id) < step:
        if cli.process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no step {step}:\n" + cli.output()[-4000:])
        time.sleep(0.3)


def run_id_of(cli: Cli, timeout_s: float = 120) -> str:
    """The id the run printed in its "starting run" line."""
    deadline = time.monotonic() + timeout_s
    while not (found := [m for x in cli.lines if (m := re.search(r"starting run (\S+):", x))]):
        assert cli.process.poll() is None and time.monotonic() < deadline, cli.output()
        time.sleep(0.2)
    return found[0].group(1)
