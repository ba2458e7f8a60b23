"""Lint, format and type checks run with the suite, so CI enforces them on a fresh clone.

`mypy` covers `engines/` and `infra/` (pyproject.toml `[tool.mypy] files`): the pure
compute and the outside-world layers, where a wrong type is a wrong tensor or a wrong
URL. A cold mypy run takes ~40 s here, hence `slow`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_engines_and_infra_type_check_clean():
    result = run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout


def test_ruff_lint_clean():
    result = run(sys.executable, "-m", "ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_clean():
    result = run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr
