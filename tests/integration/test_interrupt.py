"""SIGTERM to `sluice train` (what `kill`, a scheduler or a container stop sends) ends
the run as Ctrl-C does: its roles flush and stop, the temporary Prefect server goes with
it, one line names the run and `--resume`, and the resumed run finishes with clean books.
Before, the signal killed the flow's process alone: the Prefect server it had started
kept its port, and nothing said how to continue."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.flows.conftest import tiny_run_overrides
from tests.integration.sluice_cli import Cli, run_id_of, wait_for_step

pytestmark = pytest.mark.integration


def group_members(pgid: int) -> list[str]:
    """The command lines of the live (not zombie) processes in process group `pgid`."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError):
            continue  # it ended while being read
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(cmdline.decode(errors="replace").strip())
    return members


def test_sigterm_stops_the_run_in_one_line_leaves_no_process_and_resume_finishes(tmp_path):
    from sluice.infra.config.run import load_config
    from sluice.tasks.run.audit import audit_run

    overrides = tiny_run_overrides(tmp_path, **{"trainer.total_steps": 1000})
    config = load_config("default", overrides)
    args = [part for o in overrides for part in ("--set", o)]
    env = {**os.environ, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90"}
    runs: list[Cli] = []
    try:
        first = Cli(args, tmp_path, env)
        runs.append(first)
        run_id = run_id_of(first)
        wait_for_step(first, config, run_id, 2)
        os.kill(first.process.pid, signal.SIGTERM)  # the flow's process alone, as `kill` does
        assert first.wait(120) == 128 + signal.SIGTERM, first.output()[-4000:]
        print(first.output()[-3000:])
        assert first.error_line() == (
            f"sluice: error: run {run_id} stopped: SIGTERM received; "
            f"continue with: sluice train --resume {run_id}"
        )
        # Nothing it started outlives it: roles, their launcher, the Prefect server.
        deadline = time.monotonic() + 30
        while (left := group_members(first.process.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == [], left
        stopped = audit_run(config, run_id)
        assert stopped.incomplete_versions == [] and stopped.duplicated == 0
        assert stopped.versions == list(range(len(stopped.versions)))

        last = stopped.versions[-1]
        resume = ["--set", f"trainer.total_steps={last + 2}", "--resume", run_id]
        second = Cli([*args, *resume], tmp_path, env)
        runs.append(second)
        assert second.wait(300) == 0, second.output()[-4000:]
        print(second.output()[-3000:])
        audit = audit_run(load_config("default", [*overrides, resume[1]]), run_id)
        assert audit.problems() == [], audit.problems()
        assert audit.versions[-1] == last + 2
    finally:
        for cli in runs:  # a failed assertion leaves no run behind
            cli.stop()
