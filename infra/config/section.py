"""The base every config section derives from, so that all of them treat keys alike."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated, and each
    field's docstring is its description (Prefect's UI, the MLflow params and
    docs/config-reference.md show it)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )
