"""Numbers of the learning-fidelity studies: per-seed results, mean ± std, collapse, tables.

Pure functions over plain floats (no Prefect, MLflow or torch), so what `sluice bench
staleness` and `sluice bench mismatch` print is unit-tested with hand-made numbers and
the CLI can validate study options without importing anything heavy.

Conventions every table states in its header:
- a cell is one setting (η and objective, or a correction mode) run once per seed;
  mean ± std is over those seeds, with the sample std (n − 1), since three seeds are a
  sample of what another three would give, not the whole population;
- Δ is final − start per seed, then averaged: each seed starts from its own held-out set;
- a run collapsed when its final held-out reward fell more than `COLLAPSE_DROP` below
  its start, or a training step produced a NaN loss (`is_collapsed`);
- a run that crashed is not a collapse: it is left out of the statistics and listed
  under the table.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

COLLAPSE_DROP = 0.1
COLLAPSE_RULE = (
    f"collapsed = final held-out reward below start − {COLLAPSE_DROP}, "
    "or a NaN loss at any training step"
)

OBJECTIVES: dict[str, bool] = {"decoupled": True, "naive": False}
"""Staleness-study objectives -> `trainer.loss.decoupled`."""
STALENESS_ETAS: tuple[int, ...] = (0, 1, 2, 4, 8)
MISMATCH_MODES: tuple[str, ...] = ("none", "token_tis", "sequence_mis", "geometric_rs")

TIME_TO_TARGET_CONTENDERS: dict[str, tuple[str, int | None, dict[str, Any]]] = {
    "sync": ("sync", 0, {}),
    "async η=1": ("async", 1, {}),
    "async η=4": ("async", 4, {}),
    "async η=config": ("async", None, {}),
    "async η=config dynamic": ("async", None, {"trainer.dynamic_sampling": True}),
}
"""`sluice bench time-to-target` contenders: label -> (mode, max staleness η or None for
the config's own, settings the contender adds). The last two compare dynamic sampling
with refill against the config as it is, so they run only when named (`--variant`)."""
TIME_TO_TARGET_DEFAULT: tuple[str, ...] = ("sync", "async η=1", "async η=4")
"""The contenders `sluice bench time-to-target` runs when none is named."""

# The config keys each study sets per cell; a --set of one of them would be overwritten
# in every cell, so the CLI refuses it and names the study option to use instead.
VARIED_KEYS: dict[str, dict[str, str]] = {
    # time-to-target's contenders also set η (where fixed) and their own settings:
    # `contender_keys` names those, for the contenders chosen.
    "time-to-target": {"trainer.time_budget_s": "--horizon"},
    "staleness": {"staleness.max_staleness": "--eta", "trainer.loss.decoupled": "--objective"},
    "mismatch": {"trainer.correction.mode": "--mode"},
}


def contender_keys(labels: Sequence[str] | None) -> set[str]:
    """The config keys the time-to-target contenders `labels` (None: the default ones)
    set in their runs, so a `--set` of one of them would be overwritten."""
    keys: set[str] = set()
    for label in labels or TIME_TO_TARGET_DEFAULT:
        _, eta, settings = TIME_TO_TARGET_CONTENDERS[label]
        keys |= set(settings) | ({"staleness.max_staleness"} if eta is not None else set())
    return keys


@dataclass(frozen=True)
class Cell:
    """One setting of a study, run once per seed."""

    key: tuple[str, ...]
    """Values of the table's leading columns, e.g. ("4", "decoupled") or ("token_tis",)."""
    slug: str
    """The cell in run names (which allow [A-Za-z0-9_.-]), e.g. "eta4-decoupled"."""
    settings: dict[str, Any] = field(hash=False)
    """Dotted config keys -> values this cell sets on top of the base config."""

    @property
    def label(self) -> str:
        return " ".join(self.key)


def staleness_cells(
    etas: Sequence[int] | None = None, objectives: Sequence[str] | None = None
) -> list[Cell]:
    cells = []
    # dict.fromkeys: a repeated --eta must not run (and count) the same cell twice.
    for eta in dict.fromkeys(etas or STALENESS_ETAS):
        for objective in dict.fromkeys(objectives or OBJECTIVES):
            cells.append(
                Cell(
                    (str(eta), objective),
                    f"eta{eta}-{objective}",
                    {
                        "staleness.max_staleness": eta,
                        "trainer.loss.decoupled": OBJECTIVES[objective],
                    },
                )
            )
    return cells


def mismatch_cells(modes: Sequence[str] | None = None) -> list[Cell]:
    return [
        Cell((mode,), mode.replace("_", "-"), {"trainer.correction.mode": mode})
        for mode in dict.fromkeys(modes or MISMATCH_MODES)
    ]


@dataclass
class SeedRun:
    """One seed of one cell: what its train run left in MLflow."""

    cell: str
    seed: int
    run_id: str
    held_out_start: float | None = None
    held_out_final: float | None = None
    staleness_max: float | None = None
    """Largest per-batch staleness over the run's steps."""
    kl_k3_mean: float | None = None
    """Mean over steps of `mismatch/kl_k3`."""
    masked_fraction_mean: float | None = None
    """Mean over steps of `is/masked_fraction`."""
    is_weight_mean: float | None = None
    """Mean over steps of the behaviour weight the loss used (after correction)."""
    is_weight_max: float | None = None
    """Largest behaviour weight the loss used at any step."""
    ess_mean: float | None = None
    """Mean over steps of the effective sample size fraction of those weights."""
    steps: int = 0
    nan_loss_steps: int = 0
    """Training steps whose policy loss was not finite."""
    wall_s: float | None = None
    error: str | None = None
    """Why the run did not finish (None when it did)."""

    @property
    def delta(self) -> float | None:
        if self.held_out_start is None or self.held_out_final is None:
            return None
        return self.held_out_final - self.held_out_start

    @property
    def collapsed(self) -> bool:
        return is_collapsed(self.held_out_start, self.held_out_final, self.nan_loss_steps)


def is_collapsed(
    start: float | None, final: float | None, nan_loss_steps: int, drop: float = COLLAPSE_DROP
) -> bool:
    """`COLLAPSE_RULE`; an unknown start or final alone is not evidence of collapse."""
    if nan_loss_steps > 0:
        return True
    if start is None or final is None:
        return False
    if math.isnan(final):
        return True
    return final < start - drop


def _finite(values: Iterable[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


@dataclass(frozen=True)
class MeanStd:
    mean: float | None
    std: float | None
    """Sample std (n − 1); None with fewer than two values."""
    n: int

    def format(self, spec: str) -> str:
        if self.mean is None:
            return "-"
        if self.std is None:
            return format(self.mean, spec)
        # A sign belongs to the mean (Δ), never to the spread.
        return f"{format(self.mean, spec)} ± {format(self.std, spec.replace('+', ''))}"


def mean_std(values: Iterable[float | None]) -> MeanStd:
    """Mean and sample std of the finite values (None and NaN are skipped)."""
    kept = _finite(values)
    if not kept:
        return MeanStd(None, None, 0)
    mean = sum(kept) / len(kept)
    if len(kept) < 2:
        return MeanStd(mean, None, 1)
    variance = sum((v - mean) ** 2 for v in kept) / (len(kept) - 1)
    return MeanStd(mean, math.sqrt(variance), len(kept))


def _max(values: Iterable[float | None]) -> float | None:
    kept = _finite(values)
    return max(kept) if kept else None


@dataclass(frozen=True)
class CellStats:
    """A cell's seeds reduced to the numbers its table row shows."""

    completed: int
    failed: int
    start: MeanStd
    final: MeanStd
    delta: MeanStd
    staleness_max: float | None
    kl_k3: MeanStd
    masked_fraction: MeanStd
    is_weight_mean: MeanStd
    is_weight_max: float | None
    ess: MeanStd
    collapsed: int


def summarise(runs: Sequence[SeedRun]) -> CellStats:
    done = [r for r in runs if r.error is None]
    return CellStats(
        completed=len(done),
        failed=len(runs) - len(done),
        start=mean_std(r.held_out_start for r in done),
        final=mean_std(r.held_out_final for r in done),
        delta=mean_std(r.delta for r in done),
        staleness_max=_max(r.staleness_max for r in done),
        kl_k3=mean_std(r.kl_k3_mean for r in done),
        masked_fraction=mean_std(r.masked_fraction_mean for r in done),
        is_weight_mean=mean_std(r.is_weight_mean for r in done),
        is_weight_max=_max(r.is_weight_max for r in done),
        ess=mean_std(r.ess_mean for r in done),
        collapsed=sum(r.collapsed for r in done),
    )


def _runs_of(cell: Cell, runs: Sequence[SeedRun]) -> list[SeedRun]:
    return [r for r in runs if r.cell == cell.label]


def _opt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _collapsed(stats: CellStats) -> str:
    return f"{stats.collapsed}/{stats.completed}"


def _summarised(cells: Sequence[Cell], runs: Sequence[SeedRun]) -> Iterator[tuple[Cell, CellStats]]:
    """Each cell that has at least one run, with the statistics over its runs."""
    for cell in cells:
        cell_runs = _runs_of(cell, runs)
        if cell_runs:
            yield cell, summarise(cell_runs)


def staleness_table(cells: Sequence[Cell], runs: Sequence[SeedRun]) -> str:
    """One row per (η, objective) cell that has at least one run."""
    lines = [
        "| η | objective | held-out start | final | Δ | max staleness | k3 KL mean | collapsed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell, s in _summarised(cells, runs):
        eta, objective = cell.key
        lines.append(
            f"| {eta} | {objective} | {s.start.format('.3f')} | {s.final.format('.3f')} "
            f"| {s.delta.format('+.3f')} | {_opt(s.staleness_max, '.0f')} "
            f"| {s.kl_k3.format('.2e')} | {_collapsed(s)} |"
        )
    return "\n".join(lines)


def mismatch_table(cells: Sequence[Cell], runs: Sequence[SeedRun]) -> str:
    """One row per correction mode that has at least one run."""
    lines = [
        "| correction | held-out start | final | Δ | k3 KL mean | masked fraction "
        "| IS weight mean | IS weight max | ESS | collapsed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell, s in _summarised(cells, runs):
        lines.append(
            f"| {cell.label} | {s.start.format('.3f')} | {s.final.format('.3f')} "
            f"| {s.delta.format('+.3f')} | {s.kl_k3.format('.2e')} "
            f"| {s.masked_fraction.format('.3f')} | {s.is_weight_mean.format('.3f')} "
            f"| {_opt(s.is_weight_max, '.3g')} | {s.ess.format('.3f')} | {_collapsed(s)} |"
        )
    return "\n".join(lines)


def failure_lines(runs: Sequence[SeedRun]) -> list[str]:
    """One line per crashed run, for under the table."""
    return [f"- failed: {r.cell} seed {r.seed} ({r.run_id}): {r.error}" for r in runs if r.error]
