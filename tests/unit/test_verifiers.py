"""Verifiers score any response text without raising, plugins load or fail with one clear
line, and the sandbox stops code that loops, forks, writes files or opens sockets."""

import threading
import time

import pytest

from sluice.engines.env.problems.longtail import LongTailSum
from sluice.engines.env.sandbox import run_python
from sluice.engines.env.verifiers import (
    VerifierSpecError,
    call_with_deadline,
    extract_code,
    load_verifier,
)

ROW = LongTailSum().make_row([7, 3, 9, 2])  # answer 21


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("a7=7b3=10c9=19d2=21", 1.0),  # the worked solution
        ("=21", 1.0),  # only the final answer is checked
        ("a7=7b3=10c9=19d2=21 ", 1.0),  # trailing space from decoding
        ("a7=7b3=10c9=19d2=20", 0.0),  # wrong answer
        ("a7=7b3=10c9=19d2=2", 0.0),  # prefix of the answer is not the answer
        ("a7=7b3=10c9=19d2=21=3", 0.0),  # the last '=' counts
        ("", 0.0),  # empty
        ("=", 0.0),  # marker without answer
        ("#$%^&*(garbage", 0.0),  # garbage
        ("ünïcødé 🙂=21", 1.0),  # unicode before a right answer
        ("🙂=２１", 0.0),  # full-width digits are not the answer
    ],
)
def test_builtin_verifier_scores_responses(response, expected):
    assert load_verifier("builtin")(ROW, response) == expected


def test_builtin_verifier_uses_the_configured_scale_and_survives_bad_rows():
    verify = load_verifier("builtin", correct_reward=5.0, incorrect_reward=-5.0)
    assert verify(ROW, "=21") == 5.0
    assert verify(ROW, "=22") == -5.0
    assert verify({}, "=21") == -5.0  # no answer in the row
    assert verify(ROW, None) == -5.0  # type: ignore[arg-type]


def test_math_verifier_accepts_equivalent_forms():
    verify = load_verifier("math")
    assert verify({"answer": "0.5"}, r"so the result is \boxed{1/2}") == 1.0
    assert verify({"answer": r"\frac{1}{2}"}, r"The answer is $0.5$") == 1.0
    assert verify({"answer": "0.5"}, r"\boxed{0.6}") == 0.0


@pytest.mark.parametrize(
    "response", ["", "   ", "\x00\x01" * 500, "🙂" * 200, r"\boxed{", "}}}{{{"]
)
def test_math_verifier_scores_garbage_as_incorrect(response):
    assert load_verifier("math", incorrect_reward=-5.0)({"answer": "0.5"}, response) == -5.0


def test_math_verifier_works_off_the_main_thread():
    verify = load_verifier("math")
    results = []
    worker = threading.Thread(
        target=lambda: results.append(verify({"answer": "0.5"}, r"\boxed{1/2}"))
    )
    worker.start()
    worker.join()
    assert results == [1.0]


@pytest.mark.parametrize("in_thread", [False, True])
def test_deadline_guard_stops_slow_work_in_and_off_the_main_thread(in_thread):
    from sluice.engines.env.verifiers import VerifierTimeout

    outcome = []

    def attempt():
        started = time.monotonic()
        try:
            call_with_deadline(lambda: time.sleep(5), 0.2)
        except VerifierTimeout:
            outcome.append(time.monotonic() - started)

    if in_thread:
        worker = threading.Thread(target=attempt)
        worker.start()
        worker.join()
    else:
        attempt()
    assert len(outcome) == 1 and outcome[0] < 2.0
    assert call_with_deadline(lambda: 42, 1.0) == 42


def test_plugin_results_map_through_the_scale(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def exact(row, text):\n    return text == row['answer']\n"
        "def partial(row, text):\n    return 0.25\n"
        "def broken(row, text):\n    raise RuntimeError('boom')\n"
        "def nan(row, text):\n    return float('nan')\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_verifier("my_rewards:exact", correct_reward=5.0)({"answer": "x"}, "x") == 5.0
    assert load_verifier("my_rewards:partial")({"answer": "x"}, "y") == 0.25
    assert load_verifier("my_rewards:broken", incorrect_reward=-5.0)({}, "y") == -5.0
    assert load_verifier("my_rewards:nan", incorrect_reward=-5.0)({}, "y") == -5.0
    with pytest.raises(VerifierSpecError, match="'NOT_CALLABLE' is a int, not callable"):
        load_verifier("my_rewards:NOT_CALLABLE")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:verify", "cannot import module 'no_such_module_xyz'"),
        ("sluice.engines.env.problems:no_such_function", "has no attribute 'no_such_function'"),
        ("mathh", "unknown verifier 'mathh'"),
        ("", "verifier spec must be"),
    ],
)
def test_bad_plugin_specs_fail_with_one_clear_error(spec, message):
    with pytest.raises(VerifierSpecError, match=message):
        load_verifier(spec)


