"""No docstring or comment line in the source runs past 200 characters.

A field's docstring is its description in Prefect's UI and docs/config-reference.md, and
the only explanation a reader of the code gets: a paragraph on one line is read by
scrolling sideways, and reviewed by nobody. Code lines are ruff's (100); prose may run a
little longer where a URL or a table row needs it, but not a paragraph's length.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_CHARS = 200


def prose_lines(source: str) -> set[int]:
    """Line numbers (from 1) of `source` that hold docstrings, attribute docstrings or
    comments: every string statement, and every comment token."""
    numbers: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            numbers.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            numbers.add(token.start[0])
    return numbers


def too_long(source: str) -> list[tuple[int, int]]:
    lines = source.splitlines()
    return [
        (n, len(lines[n - 1])) for n in sorted(prose_lines(source)) if len(lines[n - 1]) > MAX_CHARS
    ]


def test_no_docstring_or_comment_line_is_over_200_characters():
    found = [
        f"{path.relative_to(ROOT)}:{n} ({length} characters)"
        for folder in ("engines", "infra", "tasks", "flows")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for n, length in too_long(path.read_text())
    ]
    assert found == [], "reflow these:\n" + "\n".join(found)


def test_the_check_finds_a_long_docstring_and_comment_but_not_code():
    long = "x" * MAX_CHARS
    source = f'"""{long}"""\nvalue = 1\n"""ok"""\n# {long}\ntext = "{long}"\n'
    assert [n for n, _ in too_long(source)] == [1, 4]
