"""Reward verifiers: `fn(row, response_text) -> float`, one call per sampled response.

A verifier turns a response into a scalar reward and must never take the reward
worker down: garbage, empty, unicode or adversarial responses score the configured
incorrect reward (and are logged), never raise. Only *configuration* mistakes raise,
when the verifier is built (`load_verifier`), with one clear message.

Built-in verifiers:
- ``builtin``: the built-in task's rule (final answer after the last '=');
- ``math``:    `math_verify` parse + verify (boxed answers, fractions vs decimals,
               LaTeX vs plain), under a wall-clock guard because symbolic
               comparison can hang on adversarial input;
- ``code``:    judges the response's Python against the row's tests: the tests run
               in the reward process, the response's functions in the sandbox
               (`sluice.engines.env.judge`; a HumanEval row: HumanEval's prompt and
               the completion against its ``check``);
- ``reasoning_gym``: the reasoning-gym task's own ``score_answer`` on the answer the
               row's extraction finds (``<answer>`` tags, ``\\boxed{}``, last number).

A verifier may return a `Score`, a float that also says why it is what it is
(``unparsed``: no answer in the expected format; ``error``: the checker failed;
``timeout``: it ran out of time; ``unjudgeable``: a code row whose tests cannot be
judged by calls); the reward role counts them.

Rewards default to correct=1.0 / incorrect=0.0; AReaL uses +5 / -5 (`RewardScale`).
A plugin ``package.module:function`` returns its own float (a bool is mapped through
the scale); its exceptions and non-finite values score the incorrect reward.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.engines.env.answers import numeric_closeness as closeness_of
from sluice.engines.env.problems.base import Problem, PromptRow
from sluice.engines.env.problems.longtail import LongTailSum
from sluice.engines.env.problems.registry import BUILTIN_PROBLEMS

if TYPE_CHECKING:
    from sluice.engines.env.judge import CodeSandbox

log = logging.getLogger(__name__)

Verifier = Callable[[PromptRow, str], float]
"""fn(row, response_text) -> reward. Never raises on any response text."""

_MAX_LOGGED_CHARS = 120


class VerifierTimeout(Exception):
    """A verification ran past its wall-clock budget."""


@dataclass(frozen=True)
class RewardScale:
    """Rewards for verified-correct and everything-else responses."""

    correct: float = 1.0
    """Reward of a verified-correct response."""
    incorrect: float = 0.0
    """Reward of a wrong, unparsable, empty or timed-out response."""

    def __call__(self, ok: bool) -> float:
        return float(self.correct if ok else self.incorrect)


class Score(float):
    """A reward with its outcome: ``unparsed``, ``error`` or ``timeout`` (counted by the
    reward role)."""

    outcome: str

    def __new__(cls, value: float, outcome: str) -> Score:
        score = super().__new__(cls, value)
        score.outcome = outcome
        return score

    def __reduce__(self) -> tuple[Any, ...]:
        # Scores cross the reward pool's process boundary.
        return (Score, (float(self), self.outcome))


def outcome_of(value: Any) -> str | None:
    """The outcome a verifier attached to its reward (None for a plain number)."""
    return value.outcome if isinstance(value, Score) else None


def _preview(text: Any) -> str:
    shown = repr(text)
    return shown if len(shown) <= _MAX_LOGGED_CHARS else shown[:_MAX_LOGGED_CHARS] + "..."


# ------------------------------------------------------------------ wall-clock guard


def call_with_deadline(fn: Callable[[], Any], timeout_s: float) -> Any:
    """fn() or VerifierTimeout after `timeout_s` seconds of wall clock.

    In the main thread a SIGALRM timer interrupts the work itself. Elsewhere (thread
    pools) the work runs in a daemon thread that is abandoned on timeout: it cannot be
    killed, but the caller gets its answer on time. Reward workers that run untrusted
    symbolic input at scale should be processes, so the main-thread path applies.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):

        def on_alarm(signum: int, frame: Any) -> None:
            raise VerifierTimeout(f"verification exceeded {timeout_s}s")

        previous = signal.signal(signal.SIGALRM, on_alarm)
        started = time.monotonic()
        pending, _ = signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if pending:
                # Someone else's alarm was ticking: give it back what is left of it.
                left = pending - (time.monotonic() - started)
                signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    worker = threading.Thread(target=work, name="sluice-verifier", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise VerifierTimeout(f"verification exceeded {timeout_s}s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


# ------------------------------------------------------------------ built-in task


def builtin_verifier(scale: RewardScale = RewardScale()) -> Verifier:
    """The built-in task's checker, chosen by the row's `task` (default longtail_sum)."""
    checkers: dict[str, Problem] = {name: cls() for name, cls in BUILTIN_PROBLEMS.items()}
    default = LongTailSum()

    def verify_builtin(row: PromptRow, response_text: str) -> float:
        try:
            if not isinstance(response_text, str):
                log.warning(
                    "builtin verifier: response is %s, not text", type(response_text).__name__
                )
                return scale.incorrect
            problem = checkers.get(str(row.get("task", "")), default)
            return scale(problem.check_answer(row, response_text))
        except Exception as exc:  # a verifier must never take the reward worker down
            log.warning("builtin verifier failed on %s: %s", _preview(response_text), exc)
            return scale.incorrect

    return verify_builtin


# ------------------------------------------------------------------ math


def _math_gold_text(answer: str) -> str:
    # math_verify finds LaTeX inside $...$ or \boxed{}; a bare gold answer such as
    # "\frac{1}{2}" is wrapped so it parses as LaTeX, and "0.5" still parses as a number.
    stripped = answer.strip()
    if "\\" in stripped and "$" not in stripped and "boxed" not in stripped:
        return f"${stripped}$"
    return stripped


class _DropDisabledTimeoutNotice(logging.Filter):
    # math_verify warns once that its own timeout is off; ours (call_with_deadline) is on.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def math_verifier(scale: RewardScale = RewardScale(), timeout_s: float = 5.0) -> Verifier:
    """Equivalence of the response's final answer and the row's `answer` via math_verify."""
    from math_verify import parse, verify  # lazy: sympy import costs ~0.5 s

    for name in ("math_verify.parser", "math_verify.grader"):
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropDisabledTimeoutNotice) for f in target.filters):
            target.addFilter(_DropDisabledTimeoutNotice())

    def check(row: PromptRow, response_text: str) -> bool:
        # Our guard replaces math_verify's own alarm-based timeouts (which refuse to run
        # off the main thread), so both are switched off here.
        gold = parse(_math_gold_text(str(row["answer"])), parsing_timeout=None)
        if not gold:
            log.warning("math verifier: cannot parse reference answer %s", _preview(row["answer"]))
            return False
        predicted = parse(response_text, parsing_timeout=None)
        if not predicted:
            return False
        return bool(verify(gold, predicted, timeout_seconds=None))

    def verify_math(row: PromptRow, response_text: str) -> float:
        if not isinstance(response_text, str) or not response_text.strip():
            return scale.incorrect
        if "answer" not in row:
            log.warning("math verifier: row %s has no 'answer'", row.get("prompt_id"))
            return scale.incorrect
        try:
            return scale(bool(call_with_deadline(lambda: check(row, response_text), timeout_s)))
        except VerifierTimeout:
            log.warning(
                "math verifier timed out after %ss on %s", timeout_s, _preview(response_text)
            )
        except Exception as exc:
            log.warning("math verifier failed on %s: %s", _preview(response_text), exc)
        return scale.incorrect

    return verify_math


