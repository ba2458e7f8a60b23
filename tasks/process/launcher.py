"""Start role processes without paying Python's imports in each of them.

Every role needs torch, transformers, MLflow and Arrow. Imported by four role
processes and a server at once, that is ~3.5 s of CPU each, all of it on the cores the
roles are about to use: on two cores the async flow's first step came 6 s after the
colocated loop's. Instead the flow starts one launcher as its first act: a fresh
interpreter (`python -m sluice.tasks.process.launcher`) that imports `PRELOAD` once, while the flow
creates the MLflow run and commits version 0, and then forks each role on request
with its imports done. The rollout role forks its inference server from itself.

Fork is safe here because the launcher never runs a thread or a torch op (no OpenMP
pool exists to be copied half-alive) and a role forks its server before it starts any
thread. Where either does not hold (no fork on the platform, a process already
running threads), a fresh interpreter is started instead, as before.

The launcher and its parent speak JSON lines over the launcher's stdin/stdout:
`{"start": id, "argv": [...], "log": path, "env": {...}, "cwd": dir}` is answered by
`{"started": id, "pid": n}` and, when that child exits, `{"exited": id, "code": c}`
(negative: killed by signal -c). When the parent goes away (its end of stdin closes),
the launcher sends SIGTERM to every child still running and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

PRELOAD: tuple[str, ...] = (
    "torch",
    "transformers",
    "mlflow",
    "pyarrow",
    "fsspec",
    "sluice.infra.serving.server",
    "sluice.tasks.rollout.role",
    "sluice.tasks.reward.role",
    "sluice.tasks.train.role",
    "sluice.tasks.train.sync",
)
"""What the rollout, reward and train roles import anyway; the launcher imports it once.

