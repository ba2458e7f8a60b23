"""Kernel controls under the process sandbox's Python guards.

Python-level guards patch names; model code reaches the same system calls through
``_io``, a re-imported ``posix`` or ``ctypes``, so the kernel must refuse them.
``wrap(runner_source)`` is the source ``python -I -c`` runs instead of the runner: it
applies the controls, then executes the runner (same interpreter, ``__main__``'s globals
emptied). ``probe()`` tries them for real in a child; ``probe().line()`` says which.

Controls, in the order they are applied, and why that order:

1. **PID namespace** (root; ``unshare(CLONE_NEWPID | CLONE_NEWNS)``). The started process
   (the *outer*) forks an *init* (pid 1 of the namespace), which mounts a fresh ``/proc``
   (only the namespace's processes are visible) and forks the *runner* (pid 2, ordinary
   signal semantics). The runner inherits the stdio pipes; init and outer close theirs
   and pass its exit status (or killing signal) up. When init exits the kernel kills
   every process left in the namespace; the sandbox's ``killpg`` still reaches all three,
   and init dies with the outer (``PR_SET_PDEATHSIG``). First: it needs root.
2. **Reachable installation** (root, mount namespace private to the run): a dedicated uid
   cannot pass directories such as ``/root`` (0700) that hold Python's installation; a
   tmpfs is laid over such a directory inside the run's mount namespace and the needed
   directories bound back at their own paths. Everything else under it disappears.
3. **Dedicated uid/gid** (root only; 65534 unless configured), no supplementary groups:
   files owned by root with mode 0600 become unreadable, other users' processes cannot
   be signalled or traced, ``RLIMIT_NPROC`` binds. The work directory (the cwd) is handed
   to that uid first so the runner can delete ``payload.json``. After the mounts (which
   need root), before Landlock and seccomp (``setgroups``/``setuid`` need no filter hole).
4. **Landlock** (ABI as the kernel reports; every filesystem right of that ABI handled):
   read-only on Python's installation (prefixes, the executable's directory), the
   directories of the shared libraries already mapped and the system library directories
   (``import numpy`` loads from ``site-packages`` and ``/lib``), ``/etc/ld.so.cache``;
   read, list and remove-file in the work directory; nothing else: no ``/proc``, ``/etc``,
   homes, checkpoints or shards, no writes, truncation, links, renames or device ioctls.
   ABI >= 4: TCP bind and connect denied. ABI >= 6: signals and abstract unix sockets
   scoped to the run. Rules are gathered as root, enforced after the uid drop.
5. **seccomp** (classic BPF, x86-64 only; a foreign architecture or an x32 system call
   kills or is refused): last, because steps 1-4 need calls it refuses. EPERM for
   socket, socketpair (all families: asyncio's self-pipe goes too), clone without
   CLONE_THREAD or with any namespace flag, fork, vfork, execve, execveat, ptrace,
   process_vm_readv/writev, kcmp, pidfd_getfd, setsid, setpgid, unshare, setns, mount,
   umount2, pivot_root, chroot, the new mount API (fsopen, fsconfig, fsmount, fspick,
   open_tree, move_mount, mount_setattr), bpf, perf_event_open, keyctl, add_key,
   request_key, io_uring_setup/enter/register, userfaultfd, kexec_load,
   kexec_file_load, init_module, finit_module, delete_module, open_by_handle_at,
   name_to_handle_at, swapon, swapoff, reboot, acct, quotactl, syslog, iopl, ioperm,
   vhangup, lookup_dcookie, and ioctl(TIOCSTI); ENOSYS for clone3, so glibc falls back
   to clone and threads still start.

What stays open: the runner's pipes, reading Python's installation and the system
libraries, CPU and memory up to the runner's rlimits, threads, signals to itself, the
clock. What is missing (no Landlock, not x86-64, not root) is named by
``probe().line()``; the runner finds the active controls' names in
``__sluice_controls__``. A control the probe found that cannot be applied stops the run
(one line on stderr, exit status 87): never a silently weaker run. This file is also the
head of the child's ``-c`` source (``wrap`` embeds it): stdlib only, no side effects.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import functools
import json
import os
import platform
import select
import signal
import sys
from dataclasses import dataclass

SANDBOX_UID = 65534
"""The dedicated uid/gid a root parent drops the runner to (``nobody`` by default)."""
SETUP_FAILED_EXIT = 87
"""Exit status of a wrapped run whose expected control could not be applied."""

_CLONE_NEWNS, _CLONE_NEWPID, _CLONE_THREAD = 0x00020000, 0x20000000, 0x00010000
_CLONE_NAMESPACES = 0x7E020000  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38
_SYS_LANDLOCK_CREATE, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT = 444, 445, 446
_SYS_SECCOMP, _SYS_CLONE, _SYS_CLONE3, _SYS_IOCTL, _TIOCSTI = 317, 56, 435, 16, 0x5412
# Landlock filesystem rights: bits 0-12 since ABI 1, REFER (13) ABI 2, TRUNCATE (14)
# ABI 3, IOCTL_DEV (15) ABI 5. ABI 4 adds TCP bind/connect, ABI 6 scoping; ABI 7 adds
# only logging flags, so a newer kernel is used with the rights known here.
_LL_READ_FILE, _LL_READ_DIR, _LL_REMOVE_FILE = 1 << 2, 1 << 3, 1 << 5
_AUDIT_ARCH_X86_64, _X32_SYSCALL_BIT = 0xC000003E, 0x40000000
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_EPERM, _ENOSYS = 1, 38
# x86-64 numbers of the calls refused with EPERM (names in the module docstring).
_DENIED_SYSCALLS = (
    41, 53, 57, 58, 59, 322, 101, 310, 311, 312, 438, 112, 109, 272, 308, 165, 166, 155,
    161, 430, 431, 432, 433, 428, 429, 442, 321, 298, 250, 248, 249, 425, 426, 427, 323,
    246, 320, 175, 313, 176, 304, 303, 167, 168, 169, 163, 179, 103, 172, 173, 153, 212,
)  # fmt: skip


@dataclass(frozen=True)
class Controls:
    """Which kernel controls a wrapped run gets on this machine (see ``probe``)."""

    landlock_abi: int
    """Landlock ABI version enforced (0: none)."""
    seccomp: bool
    """True when the x86-64 system-call filter is installed."""
    uid: int | None
    """The uid the runner runs as (None: not known, the probe failed)."""
    gid: int | None
    """The gid the runner runs as."""
    drops_uid: bool
    """True when the wrapper starts as root and drops to ``uid``/``gid``."""
    pid_namespace: bool
    """True when the run lives in its own PID namespace."""
    missing: tuple[tuple[str, str], ...] = ()
    """(control, why) for every control this machine does not give."""

    @property
    def complete(self) -> bool:
        """True when every control is active: the process sandbox isolates."""
        return not self.missing

    def names(self) -> list[str]:
        """The active controls, as the runner sees them in ``__sluice_controls__``."""
        active = [f"landlock v{self.landlock_abi}"] if self.landlock_abi else []
        active += ["seccomp"] if self.seccomp else []
        active += [f"uid {self.uid}"] if self.uid not in (None, 0) else []
        return active + (["pid namespace"] if self.pid_namespace else [])

    def line(self) -> str:
        """The one line the sandbox logs at start-up."""
        text = "sandbox kernel controls: " + (", ".join(self.names()) or "none")
        if self.missing:
            text += "; missing: " + "; ".join(f"{name} ({why})" for name, why in self.missing)
        return text


def wrap(runner_source: str, controls: Controls | None = None) -> str:
    """Source for ``python -I -c`` that confines itself, then runs ``runner_source``.

    ``controls`` defaults to ``probe()``; each control it names must apply in the child,
    or the child stops with ``SETUP_FAILED_EXIT`` (a weaker run never passes silently).
    """
    c = probe() if controls is None else controls
    drop = c.drops_uid
    plan: dict[str, object] = dict(landlock=c.landlock_abi > 0, seccomp=c.seccomp, strict=True)
    plan.update(uid=c.uid if drop else None, gid=c.gid if drop else None, pidns=c.pid_namespace)
    return f"{_own_source()}\n_enter({runner_source!r}, **{plan!r})\n"


_PROBE_RUNNER = "import json, sys\nsys.stdout.write(json.dumps(__sluice_probe__))\n"


@functools.cache
def probe(uid: int = SANDBOX_UID, gid: int = SANDBOX_UID, timeout_s: float = 20.0) -> Controls:
    """Try every control in a child exactly as ``wrap`` applies them (cached per process).

    The child is a real wrapped run in a temporary work directory; what it applied is
    what the sandbox gets. If the probe itself fails, every control is missing (why).
    """
    import subprocess
    import tempfile

    plan = dict(landlock=True, seccomp=True, uid=uid, gid=gid, pidns=True, strict=False)
    source = f"{_own_source()}\n_enter({_PROBE_RUNNER!r}, **{plan!r})\n"
    try:
        with tempfile.TemporaryDirectory(prefix="sluice-confinement-probe-") as workdir:
            done = subprocess.run(
                [sys.executable or "python3", "-I", "-c", source],
                cwd=workdir,
                env={"PATH": os.defpath, "LC_ALL": "C.UTF-8"},
                capture_output=True,
                timeout=timeout_s,
                start_new_session=True,
                check=False,
            )
        report = json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError) as exc:
        why = f"probe failed: {type(exc).__name__}: {exc}"
        names = ("landlock", "seccomp", "uid", "pid namespace")
        return Controls(0, False, None, None, False, False, tuple((n, why) for n in names))
    report["missing"] = tuple((name, why) for name, why in report["missing"])
    return Controls(**report)


@functools.lru_cache(maxsize=1)
def _own_source() -> str:
    # Without the module docstring: the child's argv is bounded (128 KiB an argument).
    with open(__file__, encoding="utf-8") as fh:
        text = fh.read()
    return text[text.index("from __future__ import annotations") :]


# ---- Everything below runs in the child, before the runner. -----------------------------


class _Libc:
    """The libc entry points the controls need, raising OSError like ``os`` does."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(None, use_errno=True)

    def call(self, name: str, *args: object) -> int:
        result = int(getattr(self.lib, name)(*args))
        if result == -1:
            err = ctypes.get_errno()
            raise OSError(err, f"{name}: {os.strerror(err)}")
        return result

    def syscall(self, number: int, *args: object) -> int:
        return self.call("syscall", ctypes.c_long(number), *args)

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int) -> None:
        encoded = [None if s is None else s.encode() for s in (source, target, fstype)]
        self.call("mount", *encoded, ctypes.c_ulong(flags), None)

    def prctl(self, option: int, value: int) -> None:
        zero = ctypes.c_ulong(0)
        self.call("prctl", ctypes.c_int(option), ctypes.c_ulong(value), zero, zero, zero)


