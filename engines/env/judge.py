"""Verdicts on model-written code, computed where the code cannot reach.

`judge(code, tests)` runs the problem's tests here, in the trusted reward process.
The model's code runs in a sandboxed child that only serves calls
(``function_server.py``): every name the tests use but do not define themselves (the
function under test, e.g. ``candidate`` in HumanEval's ``check(candidate)``) becomes a
proxy here whose calls cross to the child as plain data (``wire.py``) and whose result
comes back as fresh builtin values. So nothing in the child can see the tests, the
expected values or the verdict, and nothing it returns can take part in a comparison
except as data: frame walking, ``gc.get_objects()``, always-equal objects, ``str``/
``int`` subclasses, patched builtins, ``os._exit(0)``, ``SystemExit``, printed
"passes", forged frames and late forks all score what the returned values earn.

The verdict is the tests' own outcome: they ran to the end without an exception, and
the child answered every call it was asked, within the deadline. An exception the
function raised arrives as its builtin type where it is allow-listed
(``ALLOWED_ERRORS``), otherwise as `CandidateError`, so ``assertRaises``-style tests
still work. Problems that cannot be judged this way (tests that do not compile or call
nothing of the code's, or arguments that are not plain data) are ``unjudgeable``:
excluded and counted, never judged by an exit status or printed output.

stdin/stdout problems (`tests` as ``{"inputs": [...], "outputs": [...]}``) run the
code as a program per input; the verdict compares its captured stdout here (trailing
whitespace ignored) and needs a clean exit within the deadline.
"""

from __future__ import annotations

import builtins
import contextlib
import secrets
import symtable
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from sluice.engines.env.channel import Channel, ChannelBroken, ChannelClosed
from sluice.engines.env.function_server import ALLOWED_ERRORS
from sluice.engines.env.wire import WireError, decode, encode, pack, unpack

if TYPE_CHECKING:
    from sluice.engines.env.sandbox import SandboxResult

VerdictReason = Literal[
    "passed", "failed", "timeout", "blocked", "output_limit", "protocol", "unjudgeable", "error"
]


@dataclass(frozen=True)
class Verdict:
    """The outcome of judging one response."""

    passed: bool
    """True only when every test ran to the end here and the child answered each call."""
    reason: VerdictReason
    """passed | failed (a test failed, the code did not load, the child died) | timeout |
    blocked (a sandbox guard tripped) | output_limit | protocol (the child sent what the
    protocol refuses) | unjudgeable (the problem cannot be judged by calls; excluded) |
    error (the sandbox could not start)."""
    detail: str = ""
    """One line saying why (the failing exception, the refused frame)."""
    stderr: str = ""
    """The child's stderr: its prints and tracebacks (first 1 MiB)."""
    duration_s: float = 0.0


class CodeSandbox(Protocol):
    """Where model code runs: the process sandbox (``sluice.engines.env.sandbox``, the
    module itself) or a container one (``infra/docker_sandbox.py``)."""

    def run_python(
        self,
        code: str,
        tests: str = "",
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        *,
        stdin: str = "",
    ) -> SandboxResult: ...

    def open_server(
        self, code: str, timeout_s: float = 10.0, memory_mb: int = 512
    ) -> contextlib.AbstractContextManager[Channel]: ...


class CandidateError(Exception):
    """An exception of the function under test whose type is not allow-listed."""


