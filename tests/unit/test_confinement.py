"""The kernel controls under the process sandbox hold against real escapes.

Every attack (tests/unit/sandbox_escapes.py) runs in a real child started as the sandbox
starts its runner: ``python -I -c <source>`` in a fresh temporary work directory holding
``payload.json``, a stripped environment, its own session, and the group killed after
the run. Confined, each route is refused and nothing outside the run changed; the same
attack run unconfined shows the test can tell (it reads, writes, connects or forks).

This machine is root with Landlock, seccomp and PID namespaces: the tests do not skip
when a control is missing, they fail, because a sandbox that says it isolates must.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import mmap
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.engines.env import confinement
from tests.unit.sandbox_escapes import ESCAPES

# The sandbox's runner environment (engines/env/sandbox.py): nothing of the parent's.
_RUNNER_ENV = {
    "PATH": os.defpath,
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_TIMEOUT_S = 20


@dataclasses.dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    workdir: Path

    def lines(self, kind: str) -> list[str]:
        return [line for line in self.stdout.splitlines() if line.startswith(kind + ":")]


def _processes_with(token: str) -> list[int]:
    """Pids (other than ours) whose command line carries ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
        except OSError:
            continue
        if token.encode() in cmdline:
            found.append(int(entry))
    return found


def _none_left(token: str, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while _processes_with(token):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _start(source: str, workdir: Path, *, confined: bool, controls=None) -> subprocess.Popen:
    wrapped = confinement.wrap(source, controls) if confined else source
    return subprocess.Popen(
        [sys.executable, "-I", "-c", wrapped],
        cwd=workdir,
        env={**_RUNNER_ENV, "HOME": str(workdir)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )


def _run(source: str, target: dict, *, confined: bool = True, controls=None) -> Run:
    """One run in a fresh work directory, as the sandbox runs one."""
    workdir = Path(tempfile.mkdtemp(prefix="sluice-sandbox-"))
    try:
        (workdir / "payload.json").write_text(json.dumps({"code": "", "tests": ""}))
        (workdir / "data.txt").write_text("numbers 1 2 3\n")
        secret = workdir / "secret.txt"
        secret.write_text("work-dir-secret\n")
        secret.chmod(0o600)
        process = _start(f"TARGET = {target!r}\n{source}", workdir, confined=confined,
                         controls=controls)  # fmt: skip
        try:
            out, err = process.communicate(timeout=_TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # what the sandbox does after a run
            process.wait(timeout=_TIMEOUT_S)
        return Run(process.returncode, out.decode(), err.decode(), workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def controls() -> confinement.Controls:
    found = confinement.probe()
    assert found.complete, found.line()
    return found


@pytest.fixture()
def outside() -> Iterator[Path]:
    """A directory outside the work dir that any uid may pass, so only Landlock guards it."""
    directory = Path(tempfile.mkdtemp(prefix="sluice-outside-"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture()
def victim() -> Iterator[subprocess.Popen]:
    process = subprocess.Popen(["sleep", "60"])
    yield process
    process.kill()
    process.wait(timeout=_TIMEOUT_S)


@pytest.fixture()
def listener() -> Iterator[socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    yield server
    server.close()


@pytest.fixture()
def target(outside: Path, victim: subprocess.Popen, listener: socket.socket) -> Iterator[dict]:
    """Everything an attack aims at, set up by this test process (the run's parent)."""
    secret = outside / "root-only.txt"
    secret.write_text("root-only-secret\n")
    secret.chmod(0o600)
    victim_file = outside / "checkpoint.bin"
    victim_file.write_bytes(b"checkpoint bytes")
    victim_file.chmod(0o666)
    memory = ctypes.create_string_buffer(b"parent-memory-secret-0123456789")
    token = f"sluice-escape-{secrets.token_hex(8)}"
    yield {
        "pid": os.getpid(),
        "victim_pid": victim.pid,
        "address": ctypes.addressof(memory),
        "secret_path": str(secret),
        "work_secret": "secret.txt",
        "victim_path": str(victim_file),
        "port": listener.getsockname()[1],
        "token": token,
        "linger_s": 30,
    }
    for pid in _processes_with(token):  # an unconfined baseline's lingering child
        os.kill(pid, signal.SIGKILL)


def _assert_refused(run: Run, routes: int) -> None:
    assert "done" in run.stdout.splitlines(), run.stdout + run.stderr
    assert run.lines("escaped") == [] and run.lines("error") == [], run.stdout
    assert len(run.lines("denied")) == routes, run.stdout


# ---- the escapes ---------------------------------------------------------------------


def test_probe_finds_every_control_on_this_machine(controls: confinement.Controls) -> None:
    line = controls.line()
    assert line.startswith("sandbox kernel controls: landlock v"), line
    for name in ("seccomp", f"uid {confinement.SANDBOX_UID}", "pid namespace"):
        assert name in line, line
    assert controls.landlock_abi >= 6 and controls.drops_uid and "missing" not in line


@pytest.mark.parametrize(
    "name, routes, unconfined_evidence",
    [
        ("read_parent_environ", 6, "escaped: _io.open: b'"),
        ("read_root_only_file", 3, "root-only-secret"),
        ("read_root_only_file_in_work_dir", 2, "work-dir-secret"),
        ("read_host_config", 3, "root:"),
        ("read_parent_memory", 1, "parent-memory-secret"),
    ],
)
def test_reading_outside_the_run_is_refused(
    controls, target, name, routes, unconfined_evidence
) -> None:
    assert unconfined_evidence in _run(ESCAPES[name], target, confined=False).stdout
    run = _run(ESCAPES[name], target, controls=controls)
    _assert_refused(run, routes)
    assert run.returncode == 0, run.stderr


def test_files_outside_the_work_dir_stay_unchanged(controls, target) -> None:
    victim_file = Path(target["victim_path"])
    run = _run(ESCAPES["overwrite_outside_file"], target, controls=controls)
    _assert_refused(run, 7)
    assert victim_file.read_bytes() == b"checkpoint bytes"
    assert not Path(target["victim_path"] + ".moved").exists()
    # Unconfined (as root) the same code overwrites and then removes it: the checks
    # above can fail.
    unconfined = _run(ESCAPES["overwrite_outside_file"], target, confined=False)
    assert "escaped: _io.open w: 'written'" in unconfined.stdout
    assert not victim_file.exists()


def test_no_file_can_be_created(controls, target) -> None:
    run = _run(ESCAPES["create_files"], target, controls=controls)
    _assert_refused(run, 4)
    assert not Path("/tmp", target["token"]).exists()


def test_sockets_are_refused_and_the_listener_sees_nothing(controls, target, listener) -> None:
    run = _run(ESCAPES["connect_loopback"], target, controls=controls)
    _assert_refused(run, 7)
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing queued: no connection ever arrived
    unconfined = _run(ESCAPES["connect_loopback"], target, confined=False)
    assert "escaped: _socket.socket: 'connected'" in unconfined.stdout
    listener.accept()[0].close()  # the unconfined attack's connection is there


@pytest.mark.parametrize("name, routes", [("fork_ctypes", 4), ("reimport_posix_fork_setsid", 3)])
def test_forks_are_refused_and_nothing_outlives_the_run(controls, target, name, routes) -> None:
    run = _run(ESCAPES[name], target, controls=controls)
    _assert_refused(run, routes)
    assert _none_left(target["token"])


def test_a_forked_child_that_left_the_session_outlives_an_unconfined_run(target) -> None:
    # The finding itself, so the test above can fail: without the controls the child
    # escapes the killed process group.
    run = _run(ESCAPES["reimport_posix_fork_setsid"], target, confined=False)
    assert run.lines("escaped")[0].startswith("escaped: fresh posix fork"), run.stdout
    assert _processes_with(target["token"])


def test_the_pid_namespace_alone_kills_what_escaped_the_session(controls, target) -> None:
    without_seccomp = dataclasses.replace(controls, seccomp=False)
    run = _run(ESCAPES["reimport_posix_fork_setsid"], target, controls=without_seccomp)
    assert run.lines("escaped")[0].startswith("escaped: fresh posix fork"), run.stdout
    assert _none_left(target["token"])


@pytest.mark.parametrize("name, routes", [("ptrace_parent", 2), ("io_uring", 3),
                                          ("kernel_surfaces", 10), ("exec_shell", 3)])  # fmt: skip
def test_kernel_surfaces_are_refused(controls, target, name, routes) -> None:
    run = _run(ESCAPES[name], target, controls=controls)
    _assert_refused(run, routes)
    assert "a shell ran" not in run.stdout
    assert Path(f"/proc/{os.getpid()}/status").read_text().count("TracerPid:\t0") == 1


def test_a_foreign_architecture_system_call_kills_the_run(controls, target) -> None:
    # Unconfined, the 32-bit socket call works on this kernel (IA-32 emulation is on).
    assert "escaped: i386 socket" in _run(ESCAPES["i386_syscall"], target, confined=False).stdout
    run = _run(ESCAPES["i386_syscall"], target, controls=controls)
    assert run.returncode == -signal.SIGSYS and run.lines("escaped") == [], run.stdout


def test_memory_mappings_never_open_the_whole_filesystem() -> None:
    # A memfd or SysV segment maps as "/memfd:x (deleted)": its "directory" is "/".
    fd = os.memfd_create("sluice-confinement-test")
    os.ftruncate(fd, 4096)
    with mmap.mmap(fd, 4096):
        dirs, _ = confinement._read_roots()
    os.close(fd)
    assert "/" not in dirs and sys.base_prefix in dirs


def test_signals_reach_nothing_outside_the_run(controls, target, victim) -> None:
    run = _run(ESCAPES["signal_parent"], target, controls=controls)
    _assert_refused(run, 5)
    assert run.returncode == 0 and victim.poll() is None


# Each control alone, so that none of them hides a hole in another: the run keeps only the
# named control (as root, so the others' refusals cannot help).
_ALONE = {
    "landlock": {"seccomp": False, "drops_uid": False, "uid": 0, "gid": 0},
    "uid": {"landlock_abi": 0, "seccomp": False},
    "seccomp": {"landlock_abi": 0, "drops_uid": False, "uid": 0, "gid": 0},
}


@pytest.mark.parametrize(
    "control, name, routes",
    [
        ("landlock", "read_parent_environ", 6),
        ("landlock", "read_host_config", 3),
        ("landlock", "overwrite_outside_file", 7),
        ("uid", "read_parent_environ", 6),
        ("uid", "read_root_only_file", 3),
        ("uid", "read_root_only_file_in_work_dir", 2),
        ("seccomp", "connect_loopback", 7),
        ("seccomp", "fork_ctypes", 4),
        ("seccomp", "read_parent_memory", 1),
        ("seccomp", "ptrace_parent", 2),
    ],
)
def test_each_control_alone_refuses_its_escapes(controls, target, control, name, routes) -> None:
    alone = dataclasses.replace(controls, pid_namespace=False, **_ALONE[control])
    run = _run(ESCAPES[name], target, controls=alone)
    _assert_refused(run, routes)
    assert Path(target["victim_path"]).read_bytes() == b"checkpoint bytes"
    assert _none_left(target["token"])


# ---- the run itself ------------------------------------------------------------------

_LEGITIMATE = r"""
import collections, itertools, json, math, os, re, threading
import numpy
squares = []
threads = [threading.Thread(target=lambda i=i: squares.append(i * i)) for i in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
with open("data.txt") as fh:
    words = re.findall(r"\d+", fh.read())
os.remove("payload.json")
print(json.dumps({
    "squares": sorted(squares), "sum": int(numpy.arange(10).sum()),
    "pairs": len(list(itertools.combinations(words, 2))),
    "count": collections.Counter("aab")["a"], "pi": round(math.pi, 3),
    "controls": __sluice_controls__, "uid": os.getuid(), "pid": os.getpid(),
    "left": sorted(os.listdir(".")),
}))
"""


def test_legitimate_code_still_runs_under_every_control(controls) -> None:
    run = _run(_LEGITIMATE, {})
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["squares"] == [0, 1, 4, 9] and report["sum"] == 45 and report["pairs"] == 3
    assert report["count"] == 2 and report["pi"] == 3.142
    assert report["controls"] == controls.names()
    assert report["uid"] == confinement.SANDBOX_UID and report["pid"] == 2
    assert report["left"] == ["data.txt", "secret.txt"]  # payload.json removed


def test_killing_the_group_kills_every_process_of_the_run(controls) -> None:
    token = f"sluice-kill-{secrets.token_hex(8)}"
    workdir = Path(tempfile.mkdtemp(prefix="sluice-sandbox-"))
    try:
        for kill in (lambda p: os.killpg(p.pid, signal.SIGKILL), lambda p: p.kill()):
            source = f"import time\nprint({token!r}, flush=True)\ntime.sleep(60)\n"
            process = _start(source, workdir, confined=True, controls=controls)
            assert process.stdout is not None
            assert process.stdout.readline().decode().strip() == token
            assert len(_processes_with(token)) == 3  # outer, init, runner
            kill(process)  # the group (the sandbox's timeout), or the outer alone
            process.communicate(timeout=_TIMEOUT_S)
            assert _none_left(token)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_control_that_cannot_apply_stops_the_run(controls) -> None:
    unusable = dataclasses.replace(controls, uid=2**32 - 1, gid=2**32 - 1)  # "no change"
    run = _run("print('ran')\n", {}, controls=unusable)
    assert run.returncode == confinement.SETUP_FAILED_EXIT
    assert "ran" not in run.stdout
    assert run.stderr.startswith("sluice sandbox: could not apply uid"), run.stderr


def test_the_runner_dies_like_the_sandbox_expects(controls) -> None:
    # The sandbox tells reasons apart by exit status and signal: they pass through.
    assert _run("import os\nos._exit(86)\n", {}, controls=controls).returncode == 86
    source = "import os, resource, signal\nresource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    killed = _run(source + "os.kill(os.getpid(), signal.SIGXCPU)\n", {}, controls=controls)
    assert killed.returncode == -signal.SIGXCPU


# ---- through the sandbox itself ------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_every_escape_fails_in_the_sandbox_model_code_runs_in(name, target, listener):
    """The same attacks as a program of the `python` tool (`run_python`: the guards, the
    rlimits and the kernel controls together): none escapes, the file outside keeps its
    bytes, the listener sees no connection and nothing outlives the run."""
    from sluice.engines.env.sandbox import run_python

    result = run_python(f"TARGET = {target!r}\n{ESCAPES[name]}", timeout_s=20.0)
    # It ran to its end, or seccomp killed it for a foreign architecture's system call.
    ran = "done" in result.stdout.splitlines() or result.returncode == -signal.SIGSYS
    assert ran, result.stdout + result.stderr
    assert "escaped:" not in result.stdout, result.stdout + result.stderr
    assert Path(target["victim_path"]).read_bytes() == b"checkpoint bytes"
    with pytest.raises(BlockingIOError):
        listener.accept()
    assert _none_left(target["token"])