def _close_stdio() -> None:
    # The runner holds the pipes; the processes that only wait must not keep them open.
    for fd in (0, 1):
        with contextlib.suppress(OSError):
            os.close(fd)


def _wait_status(pid: int) -> int:
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:  # not ours to wait for: report a plain failure
        return 1 << 8


def _leave_like(status: int) -> None:
    """End this process the way the runner ended: its exit code or its killing signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError, RuntimeError):  # SIGKILL, SIGSTOP
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _enter_pid_namespace(libc: _Libc) -> int:
    """Split into outer -> init (pid 1 of a new namespace); only init returns, with the
    pipe on which it hands the runner's wait status to the outer."""
    libc.call("unshare", ctypes.c_int(_CLONE_NEWPID | _CLONE_NEWNS))
    # Mounts made for the run must not propagate back to the host.
    libc.mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    alive_r, alive_w = os.pipe()  # init sees EOF here once the outer is gone
    status_r, status_w = os.pipe()  # init hands the runner's wait status up
    pid = os.fork()
    if pid:  # the outer: the process the sandbox started and will kill
        os.close(alive_r)
        os.close(status_w)
        _close_stdio()
        libc.prctl(_PR_SET_DUMPABLE, 0)  # relaying a SIGSYS or SIGXCPU dumps no core
        init_status = _wait_status(pid)
        relayed = os.read(status_r, 32)
        _leave_like(int(relayed) if relayed else init_status)
    os.close(alive_w)
    os.close(status_r)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([alive_r], [], [], 0)[0]:  # the outer died before the line above
        os._exit(1)
    os.close(alive_r)
    libc.mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    return status_w


