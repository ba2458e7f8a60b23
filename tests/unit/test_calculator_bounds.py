"""The calculator bounds magnitude, not stored digits, and answers every call with its
value or one ToolError line (issue 60, low item): a float literal such as ``1e300`` is
one stored digit but 301 places, and ``1e999`` is infinity."""

from __future__ import annotations

import pytest

from sluice.engines.env.tools import MAX_DIGITS, ToolError, calculator


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("1e300**3", "too large"),  # was a 901-character answer
        ("1e999", "too large"),  # infinity: was an uncaught OverflowError
        ("-1e999", "too large"),
        ("1e300*1e300", "too large"),
        ("1e40", "too large"),  # 41 digits, written as one
        ("(-1e39)*10", "too large"),
        ("10**39*10**39", "too large"),
        ("0**-1", "division by zero"),
        ("1e-200/1e200", "too large"),  # an operand past the bound
    ],
)
def test_the_calculator_refuses_magnitudes_past_its_bound(expression: str, problem: str) -> None:
    with pytest.raises(ToolError, match=problem):
        calculator(expression)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1e39", "1" + "0" * 39),  # the largest magnitude it takes
        ("1e39+0.5", "1" + "0" * 39 + ".5"),  # was Decimal's InvalidOperation when shown
        ("-1e39-0.5", "-1" + "0" * 39 + ".5"),
        ("1e-300", "0"),  # tiny is fine: shown to 12 places
        ("2**64", "18446744073709551616"),
    ],
)
def test_the_calculator_answers_up_to_its_bound(expression: str, value: str) -> None:
    assert calculator(expression) == value
    assert len(value.lstrip("-").split(".")[0]) <= MAX_DIGITS


def test_the_calculator_raises_nothing_but_tool_errors_on_hostile_input() -> None:
    hostile = ["1e309", "9" * 500, "-" * 300 + "1", "1" + "+1" * 250, "1j", "(" * 300 + "1"]
    for expression in hostile:
        try:
            calculator(expression)
        except ToolError as err:
            assert "\n" not in str(err)