# ------------------------------------------------------------------ code

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response_text: str) -> str:
    """The last fenced code block of a response, or the whole response if none."""
    blocks = _FENCE.findall(response_text)
    return blocks[-1] if blocks else response_text


def code_verifier(
    scale: RewardScale = RewardScale(),
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    sandbox: CodeSandbox | None = None,
) -> Verifier:
    """Judge the response's code against the row's tests (`sluice.engines.env.judge`).

    Row formats: `tests` as Python source (asserts) or a list of such snippets, run in
    this process against the response's functions, which run in the sandbox; or `tests`
    as {"inputs": [...], "outputs": [...]} stdin/stdout pairs, every pair must match
    (trailing whitespace ignored). A row of the ``humaneval`` problem judges HumanEval's
    prompt completed by the response against its ``check(entry_point)``
    (`sluice.engines.env.problems.humaneval.run_tests`); it scores as
    ``Score(incorrect, "unparsed")`` when the response holds no Python program. Past the
    deadline a response scores ``Score(incorrect, "timeout")``; a row whose tests cannot
    be judged by calls ``"unjudgeable"`` (excluded and counted, never judged by exit
    status or output). `timeout_s` bounds each judgement. `sandbox`: where the code runs
    (None: the process sandbox, ``sluice.engines.env.sandbox``).
    """
    from sluice.engines.env.judge import judge
    from sluice.engines.env.problems import humaneval

    def verdict_score(row: PromptRow, code: str) -> float:
        tests = row.get("tests")
        if isinstance(tests, list) and all(isinstance(t, str) for t in tests):
            tests = "\n".join(tests)
        if not isinstance(tests, (str, dict)):
            log.warning("code verifier: row %s has no usable 'tests'", row.get("prompt_id"))
            return Score(scale.incorrect, "unjudgeable")
        verdict = judge(code, tests, timeout_s=timeout_s, memory_mb=memory_mb, sandbox=sandbox)
        if verdict.reason in ("unjudgeable", "error"):
            log.warning(
                "code verifier: row %s is %s: %s",
                row.get("prompt_id"),
                verdict.reason,
                verdict.detail,
            )
        if verdict.reason in ("timeout", "unjudgeable", "error"):
            return Score(scale.incorrect, verdict.reason)
        return scale(verdict.passed)

    def verify_humaneval(row: PromptRow, response_text: str) -> float:
        try:
            passed, outcome = humaneval.run_tests(row, response_text, sandbox, timeout_s, memory_mb)
        except Exception as exc:
            log.warning("code verifier failed on HumanEval row %s: %s", row.get("prompt_id"), exc)
            return Score(scale.incorrect, "error")
        return scale(passed) if outcome is None else Score(scale.incorrect, outcome)

    def verify_code(row: PromptRow, response_text: str) -> float:
        if isinstance(row.get(humaneval.ROW_KEY), dict):
            return verify_humaneval(row, response_text)
        if not isinstance(response_text, str) or not response_text.strip():
            return scale.incorrect
        try:
            return verdict_score(row, extract_code(response_text))
        except Exception as exc:
            log.warning("code verifier failed on %s: %s", _preview(response_text), exc)
            return scale.incorrect

    return verify_code