def _become_init(status_w: int) -> None:
    """Fork the runner; in init, wait for it, report its status and exit (the kernel then
    kills whatever else is left in the namespace)."""
    pid = os.fork()
    if pid:
        _close_stdio()
        os.write(status_w, str(_wait_status(pid)).encode())
        os._exit(0)
    os.close(status_w)


def _read_roots() -> tuple[list[str], list[str]]:
    """Directories and files the runner may read: Python's installation, the libraries
    already mapped, the system library directories."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)}
    dirs.update(("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib"))
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            parts = line.split(None, 5)
            # Files only: "/memfd:x (deleted)" or "/SYSV..." would name "/" itself.
            if len(parts) == 6 and os.path.isfile(parts[5].rstrip("\n")):
                dirs.add(os.path.dirname(parts[5].rstrip("\n")))
    real = {os.path.realpath(d) for d in dirs if d and os.path.isdir(d)} - {"/"}
    files = [f for f in ("/etc/ld.so.cache",) if os.path.isfile(f)]
    return sorted(real), files


def _make_reachable(libc: _Libc, paths: list[str], uid: int, gid: int) -> None:
    """Lay a tmpfs over each ancestor ``uid`` cannot pass and bind the needed directories
    back at their own paths (root, inside the run's private mount namespace)."""

    def passable(directory: str) -> bool:
        st = os.stat(directory)
        bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
        return bool(st.st_mode & bit)

    os.umask(0o022)
    blockers: dict[str, list[str]] = {}
    for path in paths:
        parts = path.strip("/").split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            ancestor = "/" + "/".join(parts[:depth])
            if not passable(ancestor):
                blockers.setdefault(ancestor, []).append(path)
                break
    for blocker, needed in sorted(blockers.items()):
        tops = [p for p in needed if not any(p.startswith(q + "/") for q in needed)]
        fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for p in tops}
        libc.mount("tmpfs", blocker, "tmpfs", _MS_NOSUID | _MS_NODEV)
        os.chmod(blocker, 0o755)
        for path, fd in fds.items():
            os.makedirs(path, mode=0o755, exist_ok=True)
            libc.mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
            os.close(fd)


