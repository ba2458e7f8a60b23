"""Run untrusted model-written Python in a locked-down subprocess.

Two ways in, one way a child starts (`_start_child`):
- `open_server(code, ...)`: a function server (``function_server.py``) that loaded the
  code and answers calls on its stdin/stdout; `sluice.engines.env.judge` runs the tests
  in the parent against it. Every verdict comes this way.
- `run_python(code, tests, timeout_s, memory_mb, stdin=...)`: a program (the `python`
  tool's call); its stdout is the output. Its `passed` is not a verdict.

What this default runner does, in layers:
- a separate interpreter (``python -I``: no user site, no PYTHON* variables, script
  directory not on sys.path) in a fresh temporary working directory, with an
  environment that holds nothing but PATH/locale and single-threaded BLAS;
- its own session, so the whole process group is killed on the wall-clock timeout
  and again after every run;
- kernel controls under everything else (`confinement.py`, applied before the runner
  starts; `confinement.probe().line()` says which this machine offers): a PID
  namespace (the kill is total), an unprivileged uid, Landlock (read Python's
  installation and the work directory, write nothing) and a seccomp filter (no
  sockets, no new processes, no ptrace, no setsid);
- rlimits set by the runner before user code starts: address space (RLIMIT_AS), CPU
  seconds (RLIMIT_CPU), file size 0 (RLIMIT_FSIZE), no core dumps;
- Python-level guards, which give a clear SandboxViolation where the kernel would give
  a bare EPERM: process creation, sockets, opening files for writing, destructive
  filesystem calls, reading files outside the work directory and Python's installation.

Where the kernel controls are missing (`probe()` says which), code that loads native
libraries (ctypes) can step around the Python-level guards: ``reward.sandbox: auto``
then refuses to run model code outside containers, and ``docker``
(``infra/docker_sandbox.py``) runs this same runner and server inside a locked-down
container. `run_python` marks a program that ran to its end with a per-run token on stdout;
the token lives in the same process as the code, which is why no verdict reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sluice.engines.env import confinement
from sluice.engines.env.channel import MultiplexedChannel, PipeChannel

Reason = Literal[
    "passed", "failed", "timeout", "blocked", "memory", "cpu_limit", "output_limit", "error"
]

# Exit code the runner uses when user code tripped a guard (even if it caught the error).
_BLOCKED_EXIT = 86
_MAX_OUTPUT_BYTES = 1 << 20
_SERVER_FILES = ("wire.py", "function_server.py")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run."""

    passed: bool
    """True only when the code and all tests ran to completion without error."""
    stdout: str
    """Standard output (first 1 MiB), without the runner's completion token."""
    stderr: str
    """Standard error (first 1 MiB): tracebacks and guard messages."""
    reason: Reason
    """passed | failed (exception/assert) | timeout (wall clock) | blocked (guard tripped) |
    memory (MemoryError or killed for memory) | cpu_limit (RLIMIT_CPU) | output_limit
    (more than 1 MiB on stdout or stderr: stopped) | error (sandbox could not run)."""
    returncode: int | None = None
    """Exit status of the interpreter (negative = killed by that signal); None if never started."""
    duration_s: float = 0.0
    """Wall-clock seconds the subprocess ran."""


# The guards: limits and Python-level denials, installed by the runner (and by the
# function server) after it read its payload and before any user code runs.
_GUARDS = r'''
import builtins, io, json, os, resource, sys


class SandboxViolation(PermissionError):
    """Raised by every guard of the Sluice sandbox."""


def _install_guards(payload):
    violations = []

    def deny(what):
        def guard(*args, **kwargs):
            violations.append(what)
            raise SandboxViolation(f"{what} is not allowed in the Sluice sandbox")
        return guard

    mem = payload["memory_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    cpu = payload["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    import posix
    for mod in (os, posix):
        for name in ("fork", "forkpty", "vfork", "system", "popen", "posix_spawn", "posix_spawnp",
                     "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
                     "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnvp",
                     "spawnvpe", "kill", "killpg", "remove", "unlink", "rmdir", "removedirs",
                     "rename", "renames", "replace", "truncate", "ftruncate", "chmod", "chown",
                     "link", "symlink", "mkdir", "makedirs", "mkfifo", "mknod", "setuid", "setgid"):
            if hasattr(mod, name):
                setattr(mod, name, deny(f"os.{name}"))
    try:
        import _posixsubprocess
        _posixsubprocess.fork_exec = deny("subprocess")
    except ImportError:
        pass
    import subprocess
    subprocess.Popen = deny("subprocess")
    import socket, _socket

    class BlockedSocket(_socket.socket):
        # A class, not a function: stdlib modules (ssl, asyncio) subclass socket.socket.
        def __new__(cls, *args, **kwargs):
            violations.append("network access")
            raise SandboxViolation("network access is not allowed in the Sluice sandbox")

    for mod in (socket, _socket):
        mod.socket = BlockedSocket
        for name in ("socketpair", "create_connection", "create_server", "fromfd",
                     "getaddrinfo", "gethostbyname", "gethostbyname_ex"):
            if hasattr(mod, name):
                setattr(mod, name, deny("network access"))

    real_open = builtins.open
    real_os_open = os.open
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    # Reading is allowed in the work directory and Python's own installation only: not
    # the host's files (keys, credentials, other runs' data).
    readable = [os.path.realpath(p) + os.sep for p in
                {os.getcwd(), sys.prefix, sys.base_prefix, sys.exec_prefix}]

    def check_read(path):
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return
        if not any((real + os.sep).startswith(root) for root in readable):
            violations.append("reading files outside the work directory")
            raise SandboxViolation(
                "reading files outside the work directory is not allowed in the Sluice sandbox")

    def guarded_open(file, mode="r", *args, **kwargs):
        if isinstance(file, int):
            return real_open(file, mode, *args, **kwargs)
        if any(c in mode for c in "wax+"):
            violations.append("writing files")
            raise SandboxViolation("writing files is not allowed in the Sluice sandbox")
        check_read(file)
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if flags & write_flags:
            violations.append("writing files")
            raise SandboxViolation("writing files is not allowed in the Sluice sandbox")
        check_read(path)
        return real_os_open(path, flags, *args, **kwargs)

    builtins.open = guarded_open
    io.open = guarded_open
    os.open = guarded_os_open
    return violations
'''