class _Aborted(BaseException):
    # BaseException: a test's `except Exception` must not swallow the end of the run.
    def __init__(self, reason: VerdictReason, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class _Session:
    """Calls to one child, each matched to a fresh id this side chose."""

    def __init__(self, channel: Channel, deadline: float) -> None:
        self.channel, self.deadline = channel, deadline
        self.aborted: _Aborted | None = None

    def _abort(self, reason: VerdictReason, detail: str) -> _Aborted:
        self.aborted = self.aborted or _Aborted(reason, detail)
        return self.aborted

    def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.aborted is not None:
            raise self.aborted
        call_id = secrets.token_hex(16)
        try:
            request = pack({**message, "id": call_id})
        except WireError as exc:
            raise self._abort("unjudgeable", f"arguments are not plain data: {exc}") from None
        try:
            reply = unpack(self.channel.exchange(request, self.deadline))
        except TimeoutError:
            raise self._abort("timeout", "the call ran past the deadline") from None
        except ChannelClosed:
            raise self._abort("failed", "the sandboxed process ended") from None
        except ChannelBroken as exc:
            reason: VerdictReason = "output_limit" if "output" in str(exc) else "protocol"
            raise self._abort(reason, str(exc)) from None
        except WireError as exc:
            raise self._abort("protocol", str(exc)) from None
        if reply.get("id") != call_id:
            raise self._abort("protocol", "a reply that answers no call of this run")
        if "blocked" in reply:
            raise self._abort("blocked", f"sandbox guard: {str(reply['blocked'])[:200]}")
        return reply

    def lookup(self, names: list[str]) -> dict[str, Any]:
        """The names the child's code defines: proxies for functions, values for data."""
        reply = self.ask({"op": "lookup", "names": names})
        if reply.get("load_error") is not None:
            detail = f"the code did not load: {str(reply['load_error'])[:100]}"
            raise self._abort("failed", detail)
        found = reply.get("names")
        if not isinstance(found, dict):
            raise self._abort("protocol", "a malformed lookup reply")
        bound: dict[str, Any] = {}
        for name in names:
            kind = found.get(name)
            if kind == "function":
                bound[name] = self.proxy(name)
            elif isinstance(kind, dict) and set(kind) == {"value"}:
                bound[name] = self._value(kind["value"])
        return bound

    def _value(self, data: Any) -> Any:
        try:
            return decode(data)
        except (WireError, RecursionError) as exc:
            raise self._abort("protocol", f"a refused value: {exc}") from None

    def proxy(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                sent = {"args": encode(list(args)), "kwargs": encode(kwargs)}
            except (WireError, RecursionError) as exc:
                raise self._abort("unjudgeable", f"arguments are not plain data: {exc}") from None
            reply = self.ask({"op": "call", "name": name, **sent})
            if "ok" in reply:
                return self._value(reply["ok"])
            error, message = str(reply.get("error"))[:100], str(reply.get("message", ""))[:500]
            if error in ALLOWED_ERRORS:
                raise getattr(builtins, error)(message)
            raise CandidateError(f"{error}: {message}")

        call.__name__ = call.__qualname__ = name
        return call


def names_to_serve(tests: str, setup: str = "") -> list[str]:
    """The global names `tests` reads but neither it nor `setup` binds, builtins aside:
    what the code under test must define. SyntaxError when either does not compile."""
    bound = set(dir(builtins))
    for source in (setup, tests):
        top = symtable.symtable(source, "<tests>", "exec")
        bound |= {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    wanted: dict[str, None] = {}
    tables = [symtable.symtable(tests, "<tests>", "exec")]
    while tables:
        table = tables.pop()
        for symbol in table.get_symbols():
            top_level = table.get_type() == "module"
            if symbol.is_referenced() and (top_level or symbol.is_global()):
                wanted.setdefault(symbol.get_name())
        tables.extend(table.get_children())
    return sorted(name for name in wanted if name not in bound)


def judge(
    code: str,
    tests: str | dict[str, Any],
    *,
    setup: str = "",
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    sandbox: CodeSandbox | None = None,
) -> Verdict:
    """The verdict on `code` against `tests` (see the module docstring).

    `tests`: Python source (asserts, or HumanEval's ``check(candidate)`` and its call),
    run here; or stdin/stdout pairs. `setup`: trusted source run here before the tests
    (HumanEval's prompt helpers, which its tests call). `timeout_s` bounds the whole
    judgement (the child's calls; each stdin/stdout run). Never raises for anything the
    code does; ValueError for a `code` that is not a string or a non-positive limit.
    """
    if not isinstance(code, str) or timeout_s <= 0 or memory_mb <= 0:
        raise ValueError("judge: code must be a string and timeout_s, memory_mb positive")
    if sandbox is None:
        from sluice.engines.env import sandbox as process_sandbox

        sandbox = process_sandbox  # type: ignore[assignment]
    assert sandbox is not None
    started = time.monotonic()
    if isinstance(tests, dict):
        verdict = _judge_stdio(code, tests, timeout_s, memory_mb, sandbox)
    elif isinstance(tests, str):
        verdict = _judge_calls(code, tests, setup, timeout_s, memory_mb, sandbox)
    else:
        verdict = Verdict(False, "unjudgeable", "tests are neither source nor stdin/stdout pairs")
    return Verdict(
        verdict.passed,
        verdict.reason,
        verdict.detail,
        verdict.stderr,
        round(time.monotonic() - started, 3),
    )


def _judge_calls(
    code: str, tests: str, setup: str, timeout_s: float, memory_mb: int, sandbox: CodeSandbox
) -> Verdict:
    try:
        names = names_to_serve(tests, setup)
        compiled = compile(tests, "<tests>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError) as exc:
        return Verdict(False, "unjudgeable", f"the tests do not compile: {exc}")
    if not names:
        return Verdict(False, "unjudgeable", "the tests call nothing the code defines")
    namespace: dict[str, Any] = {"__name__": "__sluice_tests__", "__builtins__": builtins}
    try:
        exec(compile(setup, "<setup>", "exec", dont_inherit=True), namespace)
    except Exception as exc:
        return Verdict(False, "unjudgeable", f"the setup failed: {type(exc).__name__}: {exc}")
    try:
        server = sandbox.open_server(code, timeout_s, memory_mb)
        channel = server.__enter__()
    except Exception as exc:
        return Verdict(False, "error", f"could not start the sandbox: {exc}")
    # From here: a container's cold start (the pool ran dry) is not the code's time.
    session = _Session(channel, time.monotonic() + timeout_s)
    try:
        try:
            namespace.update(session.lookup(names))
            exec(compiled, namespace)
        except _Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - a failing test, whatever it raised
            if isinstance(exc, KeyboardInterrupt):
                raise
            return _verdict(False, "failed", _one_line(exc), channel)
        if session.aborted is not None:  # even if a test caught it
            return _verdict(False, session.aborted.reason, session.aborted.detail, channel)
        return _verdict(True, "passed", "", channel)
    finally:
        server.__exit__(None, None, None)


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()
    return text[0][:300] if text else type(exc).__name__


def _verdict(passed: bool, reason: VerdictReason, detail: str, channel: Channel) -> Verdict:
    return Verdict(passed, reason, detail, channel.stderr.decode("utf-8", errors="replace"))


def _judge_stdio(
    code: str, tests: dict[str, Any], timeout_s: float, memory_mb: int, sandbox: CodeSandbox
) -> Verdict:
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        return Verdict(False, "unjudgeable", "stdin/stdout tests need 'inputs' and 'outputs' lists")
    if not inputs or len(inputs) != len(outputs):
        return Verdict(False, "unjudgeable", "unequal or empty inputs/outputs")
    for number, (given, expected) in enumerate(zip(inputs, outputs, strict=True)):
        result = sandbox.run_python(
            code, "", timeout_s=timeout_s, memory_mb=memory_mb, stdin=str(given)
        )
        if result.reason in ("timeout", "cpu_limit"):
            return Verdict(False, "timeout", f"input {number} ran past the deadline")
        if result.reason in ("blocked", "output_limit", "error"):
            return Verdict(False, result.reason, f"input {number}", result.stderr)
        if result.returncode != 0:
            return Verdict(False, "failed", f"input {number}: exit {result.returncode}")
        if result.stdout.rstrip() != str(expected).rstrip():
            return Verdict(False, "failed", f"input {number}: wrong output", result.stderr)
    return Verdict(True, "passed")
