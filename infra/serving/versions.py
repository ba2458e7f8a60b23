"""Which weight versions a server takes: only newer ones, in (incarnation r, step k) order.

A run names a policy version by the trainer incarnation r that published it and its step
k (docs/design.md §2, ``sluice.infra.policy_version``). A trainer restarted from an older
durable version publishes a lower k under a higher r, so "newer" is the (r, k) order: a
lower step is taken only with a higher incarnation. Without that order a caller could set
a server back to a stale step, or label foreign weights with any number it likes.

On the wire the label of an update (``weight_version``, a string in SGLang) is either
``"r<r>/v<k>"`` (``CommittedVersion.name``'s form, with the incarnation always written)
or, as senders wrote it before incarnations reached the servers, a bare step ``"k"``
(or a JSON integer): a bare step names a version of the incarnation the server holds,
and must not be below the step it serves. The server's answers keep reporting the step
alone, which is what the tokens' ``weight_versions`` spans carry.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any

from sluice.infra.serving.request_parsing import BadRequestError

_LABEL = re.compile(r"r([0-9]{1,9})/v([0-9]{1,15})")
_STEP = re.compile(r"[0-9]{1,15}")


@dataclass(frozen=True)
class UpdateLabel:
    """An update's version: its step, and its incarnation when the label named one."""

    step: int
    incarnation: int | None

    def __str__(self) -> str:
        return str(self.step) if self.incarnation is None else f"r{self.incarnation}/v{self.step}"


def parse_label(value: Any, current_step: int) -> UpdateLabel:
    """The version an update body's ``weight_version`` names (absent: the next step of
    the incarnation served). BadRequestError for anything else."""
    if value is None:
        return UpdateLabel(current_step + 1, None)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**15:
        return UpdateLabel(value, None)
    if isinstance(value, str):
        text = value.strip()
        if _STEP.fullmatch(text):
            return UpdateLabel(int(text), None)
        match = _LABEL.fullmatch(text)
        if match:
            return UpdateLabel(int(match[2]), int(match[1]))
    raise BadRequestError(
        "weight_version must be a policy step (an integer >= 0) or 'r<incarnation>/v<step>', "
        f"got {str(value)[:60]!r}"
    )


class VersionOrder:
    """The (incarnation, step) a server serves, and the test an update must pass."""

    def __init__(self, incarnation: int = 0) -> None:
        self.incarnation = incarnation
        self._lock = threading.Lock()

    def admit(self, label: UpdateLabel, current_step: int) -> int:
        """The step to serve for ``label``; BadRequestError when it is not newer in (r, k)
        order than what is served (the same version again is taken: a retry)."""
        with self._lock:
            incarnation = self.incarnation if label.incarnation is None else label.incarnation
            if (incarnation, label.step) < (self.incarnation, current_step):
                served = f"r{self.incarnation}/v{current_step}"
                raise BadRequestError(
                    f"weight version {label} is older than the served {served}: a lower step "
                    "is taken only with a higher incarnation"
                )
            return label.step

    def served(self, label: UpdateLabel) -> None:
        """Record that ``label``'s weights are served now."""
        if label.incarnation is not None:
            with self._lock:
                self.incarnation = max(self.incarnation, label.incarnation)


def label_identity(label: str) -> tuple[int, int]:
    """(incarnation, step) of an ``r<r>/v<k>`` label (`update_label`'s form)."""
    parsed = parse_label(label, 0)
    assert parsed.incarnation is not None, label
    return parsed.incarnation, parsed.step


def update_label(target: tuple[int, int], served: tuple[int, int] | None) -> str:
    """The label a sender gives an update to ``target`` (r, k) on servers that serve
    ``served`` (r, k): the target's own when it is newer; on a lineage reset (the run
    went back to an older durable version, docs/design.md §2) its step under an
    incarnation above the served one, so the servers take it as the newer state it is."""
    incarnation, step = target
    if served is not None and target < served:
        incarnation = served[0] + 1
    return f"r{incarnation}/v{step}"