Not Prefect (the evaluate role's, 1 s): every role would wait for it.
"""

PYTHON = (sys.executable, "-P")
"""How Sluice starts its own interpreters: `-P` keeps the working directory off the front
of sys.path, so a user's `tasks.py`, `sluice.py` or `infra/` there never stands in for
Sluice's modules (`working_directory_last` puts it back at the end, for plugins)."""

LAUNCHER_ENV = "SLUICE_ROLE_LAUNCHER"
"""`fresh` starts every role in a new interpreter (no launcher); the default is `fork`."""


def fork_available() -> bool:
    return hasattr(os, "fork") and os.environ.get(LAUNCHER_ENV, "fork") != "fresh"


# ---------------------------------------------------------------- the child side


def set_process_name(name: str) -> None:
    """The name `ps -o comm` and `top` show (Linux; 15 bytes), so forked roles are told apart.

    A forked child keeps the launcher's command line; this is what differs.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def run_in_child(
    target: Callable[[list[str]], Any] | str,
    argv: list[str],
    log_path: str,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    name: str | None = None,
) -> int:
    """In a freshly forked child: the caller's environment, output to `log_path`, then run.

    `target` is a function or its `module:function` name.

    Returns the exit code an interpreter running `target(argv)` would have ended with;
    the `atexit` handlers run too (MLflow and logging flush there), since the caller
    leaves with os._exit.
    """
    code = 1
    if name:
        set_process_name(name)
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
            _follow_pythonpath(env.get("PYTHONPATH", ""))
        if cwd is not None:
            os.chdir(cwd)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # never the launcher's request pipe
        os.close(null)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)  # type: ignore[attr-defined]
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        function = resolve(target) if isinstance(target, str) else target
        result = function(argv)
        code = result if isinstance(result, int) else 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
    return code


def working_directory_last() -> None:
    """Make the user's own modules in the working directory importable, after everything
    installed: a verifier or tool given as `my_module:function` imports, and a
    `tasks.py` or `engines/` there shadows nothing (processes start with `-P`)."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
        importlib.invalidate_caches()


def _follow_pythonpath(pythonpath: str) -> None:
    """Put the caller's PYTHONPATH on sys.path, as a fresh interpreter would.

    The launcher's own sys.path was fixed when it started; a caller may have extended
    PYTHONPATH since (a plugin directory for a reward function, say).
    """
    entries = [entry for entry in pythonpath.split(os.pathsep) if entry]
    for entry in reversed(entries):
        if entry not in sys.path:
            sys.path.insert(1, entry)
    importlib.invalidate_caches()


def _fork(run: Callable[[], int]) -> int:
    """Fork; the child runs `run` and leaves with its code. Returns the child's pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = run()
        finally:
            os._exit(code & 0xFF)
    return pid


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def resolve(target: str) -> Callable[[list[str]], Any]:
    """`module:function` -> the function."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def serve(stdin: IO[bytes], stdout: IO[bytes], preload: Sequence[str]) -> None:
    """The launcher's loop: fork a child per request, report starts and exits."""
    for name in preload:
        importlib.import_module(name)

    children: dict[int, str] = {}  # pid -> request id
    buffer = b""

    def reply(message: dict[str, Any]) -> None:
        stdout.write(json.dumps(message).encode() + b"\n")
        stdout.flush()

    reply({"ready": True})
    open_input = True
    while open_input or children:
        if open_input:
            readable, _, _ = select.select([stdin], [], [], 0.2)
            if readable:
                chunk = os.read(stdin.fileno(), 65536)
                if not chunk:  # the parent is gone: stop what it started
                    open_input = False
                    for pid in children:
                        _kill(pid, signal.SIGTERM)
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    request = json.loads(line)
                    pid = _fork(
                        lambda r=request: run_in_child(
                            r["target"], r["argv"], r["log"], r["env"], r["cwd"], r.get("name")
                        )
                    )
                    children[pid] = request["start"]
                    reply({"started": request["start"], "pid": pid})
        else:
            time.sleep(0.2)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in children:
                ident = children.pop(pid)
                if open_input:
                    try:
                        reply({"exited": ident, "code": _exit_code(status)})
                    except BrokenPipeError:
                        open_input = False


def _kill(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


# ---------------------------------------------------------------- the parent side


class Child:
    """A role or server process, forked or fresh, behind one small interface."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None):
        self.pid = pid
        self._popen = popen
        self._code: int | None = None
        self._exited = threading.Event()

    def _set_exit(self, code: int) -> None:
        self._code = code
        self._exited.set()

    def poll(self) -> int | None:
        if self._popen is not None:
            return self._popen.poll()
        if self._code is None and not self._exited.is_set():
            self._reap()
        return self._code

    def _reap(self) -> None:
        """Our own forked child (not the launcher's): collect its status without blocking."""
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return  # the launcher's child: its exit arrives as a message
        if pid == self.pid:
            self._set_exit(_exit_code(status))

    def signal(self, signum: int) -> None:
        if self.poll() is None:
            _kill(self.pid, signum)

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The exit code, or None if still running after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        return self.poll()

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s`; returns the exit code."""
        self.signal(signal.SIGTERM)
        code = self.wait(grace_s)
        if code is None:
            self.signal(signal.SIGKILL)
            code = self.wait(10.0)
        return code


class Launcher:
    """Parent side of one launcher process; safe to use from several threads."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._process = subprocess.Popen(
            [*PYTHON, "-m", "sluice.tasks.process.launcher", *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._lock = threading.Lock()
        self._next_id = 0
        self._pending: dict[str, tuple[threading.Event, list[int]]] = {}
        self._children: dict[str, Child] = {}
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, name="role-launcher", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            message = json.loads(line)
            if "ready" in message:
                self._ready.set()
            elif "started" in message:
                with self._lock:
                    event, box = self._pending.pop(message["started"])
                box.append(int(message["pid"]))
                event.set()
            elif "exited" in message:
                with self._lock:
                    child = self._children.pop(message["exited"], None)
                if child is not None:
                    child._set_exit(int(message["code"]))
        # The launcher is gone: nothing more will be reported for its children.
        with self._lock:
            for event, _ in self._pending.values():
                event.set()
            for child in self._children.values():
                child._set_exit(-signal.SIGKILL)
            self._children.clear()

    def start(
        self,
        argv: list[str],
        log_path: Path,
        target: str = "sluice.tasks.process.worker:main",
        name: str | None = None,
        timeout_s: float = 120.0,
    ) -> Child:
        """Fork a child running `target(argv)` (a role by default); output to `log_path`."""
        with self._lock:
            ident = str(self._next_id)
            self._next_id += 1
            event, box = threading.Event(), []
            self._pending[ident] = (event, box)
            request = {
                "start": ident,
                "target": target,
                "name": name,
                "argv": argv,
                "log": str(log_path),
                "env": dict(os.environ, PYTHONUNBUFFERED="1"),
                "cwd": os.getcwd(),
            }
            assert self._process.stdin is not None
            self._process.stdin.write(json.dumps(request).encode() + b"\n")
            self._process.stdin.flush()
        if not event.wait(timeout_s) or not box:
            raise RuntimeError(
                f"the role launcher did not start {argv[:1]} (exit {self._process.poll()})"
            )
        child = Child(box[0])
        with self._lock:
            self._children[ident] = child
        return child

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()


_launcher: Launcher | None = None
_launcher_lock = threading.Lock()


def warm_launcher() -> Launcher | None:
    """The process's launcher, started now so its imports overlap the flow's start-up.

    One per flow run (`close_launcher` at its end); it exits with this process.
    """
    global _launcher
    if not fork_available():
        return None
    with _launcher_lock:
        if _launcher is None or not _launcher.alive:
            _launcher = Launcher()
        return _launcher


def close_launcher() -> None:
    """Let the launcher exit once its roles have (a flow's end: the next run starts cold,
    so every run's clock carries its own start-up)."""
    global _launcher
    with _launcher_lock:
        if _launcher is not None:
            _launcher.close()
        _launcher = None


def start_role(argv: list[str], log_path: Path, fresh_command: list[str]) -> Child:
    """A role process, forked from the launcher, or `fresh_command` in a new interpreter."""
    launcher = warm_launcher()
    if launcher is not None:
        try:
            return launcher.start(argv, log_path, name=f"sluice-{argv[0]}" if argv else None)
        except (OSError, RuntimeError) as err:  # a broken launcher costs speed, not the run
            print(
                f"sluice: role launcher unavailable ({err}); starting a fresh interpreter",
                file=sys.stderr,
            )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "ab") as log_file:
        popen = subprocess.Popen(fresh_command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    return Child(popen.pid, popen)


def start_forked_or_fresh(
    target: Callable[[list[str]], Any],
    argv: Sequence[str],
    log_path: Path,
    fresh_command: list[str],
) -> Child:
    """A helper process of this one (the embedded server), forked while that is safe.

    Fork copies only the calling thread, so it is used only while this process runs
    no other thread: the rollout role starts its server first thing.
    """
    if fork_available() and threading.active_count() == 1:
        pid = _fork(lambda: run_in_child(target, list(argv), str(log_path), name="sluice-server"))
        return Child(pid)
    with open(log_path, "ab") as log_file:
        popen = subprocess.Popen(fresh_command, stdout=log_file, stderr=subprocess.STDOUT)
    return Child(popen.pid, popen)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when roles stop
    working_directory_last()
    serve(sys.stdin.buffer, sys.stdout.buffer, preload=sys.argv[1:])
