"""The child side of a verdict: run the model's code, then answer the parent's calls.

Not imported by Sluice: ``engines/env/sandbox.py`` (`server_source`) sends this file's
text, after the guards and ``wire.py``, to a fresh sandboxed interpreter, which calls
`_serve`. The tests never come here; the parent runs them and each call of the
function under test arrives as one request frame on stdin (a name, arguments as plain
data, and an id the parent chose); the child answers that id with a value or an
exception's type name on stdout. Nothing it sends is a verdict: a forged, repeated or
unasked-for frame can at most stand for the value the function could have returned.

Before the model's code runs, the protocol's descriptors are duplicated aside and
descriptor 0 becomes an empty pipe, 1 a copy of stderr, so the code's own reads and
prints cannot touch the protocol by accident. It needs no socket, fork or file write.
"""

import builtins
import contextlib
import json
import os
import sys
import traceback

ALLOWED_ERRORS = frozenset(
    {
        "ArithmeticError",
        "AssertionError",
        "AttributeError",
        "IndexError",
        "KeyError",
        "LookupError",
        "NameError",
        "NotImplementedError",
        "OverflowError",
        "RecursionError",
        "RuntimeError",
        "StopIteration",
        "TypeError",
        "UnboundLocalError",
        "UnicodeError",
        "ValueError",
        "ZeroDivisionError",
    }
)
"""Exception types the parent re-raises as the builtin of that name (any other arrives
as a generic error); kept in step with ``engines/env/judge.py``."""
_MAX_MESSAGE_CHARS = 500


def _error_name(exc):
    for cls in type(exc).__mro__:
        if cls.__name__ in ALLOWED_ERRORS and cls.__module__ == "builtins":
            return cls.__name__
    return type(exc).__name__


def _describe(exc):
    try:
        return str(exc)[:_MAX_MESSAGE_CHARS]
    except BaseException:  # a hostile __str__
        return ""


def _serve(install_guards, wire):
    """Load the model's code from ``payload.json``, then answer requests until stdin ends."""
    encode, decode, pack, unpack = wire.encode, wire.decode, wire.pack, wire.unpack
    frames, wire_error = wire.FrameBuffer(), wire.WireError
    read, write, exit_now = os.read, os.write, os._exit
    with open("payload.json", encoding="utf-8") as fh:
        payload = json.load(fh)
    os.remove("payload.json")
    sys.stdout.flush()
    requests_fd, replies_fd = os.dup(0), os.dup(1)
    empty, closed = os.pipe()
    os.close(closed)
    os.dup2(empty, 0)
    os.close(empty)
    os.dup2(2, 1)
    violations = install_guards(payload)
    namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
    load_error = None
    try:
        exec(compile(payload["code"], "<solution>", "exec"), namespace)
    except BaseException as exc:  # SystemExit at import included: the code did not load
        load_error = type(exc).__name__
        traceback.print_exc()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()

    def receive():
        while True:
            body = frames.next()
            if body is not None:
                return body
            data = read(requests_fd, 65536)
            if not data:
                exit_now(0)
            frames.feed(data)

    def reply(message):
        if violations:
            message = {"id": message.get("id"), "blocked": str(violations[0])}
        try:
            data = pack(message)
        except (wire_error, ValueError, TypeError):
            data = pack({"id": message.get("id"), "error": "OverflowError", "message": ""})
        view = memoryview(data)
        while view:
            view = view[write(replies_fd, view) :]

    def lookup(names):
        found: dict = {}
        for name in names:
            if type(name) is not str or name not in namespace:
                continue
            target = namespace[name]
            if callable(target):
                found[name] = "function"
                continue
            with contextlib.suppress(wire_error, RecursionError):
                found[name] = {"value": encode(target)}
        return found

    def call(message):
        name = message.get("name")
        target = namespace.get(name) if type(name) is str else None
        if target is None:
            raise NameError(f"name {name!r} is not defined")
        args, kwargs = decode(message.get("args")), decode(message.get("kwargs"))
        result = target(*args, **dict(kwargs))
        try:
            return encode(result)
        except (wire_error, RecursionError) as exc:
            raise _Unsendable(str(exc)) from None

    while True:
        try:
            message = unpack(receive())
        except wire_error:
            exit_now(3)
        call_id = message.get("id")
        if message.get("op") == "lookup":
            reply(
                {
                    "id": call_id,
                    "names": lookup(message.get("names") or []),
                    "load_error": load_error,
                }
            )
            continue
        try:
            answer = {"id": call_id, "ok": call(message)}
        except BaseException as exc:  # the function's own exception, SystemExit included
            answer = {"id": call_id, "error": _error_name(exc), "message": _describe(exc)}
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
        reply(answer)


class _Unsendable(Exception):
    """A result that is not plain data within the protocol's bounds."""
