"""`sluice logs [RUN] [--role R] [-f]`: a run's role logs, as its role processes wrote them.

The logs are written by role-like processes (tests/unit/test_cli_status.py's
`run_role_process`: the roles' log format, output appended to the role's log file, a
crash's traceback included); `-f` is checked end to end on a real `sluice logs -f`
process that is sent Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sluice.flows.cli import main
from sluice.infra.config.run import RunConfig
from sluice.tasks.run.paths import run_paths
from sluice.tasks.run.status import flow_reporter
from tests.unit.test_cli_status import run_role_process, start_run

RUN = "logs-20261127-090000-cd34"


@pytest.fixture(scope="module")
def run(
    local_run_config: Callable[..., RunConfig], tmp_path_factory: pytest.TempPathFactory
) -> RunConfig:
    """A run whose rollout role logged two lines and whose train role logged one and crashed."""
    config = local_run_config(tmp_path_factory.mktemp("logs"))
    start_run(config, RUN)
    run_role_process(config, RUN, "rollout", messages=["rollout line 1", "rollout line 2"])
    run_role_process(config, RUN, "train", messages=["train line 1"], crash="boom")
    return config


def logs(capsys: pytest.CaptureFixture[str], config: RunConfig, *args: str) -> tuple[int, str]:
    code = main(["logs", *args, "--set", f"workdir={config.workdir}"])
    captured = capsys.readouterr()
    return code, captured.out if code == 0 else captured.err


def test_every_roles_log_is_printed_with_each_line_prefixed_by_its_role(run, capsys):
    code, out = logs(capsys, run, RUN)
    assert code == 0
    lines = out.splitlines()
    log_dir = Path(run.workdir) / "runs" / RUN / "logs"
    files = {role: (log_dir / f"{role}.log").read_text() for role in ("rollout", "train")}
    # Every line of both files, each under its role; a traceback stays under its role.
    for role, text in files.items():
        assert [line.split(" | ", 1)[1] for line in lines if line.startswith(f"{role} ")] == (
            text.splitlines()
        )
    assert all(line.startswith(("rollout  | ", "train    | ")) for line in lines)
    assert lines[-1] == "train    | RuntimeError: boom"  # names padded to the roles' longest
    # Merged by time: the rollout role logged first.
    assert lines.index(next(x for x in lines if "rollout line 2" in x)) < lines.index(
        next(x for x in lines if "train line 1" in x)
    )


def test_one_roles_log_is_printed_as_it_is(run, capsys):
    code, out = logs(capsys, run, RUN, "--role", "train")
    assert code == 0
    path = Path(run.workdir) / "runs" / RUN / "logs" / "train.log"
    assert out == path.read_text()


def test_an_unknown_role_names_the_roles_the_run_has_in_one_line(run, capsys):
    code, err = logs(capsys, run, RUN, "--role", "trainer")
    assert code == 2
    assert err.splitlines() == [
        f"sluice: error: run {RUN} has no role 'trainer'; its roles: rollout, train"
    ]


def test_a_run_that_does_not_exist_gives_one_error_line(run, capsys):
    code, err = logs(capsys, run, "nope-1")
    assert code == 2 and len(err.splitlines()) == 1 and "run 'nope-1' not found" in err


def test_follow_prints_lines_as_they_are_appended_until_ctrl_c(local_run_config, tmp_path):
    run = local_run_config(tmp_path)  # a run of its own: this test writes to its logs
    start_run(run, RUN)
    run_role_process(run, RUN, "train", messages=["train line 1"], crash="boom")
    output = tmp_path / "out.txt"

    def printed() -> str:
        return output.read_text()

    def wait_for(text: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in printed():
            assert follower.poll() is None, printed()
            assert time.monotonic() < deadline, f"no {text!r} in:\n{printed()}"
            time.sleep(0.1)

    command = [sys.executable, "-m", "sluice.flows.cli", "logs", RUN, "-f"]
    with output.open("w") as out:
        follower = subprocess.Popen(
            [*command, f"workdir={run.workdir}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1"),
        )
    try:
        wait_for("train    | RuntimeError: boom")  # what the logs held: printed, then followed
        run_role_process(run, RUN, "reward", messages=["a role that started later"])
        run_role_process(run, RUN, "train", messages=["train restarted"])
        wait_for("reward   | ")
        wait_for("train restarted")
    finally:
        # Whether SIGINT reaches Python at all: a disposition inherited as ignored stays so.
        status = Path(f"/proc/{follower.pid}/status")
        lines = status.read_text().splitlines() if follower.poll() is None else []
        dispositions = [line for line in lines if line.startswith(("SigIgn", "SigCgt"))]
        follower.send_signal(signal.SIGINT)
        try:
            code = follower.wait(timeout=30)
        except subprocess.TimeoutExpired:  # where it is stuck, from every thread's stack
            follower.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER prints the stacks
            follower.wait(timeout=30)
            pytest.fail(
                f"sluice logs -f still runs 30 s after SIGINT ({dispositions}):\n"
                + printed()[-6000:]
            )
    assert code == 0, printed()
    assert "reward   | " in printed() and "a role that started later" in printed()
    assert "Traceback" not in printed().split("train restarted")[-1]  # Ctrl-C ends it quietly


def test_a_run_with_no_role_log_yet_says_what_its_flow_is_doing(local_run_config, tmp_path, capsys):
    config = local_run_config(tmp_path)
    start_run(config, "warm")
    code, err = logs(capsys, config, "warm")  # nothing said yet: nothing to show
    assert code == 2 and err.startswith("sluice: error: run warm has no logs yet")
    # What the flow writes while it warm-starts the policy (tasks/run/prepare.py).
    flow_reporter(config, run_paths(config, "warm")).update(
        state="preparing", activity="warm start: step 200, accuracy 0.41"
    )
    code, out = logs(capsys, config, "warm")
    assert code == 0
    assert out.splitlines() == [
        "run warm has no role logs yet; the flow is preparing: warm start: step 200, accuracy 0.41"
    ]