def test_extract_code_takes_the_last_fenced_block():
    text = "first\n```python\nx = 1\n```\nthen\n```\ny = 2\n```\n"
    assert extract_code(text) == "y = 2\n"
    assert extract_code("print(1)") == "print(1)"


# ------------------------------------------------------------------ code + sandbox

SQUARE = "```python\ndef square(x):\n    return x * x\n```"


def test_code_verifier_runs_assert_tests_and_io_tests():
    verify = load_verifier("code", timeout_s=5.0, incorrect_reward=-1.0)
    assert verify({"tests": "assert square(3) == 9"}, SQUARE) == 1.0
    assert verify({"tests": ["assert square(2) == 4", "assert square(-1) == 1"]}, SQUARE) == 1.0
    assert verify({"tests": "assert square(3) == 10"}, SQUARE) == -1.0
    io_row = {"tests": {"inputs": ["2\n", "5\n"], "outputs": ["4", "25\n"]}}
    assert verify(io_row, "n = int(input())\nprint(n * n)") == 1.0
    assert verify(io_row, "print(4)") == -1.0
    assert verify({"prompt_id": "x"}, SQUARE) == -1.0  # no tests in the row
    assert verify({"tests": "assert True"}, "") == -1.0


def test_sandbox_passes_correct_code_and_reports_output():
    result = run_python(
        "def add(a, b):\n    return a + b\nprint('hi')", "assert add(2, 3) == 5", timeout_s=5
    )
    assert result.passed and result.reason == "passed"
    assert result.stdout == "hi\n"


def test_sandbox_fails_wrong_code_with_its_traceback():
    result = run_python("def add(a, b):\n    return a - b", "assert add(2, 3) == 5", timeout_s=5)
    assert not result.passed and result.reason == "failed"
    assert "AssertionError" in result.stderr


def test_sandbox_kills_an_infinite_loop_at_the_wall_clock_limit():
    started = time.monotonic()
    result = run_python("while True:\n    pass", "", timeout_s=1.0)
    assert result.reason == "timeout" and not result.passed
    assert time.monotonic() - started < 5


def test_sandbox_kills_a_sleeping_program_at_the_wall_clock_limit():
    # Sleeping uses no CPU, so only the wall clock (not RLIMIT_CPU) can stop it.
    result = run_python("import time\ntime.sleep(30)", "", timeout_s=1.0)
    assert result.reason == "timeout"


@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True:\n    os.fork()",
        "import subprocess\nsubprocess.run(['echo', 'hi'])",
        "import multiprocessing\nmultiprocessing.Process(target=print).start()",
        "import os\nos.system('echo hi')",
        "import os\ntry:\n    os.fork()\nexcept OSError:\n    pass",  # caught, still blocked
    ],
)
def test_sandbox_blocks_forks_and_subprocesses(code):
    result = run_python(code, "", timeout_s=5)
    assert result.reason == "blocked" and not result.passed


def test_sandbox_blocks_file_writes_anywhere(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("keep me")
    for code in (
        "open('out.txt', 'w').write('x')",
        f"open({str(target)!r}, 'w')",
        f"import os\nos.remove({str(target)!r})",
        f"import pathlib\npathlib.Path({str(target)!r}).write_text('gone')",
    ):
        result = run_python(code, "", timeout_s=5)
        assert result.reason == "blocked", code
    assert target.read_text() == "keep me"


@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.socket().connect(('127.0.0.1', 9))",
        "import socket\nsocket.create_connection(('127.0.0.1', 9))",
        "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9')",
    ],
)
def test_sandbox_blocks_sockets(code):
    result = run_python(code, "", timeout_s=5)
    assert result.reason == "blocked" and not result.passed


def test_sandbox_limits_memory():
    result = run_python("x = bytearray(1024 * 1024 * 1024)", "", timeout_s=5, memory_mb=256)
    assert result.reason == "memory"


def test_sandbox_needs_the_tests_to_finish_to_pass():
    # Exiting early with status 0 skips the failing test: not a pass.
    result = run_python("import os\nos._exit(0)", "assert False", timeout_s=5)
    assert not result.passed
    # A script-style exit(0) is normal; the tests still run afterwards.
    result = run_python("print('done')\nraise SystemExit(0)", "assert 1 + 1 == 2", timeout_s=5)
    assert result.passed


def test_sandbox_rejects_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", "", timeout_s=0)
    with pytest.raises(ValueError, match="strings"):
        run_python(None, "")  # type: ignore[arg-type]
