"""What a decode step and a prefill cost on this server, measured while it serves.

The capacity planner (``sluice.engines.planner``) models a decode step of b resident
sequences holding c context tokens as ``a + r*b + d*c`` seconds and a prefill as
``p`` seconds per token. ``StepProfile`` keeps the sufficient statistics of a
least-squares fit of those lines (sums of x xᵀ and x t, x = (1, b, c)), so a run
of any length is summarised in a few numbers that add across servers and restarts,
and a coarse table by batch size (steps, seconds, rows per power-of-two bucket) for
reading decode throughput by batch size directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DECODE_TERMS = ("step", "rows", "context")
"""The regressors of a decode step's time, in the order of the sums below."""


def bucket_of(rows: int) -> int:
    """The power-of-two bucket a decode step of ``rows`` sequences is counted in (1, 2, 4 …)."""
    return 1 << max(0, rows - 1).bit_length() if rows > 1 else 1


@dataclass
class StepProfile:
    """Running sums over measured decode steps and prefills (see the module docstring)."""

    xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    """Σ x xᵀ over decode steps, x = (1, rows, context tokens)."""
    xt: list[float] = field(default_factory=lambda: [0.0] * 3)
    """Σ x t over decode steps, t in seconds."""
    tt: float = 0.0
    """Σ t² over decode steps (for the fit's residual)."""
    by_rows: dict[int, list[float]] = field(default_factory=dict)
    """bucket -> [steps, seconds, rows]."""
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    prefill_calls: int = 0
    prefill_xx: list[float] = field(default_factory=lambda: [0.0, 0.0])
    """Σ tokens² and Σ tokens·t over admissions: with the counts above, the sums of the
    fit t = a_p + p·tokens per admission (a fixed cost per pass, then per token)."""

    def add_decode(self, rows: int, context_tokens: int, seconds: float) -> None:
        x = (1.0, float(rows), float(context_tokens))
        for i in range(3):
            self.xt[i] += x[i] * seconds
            row = self.xx[i]
            for j in range(3):
                row[j] += x[i] * x[j]
        self.tt += seconds * seconds
        cell = self.by_rows.setdefault(bucket_of(rows), [0.0, 0.0, 0.0])
        cell[0] += 1
        cell[1] += seconds
        cell[2] += rows

    def add_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill_tokens += tokens
        self.prefill_s += seconds
        self.prefill_calls += 1
        self.prefill_xx[0] += float(tokens) * tokens
        self.prefill_xx[1] += tokens * seconds

    @property
    def decode_steps(self) -> int:
        return int(self.xx[0][0])

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (bucket keys become strings)."""
        return {
            "xx": [list(r) for r in self.xx],
            "xt": list(self.xt),
            "tt": self.tt,
            "by_rows": {str(k): list(v) for k, v in sorted(self.by_rows.items())},
            "prefill_tokens": self.prefill_tokens,
            "prefill_s": self.prefill_s,
            "prefill_calls": self.prefill_calls,
            "prefill_xx": list(self.prefill_xx),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepProfile:
        try:
            profile = cls(
                xx=[[float(v) for v in r] for r in data["xx"]],
                xt=[float(v) for v in data["xt"]],
                tt=float(data["tt"]),
                by_rows={int(k): [float(v) for v in c] for k, c in data["by_rows"].items()},
                prefill_tokens=int(data["prefill_tokens"]),
                prefill_s=float(data["prefill_s"]),
                prefill_calls=int(data["prefill_calls"]),
                prefill_xx=[float(v) for v in data.get("prefill_xx", [0.0, 0.0])],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a step profile: {type(exc).__name__}: {exc}") from None
        if len(profile.xx) != 3 or any(len(r) != 3 for r in profile.xx) or len(profile.xt) != 3:
            raise ValueError("not a step profile: xx must be 3x3 and xt 3 long")
        return profile

    def merged(self, other: StepProfile) -> StepProfile:
        """The profile of both servers' (or both lives') steps together."""
        by_rows = {k: list(v) for k, v in self.by_rows.items()}
        for k, cell in other.by_rows.items():
            mine = by_rows.setdefault(k, [0.0, 0.0, 0.0])
            for i in range(3):
                mine[i] += cell[i]
        return StepProfile(
            xx=[
                [a + b for a, b in zip(r, s, strict=True)]
                for r, s in zip(self.xx, other.xx, strict=True)
            ],
            xt=[a + b for a, b in zip(self.xt, other.xt, strict=True)],
            tt=self.tt + other.tt,
            by_rows=by_rows,
            prefill_tokens=self.prefill_tokens + other.prefill_tokens,
            prefill_s=self.prefill_s + other.prefill_s,
            prefill_calls=self.prefill_calls + other.prefill_calls,
            prefill_xx=[a + b for a, b in zip(self.prefill_xx, other.prefill_xx, strict=True)],
        )
