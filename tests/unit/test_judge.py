"""The verdict protocol (engines/env/judge.py, wire.py, channel.py): plain data crosses
exactly and boundedly, exceptions come back as builtins, problems that calls cannot
judge are counted as such, and stdin/stdout problems are judged on captured output."""

from __future__ import annotations

import math

import pytest

from sluice.engines.env.judge import CandidateError, judge, names_to_serve
from sluice.engines.env.verifiers import load_verifier, outcome_of
from sluice.engines.env.wire import (
    MAX_DEPTH,
    MAX_FRAME_BYTES,
    FrameBuffer,
    WireError,
    decode,
    encode,
    pack,
    unpack,
)


def test_plain_data_crosses_with_its_exact_types() -> None:
    value = [None, True, 3, -0.0, math.inf, "é", b"\x00", (1, [2]), {(1, 2): {3}}, frozenset({4})]
    back = decode(unpack(pack({"v": encode(value)})[4:])["v"])
    assert back == value and [type(v) for v in back] == [type(v) for v in value]
    assert math.isnan(decode(encode(math.nan)))


def test_subclasses_cross_as_their_base_type_and_other_objects_not_at_all() -> None:
    class Yes(str):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = str.__hash__

    assert type(decode(encode(Yes("no")))) is str and decode(encode(Yes("no"))) != "yes"
    with pytest.raises(WireError, match="cannot cross"):
        encode(object())


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"t": [1], "d": []}, "malformed"),  # two tags
        ({"x": []}, "unknown value tag"),
        ({"s": [[1]]}, "unhashable"),
        ({"d": [[[1], 2]]}, "unhashable"),
        ({"b": "zz"}, "malformed bytes"),
        (1 << 20000, "integer larger"),
        (nested(MAX_DEPTH + 2), "deeper"),
        (list(range(300_000)), "more than"),
    ],
    ids=[
        "two tags",
        "unknown tag",
        "list in a set",
        "list as a key",
        "bad hex",
        "huge int",
        "too deep",
        "too many parts",
    ],
)
def test_decoding_refuses_anything_but_bounded_plain_data(data: object, problem: str) -> None:
    with pytest.raises(WireError, match=problem):
        decode(data)


def test_an_oversized_frame_is_refused_from_its_header_alone() -> None:
    frames = FrameBuffer()
    with pytest.raises(WireError, match="over"):
        frames.feed((MAX_FRAME_BYTES + 1).to_bytes(4, "big") + b"{")
    with pytest.raises(WireError, match="unreadable"):
        unpack(b"[" * 100_000)


def test_the_tests_global_names_are_what_the_code_must_define() -> None:
    tests = "import math\nLIMIT = 3\ndef check(candidate):\n    assert candidate(helper(1))\n"
    assert names_to_serve(tests + "check(solve)\n", "def helper(x):\n    return x\n") == ["solve"]


def test_exceptions_come_back_as_their_builtin_type() -> None:
    code = "def f(x):\n    if x == 0:\n        raise ZeroDivisionError('zero')\n    raise OSError('os')"
    tests = (
        "try:\n    f(0)\nexcept ZeroDivisionError as e:\n    assert str(e) == 'zero'\n"
        "else:\n    raise AssertionError\n"
        "try:\n    f(1)\nexcept OSError:\n    raise AssertionError('not allow-listed')\n"
        "except Exception as e:\n    assert type(e).__name__ == 'CandidateError'\n"
    )
    assert judge(code, tests, timeout_s=5).passed
    assert CandidateError.__mro__[1] is Exception


@pytest.mark.parametrize(
    ("tests", "why"),
    [
        ("assert True", "call nothing"),  # nothing of the code's is used
        ("assert (", "do not compile"),
        ("assert f(lambda: 1) == 1", "not plain data"),  # arguments that cannot cross
    ],
)
def test_problems_calls_cannot_judge_are_unjudgeable_and_counted(tests: str, why: str) -> None:
    verdict = judge("def f(x):\n    return 1", tests, timeout_s=5)
    assert (verdict.passed, verdict.reason) == (False, "unjudgeable") and why in verdict.detail
    score = load_verifier("code", timeout_s=5)({"tests": tests}, "def f(x):\n    return 1")
    assert score == 0.0 and outcome_of(score) == "unjudgeable"


def test_stdin_stdout_problems_are_judged_on_the_captured_output_here() -> None:
    pairs = {"inputs": ["3\n"], "outputs": ["9"]}
    assert judge("print(int(input()) ** 2)", pairs, timeout_s=5).passed
    exits = "import os\nos._exit(0)"  # never printed the answer
    assert judge(exits, pairs, timeout_s=5).reason == "failed"
    crashes = "print(9)\nraise SystemExit(3)"  # right output, then a failure
    assert judge(crashes, pairs, timeout_s=5).reason == "failed"
