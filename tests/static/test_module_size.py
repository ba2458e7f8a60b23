"""No source module outside tests grows past ~500 lines: one concept a module."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 500


def test_no_source_module_is_over_500_lines():
    too_long = {
        str(path.relative_to(ROOT)): n
        for folder in ("engines", "infra", "tasks", "flows")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert too_long == {}, f"split these: {too_long}"