# The program runner (`run_python`): code, then tests, then the token. The payload
# (code, tests, limits, token) arrives as a JSON file that it deletes before any user
# code runs. Its `passed` is a convenience for the `python` tool, not a verdict: the
# token lives in the same process as the code (`judge` gives verdicts).
_RUN_MAIN = r"""
def _main():
    with open("payload.json", encoding="utf-8") as fh:
        payload = json.load(fh)
    os.remove("payload.json")
    token = payload["token"]
    violations = _install_guards(payload)

    def run(source, filename):
        try:
            exec(compile(source, filename, "exec"), namespace)
        except SystemExit as exc:
            # exit(0) at the end of a script is normal; anything else is a failure.
            if exc.code not in (None, 0):
                raise

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    stdout_write = sys.__stdout__.write
    stdout_flush = sys.__stdout__.flush
    try:
        run(payload["code"], "<solution>")
        if payload["tests"]:
            run(payload["tests"], "<tests>")
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(_exit_code(violations, 1))
    sys.stdout.flush()
    if violations:
        os._exit(_exit_code(violations, 1))
    stdout_write("\n" + token + "\n")
    stdout_flush()
    os._exit(0)

def _exit_code(violations, default):
    return BLOCKED_EXIT if violations else default

_main()
"""


def _python_executable() -> str:
    return sys.executable or "python3"


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    # The group may already be gone (normal exit, nothing forked): that is success.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _collect(process: subprocess.Popen[bytes], timeout_s: float) -> tuple[bytes, bytes, bool, bool]:
    """Read both pipes until EOF, the deadline, or more than 1 MiB on either:
    ``(stdout, stderr, timed out, over the output limit)``."""
    assert process.stdout is not None and process.stderr is not None
    chunks: dict[int, bytearray] = {
        process.stdout.fileno(): bytearray(),
        process.stderr.fileno(): bytearray(),
    }
    deadline = time.monotonic() + timeout_s
    timed_out = over = False
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        selector.register(process.stderr, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in selector.select(timeout=remaining):
                data = os.read(key.fd, 65536)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                buffer = chunks[key.fd]
                room = _MAX_OUTPUT_BYTES - len(buffer)
                buffer.extend(data[:room])
                over = over or len(data) > room
            if over:  # more output than any test needs: stop the run
                break
    out, err = bytes(chunks[process.stdout.fileno()]), bytes(chunks[process.stderr.fileno()])
    return out, err, timed_out, over


def runner_source() -> str:
    """The runner script: reads ``payload.json`` from its working directory, deletes it,
    sets the limits and guards, runs the code and tests, prints the token if they passed."""
    return _GUARDS + _RUN_MAIN.replace("BLOCKED_EXIT", str(_BLOCKED_EXIT))


def server_source() -> str:
    """The function server's script: the guards, the wire format, and
    ``function_server.py``, which reads ``payload.json``, runs the code and answers calls
    on its stdin/stdout (see `sluice.engines.env.judge`)."""
    here = Path(__file__).parent
    parts = [(here / name).read_text(encoding="utf-8") for name in _SERVER_FILES]
    return "\n".join([_GUARDS, *parts, "_serve(_install_guards, sys.modules[__name__])\n"])


# The runner's whole environment: PATH and locale, and single-threaded BLAS libraries,
# which reserve per-thread arenas at import (one thread keeps numpy importable under a
# small RLIMIT_AS).
RUNNER_ENV = {
    "PATH": os.defpath,
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def make_payload(
    code: str, tests: str, timeout_s: float, memory_mb: int, stdin: str = ""
) -> dict[str, object]:
    """The runner's ``payload.json`` for one run (checked: one clear ValueError)."""
    if not isinstance(code, str) or not isinstance(tests, str) or not isinstance(stdin, str):
        raise ValueError("run_python: code, tests and stdin must be strings")
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError(
            f"run_python: timeout_s ({timeout_s}) and memory_mb ({memory_mb}) must be positive"
        )
    return {
        "code": code,
        "tests": tests,
        "token": f"__sluice_done_{secrets.token_hex(16)}__",
        "memory_bytes": int(memory_mb) * 1024 * 1024,
        "cpu_seconds": max(1, int(timeout_s + 1)),
    }


def classify(
    out: bytes,
    err: bytes,
    returncode: int | None,
    *,
    token: str,
    timed_out: bool,
    duration_s: float,
    memory_killed: bool = False,
    output_limited: bool = False,
) -> SandboxResult:
    """A ``SandboxResult`` from what a run of the runner left behind."""
    stdout = out.decode("utf-8", errors="replace")
    stderr = err.decode("utf-8", errors="replace")
    completed = stdout.rstrip("\n").endswith(token)
    if completed:
        stdout = stdout.rstrip("\n")[: -len(token)]
        stdout = stdout[:-1] if stdout.endswith("\n") else stdout
    reason: Reason
    if timed_out:
        reason = "timeout"
    elif output_limited:
        reason = "output_limit"
    elif returncode == _BLOCKED_EXIT:
        reason = "blocked"
    elif completed and returncode == 0:
        reason = "passed"
    elif returncode == -signal.SIGXCPU:
        reason = "cpu_limit"
    elif memory_killed or "MemoryError" in stderr:
        reason = "memory"
    else:
        reason = "failed"
    return SandboxResult(
        reason == "passed", stdout, stderr, reason, returncode, round(duration_s, 3)
    )


def run_python(
    code: str,
    tests: str = "",
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    *,
    stdin: str = "",
) -> SandboxResult:
    """Run `code` then `tests` (Python source, e.g. asserts) in the sandbox.

    Never raises for anything the code does; only a non-string `code`/`tests` or a
    non-positive limit raises ValueError. `stdin` is fed to the program's standard
    input (stdin/stdout style tests compare `stdout` themselves).
    """
    payload = make_payload(code, tests, timeout_s, memory_mb, stdin)
    with tempfile.TemporaryDirectory(prefix="sluice-sandbox-") as workdir:
        Path(workdir, "payload.json").write_text(json.dumps(payload), encoding="utf-8")
        # stdin comes from a file, not a pipe we write to: a program that never reads
        # its input cannot block the parent before the deadline starts counting.
        stdin_path = Path(workdir, "stdin.txt")
        stdin_path.write_text(stdin, encoding="utf-8")
        started = time.monotonic()
        try:
            with stdin_path.open("rb") as stdin_file:
                process = _start_child(workdir, runner_source(), stdin_file)
        except OSError as exc:
            return SandboxResult(False, "", f"could not start the sandbox: {exc}", "error")
        try:
            out, err, timed_out, over = _collect(process, timeout_s)
        finally:
            # Always: a grandchild that escaped the fork guard dies with its group.
            _kill_group(process)
            returncode = process.wait()
        duration_s = time.monotonic() - started
    return classify(
        out,
        err,
        returncode,
        token=str(payload["token"]),
        timed_out=timed_out,
        duration_s=duration_s,
        output_limited=over,
    )


def _start_child(workdir: str, source: str, stdin: Any) -> subprocess.Popen[bytes]:
    """The one place a sandboxed interpreter starts: ``python -I -c source`` in
    `workdir`, with nothing of this process's environment but `RUNNER_ENV`, in its own
    session (so the whole group can be killed), stdout and stderr piped; under the
    kernel controls this machine offers (`confinement.wrap`: a PID namespace, an
    unprivileged uid, Landlock and seccomp), applied before `source` runs."""
    return subprocess.Popen(
        [_python_executable(), "-I", "-c", confinement.wrap(source)],
        cwd=workdir,
        env={**RUNNER_ENV, "HOME": workdir},
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )


@contextlib.contextmanager
def open_server(code: str, timeout_s: float = 10.0, memory_mb: int = 512) -> Iterator[PipeChannel]:
    """A function server (`server_source`) that has loaded `code`, as a `PipeChannel`
    to its stdin/stdout; killed with its whole process group on exit. The channel's
    deadlines are the caller's (`sluice.engines.env.judge`); `timeout_s` sets the
    child's CPU limit. Raises OSError when the interpreter cannot start."""
    payload = make_payload(code, "", timeout_s, memory_mb)
    del payload["token"]  # the server has no use for it: nothing it prints is a verdict
    with tempfile.TemporaryDirectory(prefix="sluice-sandbox-") as workdir:
        Path(workdir, "payload.json").write_text(json.dumps(payload), encoding="utf-8")
        process = _start_child(workdir, server_source(), subprocess.PIPE)
        try:
            yield PipeChannel(process)
        finally:
            _kill_group(process)
            process.wait()
            for pipe in (process.stdin, process.stdout, process.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()


def attached_channel(fd: int) -> MultiplexedChannel:
    """The channel to a function server whose stdin and stdout are one multiplexed
    socket (a container's attach stream: ``infra/docker_sandbox.py``)."""
    return MultiplexedChannel(fd)
