"""Plain data across the sandbox's pipes: bounded JSON frames, never pickle.

A verdict is computed in the trusted parent; the sandboxed child only answers calls.
What crosses is data of the builtin types HumanEval-style tests compare (None, bool,
int, float, complex, str, bytes, list, tuple, dict, set, frozenset), encoded as JSON:
None/bool/int/float/str/list as themselves, the others as a one-key object
(``{"t": [...]}`` a tuple, ``{"d": [[k, v], ...]}`` a dict, ``{"s": ...}`` a set,
``{"f": ...}`` a frozenset, ``{"b": "hex"}`` bytes, ``{"c": [re, im]}`` a complex).

Decoding builds fresh values of exactly those types, so nothing the child defines (an
object whose ``__eq__`` is always true, a ``str`` or ``int`` subclass) reaches the
parent's comparisons; encoding reads subclasses through their base type's own methods.
Everything is bounded: frame bytes, nesting depth, node count and integer size, so a
hostile answer is refused, not a hang or an out-of-memory.

This file is also part of the child's source (``engines/env/sandbox.py`` concatenates
it), so it imports the standard library only and has no ``__future__`` import.
"""

import json
import struct

MAX_FRAME_BYTES = 4 << 20
"""Largest frame either side reads (a request's arguments or a call's result)."""
MAX_DEPTH = 64
"""Deepest nesting of containers in one value."""
MAX_NODES = 200_000
"""Most values (containers and scalars) in one frame's payload."""
MAX_INT_BITS = 13_000
"""Largest integer magnitude, in bits (about 3,900 decimal digits)."""
_HEADER = struct.Struct(">I")
_SCALARS = (type(None), bool, int, float, str)


class WireError(ValueError):
    """A value or frame outside what the protocol carries."""


def _spend(budget, depth):
    """One more part of a value at `depth` (a fresh budget when None): WireError past
    the bounds."""
    if budget is None:
        budget = [MAX_NODES]
    budget[0] -= 1
    if budget[0] < 0:
        raise WireError(f"value has more than {MAX_NODES} parts")
    if depth > MAX_DEPTH:
        raise WireError(f"value nested deeper than {MAX_DEPTH}")
    return budget


def encode(value, depth=0, budget=None):
    """`value` as JSON-ready data (WireError past a bound or for another type)."""
    budget = _spend(budget, depth)
    kind = type(value)
    if value is None or kind is bool:
        return value
    if isinstance(value, int):
        number = int.__index__(value)
        if number.bit_length() > MAX_INT_BITS:
            raise WireError(f"integer larger than {MAX_INT_BITS} bits")
        return number
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, complex):
        return {"c": [complex.real.__get__(value), complex.imag.__get__(value)]}
    if isinstance(value, (bytes, bytearray)):
        return {"b": bytes(value).hex()}
    inner = depth + 1
    if isinstance(value, list):
        return [encode(item, inner, budget) for item in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"t": [encode(item, inner, budget) for item in tuple.__iter__(value)]}
    if isinstance(value, dict):
        pairs = dict.items(value)
        return {"d": [[encode(k, inner, budget), encode(v, inner, budget)] for k, v in pairs]}
    if isinstance(value, frozenset):
        return {"f": [encode(item, inner, budget) for item in frozenset.__iter__(value)]}
    if isinstance(value, set):
        return {"s": [encode(item, inner, budget) for item in set.__iter__(value)]}
    raise WireError(f"a {kind.__name__} cannot cross the sandbox boundary (plain data only)")


def decode(data, depth=0, budget=None):
    """Fresh builtin values from `encode`'s output (WireError for anything else)."""
    budget = _spend(budget, depth)
    kind = type(data)
    if kind in _SCALARS:
        if kind is int and data.bit_length() > MAX_INT_BITS:
            raise WireError(f"integer larger than {MAX_INT_BITS} bits")
        return data
    inner = depth + 1
    if kind is list:
        return [decode(item, inner, budget) for item in data]
    if kind is not dict or len(data) != 1:
        raise WireError("malformed value")
    ((tag, body),) = data.items()
    if tag == "b" and type(body) is str:
        try:
            return bytes.fromhex(body)
        except ValueError:
            raise WireError("malformed bytes") from None
    if type(body) is not list:
        raise WireError("malformed value")
    if tag == "c" and len(body) == 2 and all(type(part) in (int, float) for part in body):
        return complex(body[0], body[1])
    try:
        if tag in ("t", "s", "f"):
            items = [decode(item, inner, budget) for item in body]
            return tuple(items) if tag == "t" else set(items) if tag == "s" else frozenset(items)
        if tag == "d" and all(type(pair) is list and len(pair) == 2 for pair in body):
            return {decode(k, inner, budget): decode(v, inner, budget) for k, v in body}
    except TypeError:  # an unhashable key or member
        raise WireError("unhashable key or set member") from None
    raise WireError(f"unknown value tag {tag!r}")


def pack(message):
    """One frame: a 4-byte big-endian length, then the message as UTF-8 JSON."""
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(body)} bytes is over {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(body)) + body


def unpack(body):
    """The message of one frame's body (WireError for anything but a JSON object)."""
    try:
        message = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad JSON/UTF-8, huge ints, deep nesting
        raise WireError(f"unreadable frame ({type(exc).__name__})") from None
    if type(message) is not dict:
        raise WireError("a frame holds a JSON object")
    return message


class FrameBuffer:
    """Bytes in, whole frame bodies out; a header over `MAX_FRAME_BYTES` is refused
    before any of its body is kept."""

    def __init__(self):
        self._data = bytearray()

    def feed(self, data):
        self._data += data
        if len(self._data) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._data)
            if size > MAX_FRAME_BYTES:
                raise WireError(f"frame of {size} bytes is over {MAX_FRAME_BYTES}")

    def next(self):
        """The next whole frame's body, or None."""
        if len(self._data) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self._data)
        end = _HEADER.size + size
        if len(self._data) < end:
            return None
        body = bytes(self._data[_HEADER.size : end])
        del self._data[:end]
        self.feed(b"")  # check the next header, if it came already
        return body
