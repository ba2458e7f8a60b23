"""Final answers read out of a response: ``<answer>`` tags, ``\\boxed{}``, or the last number.

Each extractor returns the answer text, or None when the response holds no answer in
that format; a None is what the verifiers count as *unparsed* (scored as incorrect,
reported apart from wrong answers, since a policy that never writes the format needs a
different fix than one that writes wrong answers).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Literal

Extraction = Literal["answer_tags", "boxed", "last_number"]
"""How the final answer is found in a response."""

EXTRACTIONS: tuple[Extraction, ...] = ("answer_tags", "boxed", "last_number")

_ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A minus sign belongs to the number only where it cannot be a binary minus ("5-3"
# ends on 3, not -3). Thousands separators are allowed in groups of three only.
_NUMBER = re.compile(r"(?:(?<![\w)\].])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_BOXED = "\\boxed"


def answer_in_tags(text: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>``; None if none or empty."""
    found = _ANSWER_TAGS.findall(text)
    if not found:
        return None
    answer = found[-1].strip()
    return answer or None


def answer_in_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces balanced); None if none,
    empty or never closed."""
    start = text.rfind(_BOXED + "{")
    if start < 0:
        return None
    depth, begin = 0, start + len(_BOXED)
    for position in range(begin, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                answer = text[begin + 1 : position].strip()
                return answer or None
    return None


def last_number(text: str) -> str | None:
    """The last integer or decimal in the text, thousands commas removed
    (``"1,234.5"`` -> ``"1234.5"``); None when there is no digit."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "answer_tags": answer_in_tags,
    "boxed": answer_in_boxed,
    "last_number": last_number,
}


def extract_answer(text: str, extraction: str) -> str | None:
    """The final answer of `text` by `extraction` (one of EXTRACTIONS); None if absent."""
    if extraction not in EXTRACTORS:
        raise ValueError(f"unknown answer extraction '{extraction}' (use {', '.join(EXTRACTIONS)})")
    if not isinstance(text, str):
        return None
    return EXTRACTORS[extraction](text)


def numeric_closeness(answer: str, gold: str) -> float:
    """How near a numeric answer is to the gold one, in [0, 1]: 1 − |a − g| / max(|g|, 1),
    floored at 0; 0 when either is not a finite number.

    The error is relative to the gold answer's size, so one wrong digit in a units place
    costs about as much in a two-digit answer as in a three-digit one: gold −4, answer
    −5 → 1 − 1/4 = 0.75; gold 111, answer 121 → 1 − 10/111 ≈ 0.910; gold 0, answer 2 →
    1 − 2/1 → 0; a sign error (gold 5, answer −5) → 1 − 10/5 → 0.
    """
    try:
        a, g = float(answer), float(gold)
    except (TypeError, ValueError):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(g)):
        return 0.0
    return max(0.0, 1.0 - abs(a - g) / max(abs(g), 1.0))


def format_answer(answer: str, extraction: str) -> str:
    """`answer` written the way `extraction` reads it back (warm-start references)."""
    if extraction == "answer_tags":
        return f"<answer>{answer}</answer>"
    if extraction == "boxed":
        return f"{_BOXED}{{{answer}}}"
    return answer
