"""The role launcher: children forked from a preloaded process behave like fresh interpreters.

Real processes, real pipes and signals. The launcher here preloads only `json` so the
tests do not wait on torch; the flows tests run it with the real preload.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from sluice.tasks.process.launcher import Child, Launcher, start_role

pytestmark = pytest.mark.integration

HERE = "tests.integration.test_launcher"


def child_main(argv: list[str]) -> int:
    """What a forked child runs: report what it sees, then behave as argv says."""
    print(f"env={os.environ.get('SLUICE_TEST_VALUE')} cwd={os.getcwd()}")
    print(f"comm={Path('/proc/self/comm').read_text().strip()}")
    print("to stderr", file=sys.stderr)
    atexit.register(lambda: print("atexit ran"))
    if argv[0] == "sleep":
        time.sleep(60)
    if argv[0] == "import":
        import late_plugin  # only on the PYTHONPATH the caller set after the launcher started

        return int(late_plugin.VALUE)
    if argv[0] == "raise":
        raise ValueError("boom in the child")
    return int(argv[0])


@pytest.fixture
def launcher():
    launcher = Launcher(preload=("json",))
    yield launcher
    launcher.close()


def test_child_gets_callers_environment_cwd_and_log(launcher, tmp_path, monkeypatch):
    # Set after the launcher started: the child must see the caller's value at start.
    monkeypatch.setenv("SLUICE_TEST_VALUE", "late")
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "child.log"
    child = launcher.start(["3"], log, target=f"{HERE}:child_main", name="sluice-test")
    assert child.wait(30) == 3
    text = log.read_text()
    assert "comm=sluice-test" in text  # told apart from the launcher in ps/top
    assert f"env=late cwd={tmp_path}" in text
    assert "to stderr" in text
    assert "atexit ran" in text


def test_exception_in_child_exits_1_with_traceback_in_log(launcher, tmp_path):
    log = tmp_path / "child.log"
    child = launcher.start(["raise"], log, target=f"{HERE}:child_main")
    assert child.wait(30) == 1
    assert "ValueError: boom in the child" in log.read_text()


def test_stop_sends_sigterm_and_reports_the_signal(launcher, tmp_path):
    child = launcher.start(["sleep"], tmp_path / "child.log", target=f"{HERE}:child_main")
    assert child.wait(0.5) is None
    assert child.stop(grace_s=10) == -signal.SIGTERM


def test_closing_the_launcher_stops_its_children(tmp_path):
    launcher = Launcher(preload=())
    child = launcher.start(["sleep"], tmp_path / "child.log", target=f"{HERE}:child_main")
    assert child.wait(0.5) is None
    launcher.close()  # the parent going away looks the same to the launcher
    deadline = time.monotonic() + 30
    while launcher.alive and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not launcher.alive  # it left only after its child was gone (and reaped)
    with pytest.raises(ProcessLookupError):
        os.kill(child.pid, 0)
    assert child.wait(5) is not None  # the parent no longer waits on a child it cannot see


def test_fresh_interpreter_when_the_launcher_is_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_ROLE_LAUNCHER", "fresh")
    log = tmp_path / "role.log"
    code = "import sys; print('fresh', flush=True); sys.exit(4)"
    child = start_role(["unused"], log, [sys.executable, "-c", code])
    assert isinstance(child, Child)
    assert child.wait(30) == 4
    assert log.read_text().strip() == "fresh"


def test_unknown_target_fails_the_child_not_the_launcher(launcher, tmp_path):
    log = tmp_path / "child.log"
    bad = launcher.start([], log, target=f"{HERE}:no_such_function")
    assert bad.wait(30) == 1
    assert "AttributeError" in log.read_text()
    good = launcher.start(["0"], tmp_path / "good.log", target=f"{HERE}:child_main")
    assert good.wait(30) == 0


def test_role_log_path_must_be_writable(launcher, tmp_path):
    missing = tmp_path / "no-such-dir" / "child.log"
    child = launcher.start(["0"], missing, target=f"{HERE}:child_main")
    assert child.wait(30) == 1
    assert not Path(missing).exists()


def test_child_follows_pythonpath_set_after_the_launcher_started(launcher, tmp_path, monkeypatch):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "late_plugin.py").write_text("VALUE = 7\n")
    monkeypatch.setenv("PYTHONPATH", str(plugins))
    child = launcher.start(["import"], tmp_path / "child.log", target=f"{HERE}:child_main")
    assert child.wait(30) == 7