def _landlock_ruleset(libc: _Libc, abi: int, work_fd: int) -> int:
    """A ruleset fd: every filesystem right of ``abi`` handled, read-only rules on the
    read roots, read + remove-file on the work directory, TCP denied, scopes set."""
    # The rights are bits 0..12 (ABI 1), then 13 (ABI 2), 14 (ABI 3), 15 (ABI 5).
    handled_fs = (1 << (16 if abi >= 5 else 15 if abi >= 3 else 14 if abi >= 2 else 13)) - 1
    handled_net = 0b11 if abi >= 4 else 0  # BIND_TCP | CONNECT_TCP, no rule grants them
    scoped = 0b11 if abi >= 6 else 0  # ABSTRACT_UNIX_SOCKET | SIGNAL
    attr = (ctypes.c_uint64 * 3)(handled_fs, handled_net, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(_SYS_LANDLOCK_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), 0)

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    def allow(fd: int, access: int) -> None:
        rule = PathBeneath(access & handled_fs, fd)
        libc.syscall(_SYS_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0)

    dirs, files = _read_roots()
    for path in dirs + files:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            allow(fd, _LL_READ_FILE | (_LL_READ_DIR if os.path.isdir(path) else 0))
        finally:
            os.close(fd)
    allow(work_fd, _LL_READ_FILE | _LL_READ_DIR | _LL_REMOVE_FILE)
    return ruleset


