"""docs/config-reference.md is what `python -m sluice.infra.config.reference` writes now:
a key, default or docstring changed in `infra/config/` fails here until the reference is
written again, so the reference a user reads is the config the code validates."""

from __future__ import annotations

import re
from pathlib import Path

from sluice.infra.config.reference import reference
from sluice.infra.config.run import RunConfig

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "config-reference.md"
REGENERATE = "python -m sluice.infra.config.reference > docs/config-reference.md"


def leaves(model: type, prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
            keys += leaves(annotation, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def test_the_config_reference_is_current():
    assert REFERENCE.read_text() == reference(), f"regenerate it: {REGENERATE}"


def test_the_reference_lists_every_key_with_its_docstring():
    rows = {
        line.split(" | ")[0].strip("| `"): line
        for line in reference().splitlines()
        if line.startswith("| `")
    }
    assert set(leaves(RunConfig)) <= set(rows)
    # No row lacks a description: every field has a docstring (tests/unit/test_config.py).
    assert [key for key, line in rows.items() if line.rstrip().endswith("|  |")] == []
    # Four cells a row: a pipe inside a type or a docstring is escaped.
    assert {len(re.split(r"(?<!\\)\|", line)) for line in rows.values()} == {6}
    assert (
        rows["trainer.watchdog.kl_k3.limit"].split(" | ")[2] == "`0.2`"
    )  # the section's own default