# ------------------------------------------------------------------ reasoning-gym


def reasoning_gym_verifier(
    scale: RewardScale = RewardScale(), timeout_s: float = 10.0, closeness: float = 0.0
) -> Verifier:
    """The reasoning-gym task's own score of the row's extracted answer.

    A task's score s in [0, 1] (partial credit where the task gives it) maps to
    ``incorrect + s * (correct - incorrect)``, plus the row's format reward when the
    answer was found in the expected format. With `closeness` κ in (0, 1), a numeric
    answer the task scores below κ·c instead scores s = κ·c, c its `numeric_closeness`
    to the row's answer (`reward.numeric_closeness`): partial credit for wrong answers
    by how far off they are, always below a right one's. An unparsable response scores the
    incorrect reward as ``Score(..., "unparsed")``; a checker that raises or runs past
    `timeout_s` (the reward pool's deadline applies on top) as ``"error"`` or
    ``"timeout"``.
    """
    # reasoning-gym takes seconds to import: a reward worker pays that when it loads the
    # verifier, not within its first call's deadline.
    import reasoning_gym  # noqa: F401

    from sluice.engines.env.problems.reasoning_gym import ROW_KEY, response_answer, score_response

    def verify_reasoning_gym(row: PromptRow, response_text: str) -> float:
        if not isinstance(row.get(ROW_KEY), dict):
            log.warning(
                "reasoning_gym verifier: row %s has no '%s' field", row.get("prompt_id"), ROW_KEY
            )
            return Score(scale.incorrect, "error")
        if not isinstance(response_text, str):
            return Score(scale.incorrect, "unparsed")
        try:
            score, outcome = call_with_deadline(
                lambda: score_response(row, response_text), timeout_s
            )
        except VerifierTimeout:
            log.warning(
                "reasoning_gym verifier timed out after %ss on %s",
                timeout_s,
                _preview(response_text),
            )
            return Score(scale.incorrect, "timeout")
        except Exception as exc:
            log.warning("reasoning_gym verifier failed on %s: %s", _preview(response_text), exc)
            return Score(scale.incorrect, "error")
        if outcome is not None:
            return Score(scale.incorrect, outcome)
        if closeness > 0 and score < 1:
            near = closeness_of(response_answer(row, response_text) or "", str(row.get("answer")))
            score = max(score, closeness * near)
        bonus = float(row[ROW_KEY].get("format_reward") or 0.0)
        return scale.incorrect + score * (scale.correct - scale.incorrect) + bonus

    return verify_reasoning_gym