def _seccomp_program() -> bytes:
    """The BPF filter of the module docstring as sock_filter records; a jump names the
    block it goes to, and blocks lie in the order written."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    Op = tuple[int, int | str, int | str, int]
    blocks: dict[str, list[Op]] = {
        "check": [
            (ld, 0, 0, 4),  # seccomp_data.arch
            (jeq, 0, "kill", _AUDIT_ARCH_X86_64),
            (ld, 0, 0, 0),  # seccomp_data.nr
            (jge, "eperm", 0, _X32_SYSCALL_BIT),
            *[(jeq, "eperm", 0, nr) for nr in _DENIED_SYSCALLS],
            (jeq, "enosys", 0, _SYS_CLONE3),
            (jeq, "clone", 0, _SYS_CLONE),
            (jeq, "ioctl", "allow", _SYS_IOCTL),
        ],
        "clone": [
            (ld, 0, 0, 16),  # args[0] (flags), low 32 bits
            (jset, "eperm", 0, _CLONE_NAMESPACES),
            (jset, "allow", "eperm", _CLONE_THREAD),
        ],
        "ioctl": [(ld, 0, 0, 24), (jeq, "eperm", "allow", _TIOCSTI)],  # args[1]: request
        "allow": [(ret, 0, 0, _RET_ALLOW)],
        "eperm": [(ret, 0, 0, _RET_ERRNO | _EPERM)],
        "enosys": [(ret, 0, 0, _RET_ERRNO | _ENOSYS)],
        "kill": [(ret, 0, 0, _RET_KILL_PROCESS)],
    }
    starts: dict[str, int] = {}
    program: list[Op] = []
    for name, block in blocks.items():
        starts[name] = len(program)
        program += block
    out = bytearray()
    for index, (op, jt, jf, k) in enumerate(program):
        jumps = [starts[j] - index - 1 if isinstance(j, str) else j for j in (jt, jf)]
        out += op.to_bytes(2, "little") + bytes(jumps) + k.to_bytes(4, "little")
    return bytes(out)


def _install_seccomp(libc: _Libc) -> None:
    program = _seccomp_program()
    filters = ctypes.create_string_buffer(program, len(program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program) // 8, ctypes.addressof(filters))
    # SECCOMP_SET_MODE_FILTER with SECCOMP_FILTER_FLAG_TSYNC: every thread, or none.
    libc.syscall(_SYS_SECCOMP, 1, 1, ctypes.byref(fprog))


def _enter(
    runner_source: str,
    *,
    landlock: bool,
    seccomp: bool,
    uid: int | None,
    gid: int | None,
    pidns: bool,
    strict: bool,
) -> None:
    """Apply the planned controls in order (module docstring), then run the runner;
    ``strict``: a planned control that fails stops the run (else it is reported)."""
    libc = _Libc()
    missing: list[tuple[str, str]] = []

    def fail(name: str, why: str) -> None:
        if strict:
            sys.stderr.write(f"sluice sandbox: could not apply {name}: {why}\n")
            sys.stderr.flush()
            os._exit(SETUP_FAILED_EXIT)
        missing.append((name, why))

    root, in_pidns = os.geteuid() == 0, False
    if pidns and root:
        try:
            _become_init(_enter_pid_namespace(libc))
            in_pidns = True
        except OSError as exc:
            fail("pid namespace", str(exc))
    elif pidns:
        fail("pid namespace", "needs root")
    ids = (uid, gid) if root and uid is not None and gid is not None else None
    work_fd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    if ids:
        try:
            if not in_pidns:  # the mounts below need a mount namespace of their own
                libc.call("unshare", ctypes.c_int(_CLONE_NEWNS))
                libc.mount(None, "/", None, _MS_REC | _MS_PRIVATE)
            _make_reachable(libc, _read_roots()[0] + [os.path.realpath(".")], *ids)
        except OSError as exc:
            fail("uid", f"cannot make Python reachable for uid {ids[0]}: {exc}")
            ids = None
    abi, ruleset = 0, -1
    if landlock:
        try:
            abi = libc.syscall(_SYS_LANDLOCK_CREATE, None, ctypes.c_size_t(0), 1)
            ruleset = _landlock_ruleset(libc, abi, work_fd)
        except OSError as exc:
            fail("landlock", str(exc))
    if ids:
        try:
            os.chown(".", *ids)  # the cwd: the run's work directory
            os.setgroups([])
            os.setresgid(ids[1], ids[1], ids[1])
            os.setresuid(ids[0], ids[0], ids[0])
        except OSError as exc:
            fail("uid", str(exc))
    dropped = bool(ids) and os.getresuid() == (uid,) * 3 and not os.getgroups()
    if ids and not dropped:
        fail("uid", f"still uid {os.getuid()} after the drop")
    landlock_active = 0
    try:
        libc.prctl(_PR_SET_NO_NEW_PRIVS, 1)
        if ruleset >= 0:
            libc.syscall(_SYS_LANDLOCK_RESTRICT, ruleset, 0)
            landlock_active = abi
    except OSError as exc:
        fail("landlock", str(exc))
    finally:
        for fd in (ruleset, work_fd):
            if fd >= 0:
                os.close(fd)
    seccomp_active = False
    if seccomp and platform.machine() != "x86_64":
        fail("seccomp", f"the filter is written for x86-64, this is {platform.machine()}")
    elif seccomp:
        try:
            _install_seccomp(libc)
            seccomp_active = True
        except OSError as exc:
            fail("seccomp", str(exc))
    active = Controls(landlock_active, seccomp_active, os.getuid(), os.getgid(), dropped, in_pidns)
    # The runner gets __main__'s globals, emptied of this module's names.
    fresh = {"__name__": "__main__", "__builtins__": builtins}
    fresh["__sluice_controls__"] = active.names()
    fresh["__sluice_probe__"] = dict(vars(active), missing=missing)
    namespace = sys.modules["__main__"].__dict__
    code = compile(runner_source, "<string>", "exec")  # as under plain `python -c`
    namespace.clear()
    namespace.update(fresh)
    exec(code, namespace)
