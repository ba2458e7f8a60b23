"""Tools a multi-turn episode can call, and the call format that reaches them.

A tool is a function from the text of a call to the text of its output; it raises
`ToolError` when the call is wrong (a bad expression, an unknown name), which the
episode shows the model as an error observation. The built-in ones:

- ``calculator``: integer and decimal arithmetic (``+ - * / // % **`` and brackets),
  evaluated over Python's syntax tree, never ``eval``; operands and results are bounded,
  so no call runs long or builds a huge number;
- ``python``: the call is a Python program, run in the sandbox the ``code`` verifier
  uses (`reward.sandbox`; ``run_python`` of the process or container sandbox); its
  standard output is the tool output.

User tools are imported by ``module:function`` and run by the rollout role with a
deadline (tasks/tool_runner.py). With one tool configured the whole call is its input; with
several, a call reads ``name: input`` (`route_call`).
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Collection
from decimal import ROUND_FLOOR, Decimal, DivisionByZero, InvalidOperation, localcontext
from typing import Any

ToolFn = Callable[[str], str]
"""A tool: the text of a call in, the text of its output out (raises ToolError)."""

MAX_CALL_CHARS = 512
"""Longest call text a tool is given; a longer one is refused as an error."""
MAX_DIGITS = 40
"""Largest operand or result, in digits, the calculator works with."""
MAX_EXPONENT = 64


class ToolError(Exception):
    """A call its tool cannot answer; the message is shown to the model."""


class ToolTimeout(ToolError):
    """A call that ran past its deadline (counted apart from errors)."""


def _floor_div(left: Decimal, right: Decimal) -> Decimal:
    # Python's rule (round down), not Decimal's (towards zero): -7 // 2 is -4.
    return (left / right).to_integral_value(rounding=ROUND_FLOOR)


_BINARY: dict[type[ast.operator], Callable[[Decimal, Decimal], Decimal]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: _floor_div,
    ast.Mod: lambda left, right: left - right * _floor_div(left, right),
    ast.Pow: operator.pow,
}


def _bounded(value: Decimal) -> Decimal:
    # Magnitude, not the digits the Decimal stores: 1e300 is one digit, 301 places.
    if not value.is_finite() or (value and value.adjusted() >= MAX_DIGITS):
        raise ToolError(f"number too large (over {MAX_DIGITS} digits)")
    return value


def _evaluate(node: ast.AST) -> Decimal:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(Decimal(str(node.value)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or right != int(right)):
            raise ToolError(f"exponent must be a whole number up to {MAX_EXPONENT}")
        if isinstance(node.op, ast.Pow) and left == 0 and right < 0:
            raise ToolError("division by zero")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except (DivisionByZero, InvalidOperation, ZeroDivisionError):
            raise ToolError("division by zero") from None
    raise ToolError("only numbers, + - * / // % ** and brackets")


def calculator(expression: str) -> str:
    """The value of an arithmetic expression: whole numbers exactly, others to 12
    places after the point with trailing zeros dropped (``7/2`` is ``3.5``). Every
    operand and result is below 10**MAX_DIGITS in magnitude; anything else, or any call
    it cannot answer, raises ToolError with one line, never another exception."""
    text = expression.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_CALL_CHARS:
        raise ToolError(f"expression longer than {MAX_CALL_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot read {text!r} as arithmetic") from None
    try:
        with localcontext() as context:
            # Room for every whole digit and the 12 shown after the point.
            context.prec = MAX_DIGITS + 20
            value = _evaluate(tree)
            if value == value.to_integral_value():
                return str(int(value))
            return format(value.quantize(Decimal(1).scaleb(-12)).normalize(), "f")
    except ToolError:
        raise
    except (ArithmeticError, ValueError, RecursionError, MemoryError):
        # Whatever Decimal or the tree walk refuses is the call's error, never a crash.
        raise ToolError(f"cannot compute {text!r} within {MAX_DIGITS} digits") from None


def python_tool(timeout_s: float = 5.0, memory_mb: int = 256, sandbox: Any = None) -> ToolFn:
    """A tool that runs the call as a Python program in `sandbox` (an object with
    ``run_python``, e.g. a container sandbox; None: the process sandbox); its output is
    what the program printed (an error's last line when it failed). Not a verdict."""
    from sluice.engines.env import sandbox as process_sandbox

    run_python = (sandbox or process_sandbox).run_python

    def run(code: str) -> str:
        result = run_python(code, timeout_s=timeout_s, memory_mb=memory_mb)
        if result.reason == "timeout":
            raise ToolTimeout(f"timed out after {timeout_s:g} s")
        if not result.passed:
            lines = (result.stderr or result.reason).strip().splitlines()
            raise ToolError(lines[-1] if lines else result.reason)
        return result.stdout.strip()

    return run


def route_call(call: str, names: Collection[str]) -> tuple[str, str]:
    """`(tool name, its input)` for the text of a call to one of the tools `names`.

    One tool takes the whole call; several need ``name: input`` (a name they know).
    """
    if not names:
        raise ToolError("no tools are configured")
    if len(call) > MAX_CALL_CHARS:
        raise ToolError(f"call longer than {MAX_CALL_CHARS} characters")
    if len(names) == 1:
        (name,) = names
        return name, call
    name, colon, rest = call.partition(":")
    if not colon or name.strip() not in names:
        known = ", ".join(sorted(names))
        raise ToolError(f"a call reads 'name: input' with a name among {known}")
    return name.strip(), rest.strip()