# ------------------------------------------------------------------ plugins and loading


class VerifierSpecError(ValueError):
    """A verifier spec that does not name a usable verifier."""


def _wrap_plugin(fn: Callable[..., Any], spec: str, scale: RewardScale) -> Verifier:
    def verify_plugin(row: PromptRow, response_text: str) -> float:
        try:
            value = fn(row, response_text)
        except Exception as exc:
            log.warning("verifier %s raised on %s: %s", spec, _preview(response_text), exc)
            return scale.incorrect
        if isinstance(value, bool):
            return scale(value)
        try:
            reward = float(value)
        except (TypeError, ValueError):
            log.warning("verifier %s returned %s, not a number", spec, _preview(value))
            return scale.incorrect
        if not math.isfinite(reward):
            log.warning("verifier %s returned non-finite %s", spec, reward)
            return scale.incorrect
        return reward

    verify_plugin.__name__ = f"plugin:{spec}"
    return verify_plugin


def load_verifier(
    spec: str,
    *,
    correct_reward: float = 1.0,
    incorrect_reward: float = 0.0,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    sandbox: CodeSandbox | None = None,
    numeric_closeness: float = 0.0,
) -> Verifier:
    """A verifier from `spec`: "builtin", "math", "code", "reasoning_gym" or
    "package.module:function".

    `numeric_closeness` (κ in [0, 1)) is the reasoning_gym verifier's partial credit for
    wrong numeric answers (see `reasoning_gym_verifier`); other specs refuse a non-zero κ.

    `sandbox` is where the `code` verifier runs the response's code (default: the
    process sandbox); its tests run in this process (`sluice.engines.env.judge`).

    Raises VerifierSpecError naming the spec when the module cannot be imported, the
    attribute is missing, or it is not callable.
    """
    if not math.isfinite(correct_reward) or not math.isfinite(incorrect_reward):
        raise VerifierSpecError("correct_reward and incorrect_reward must be finite numbers")
    if not 0.0 <= numeric_closeness < 1.0:
        raise VerifierSpecError(
            f"numeric_closeness={numeric_closeness} must be in [0, 1): a wrong answer's "
            "partial credit stays below a right one's"
        )
    scale = RewardScale(correct=correct_reward, incorrect=incorrect_reward)
    if not isinstance(spec, str) or not spec.strip():
        raise VerifierSpecError(
            "verifier spec must be 'builtin', 'math', 'code', 'reasoning_gym' or "
            "'package.module:function'"
        )
    spec = spec.strip()
    if numeric_closeness and spec != "reasoning_gym":
        raise VerifierSpecError(
            f"numeric_closeness={numeric_closeness} is partial credit of the reasoning_gym "
            f"verifier; verifier '{spec}' scores without it"
        )
    if spec == "builtin":
        return builtin_verifier(scale)
    if spec == "math":
        return math_verifier(scale, timeout_s=timeout_s)
    if spec == "reasoning_gym":
        return reasoning_gym_verifier(scale, timeout_s=timeout_s, closeness=numeric_closeness)
    if spec == "code":
        return code_verifier(scale, timeout_s=timeout_s, memory_mb=memory_mb, sandbox=sandbox)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise VerifierSpecError(
            f"unknown verifier '{spec}': use 'builtin', 'math', 'code', 'reasoning_gym' or an "
            "import path 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module's own import-time error
        raise VerifierSpecError(
            f"verifier '{spec}': cannot import module '{module_name}' ({exc})"
        ) from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise VerifierSpecError(
                f"verifier '{spec}': module '{module_name}' has no attribute '{attr}'"
            )
        target = getattr(target, part)
    if not callable(target):
        raise VerifierSpecError(
            f"verifier '{spec}': '{attr}' is a {type(target).__name__}, not callable"
        )
    return _wrap_plugin(target, spec, scale)
