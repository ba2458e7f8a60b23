"""`sluice plan --validate`: the planner's predictions against measurements.

**(a) Sluice's own CPU runs.** Two calibration runs (sync and async η=2, seeded apart)
fit the cost model; four validation runs (sync, async η = 0, 1, 4) are then predicted
from it, each with its own workload (prompt and
response lengths, the share of tokens the trainer kept) and compared with what it
measured: trainer idle ratio, trained tokens per second, rollout idle ratio. The
costs never see the runs they predict. Every run gets ``horizon_s`` of wall clock; the
first steps (start-up) are outside the measured window.

**(b) Published results** (``flows/planner/published.py``): AReaL's and verl's speed-ups,
from the settings the papers state, on datasheet figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sluice.engines.planner.calibrate import (
    Calibration,
    RunMeasurements,
    calibrate,
    layout_of,
    workload_of,
)
from sluice.engines.planner.simulate import SimResult, simulate
from sluice.flows.bench.async_vs_sync import label_slug, run_shape, with_settings
from sluice.flows.planner.published import table_b
from sluice.infra.config.run import RunConfig

PREDICT_STEPS = 40


@dataclass(frozen=True)
class CpuRun:
    label: str
    mode: str
    max_staleness: int
    calibration: bool


CALIBRATION_SEED_OFFSET = 1000
"""Calibration runs sample other prompts and responses than the runs they predict."""

CPU_RUNS = (
    CpuRun("calibration sync", "sync", 0, True),
    CpuRun("calibration async η=2", "async", 2, True),
    CpuRun("sync", "sync", 0, False),
    CpuRun("async η=0", "async", 0, False),
    CpuRun("async η=1", "async", 1, False),
    CpuRun("async η=4", "async", 4, False),
)


def cpu_run_config(base: RunConfig, run: CpuRun, tag: str, horizon_s: float) -> RunConfig:
    return with_settings(
        base,
        {
            "name": f"plan-{tag}-{label_slug(run.label)}",
            "staleness.max_staleness": run.max_staleness,
            "seed": base.seed + (CALIBRATION_SEED_OFFSET if run.calibration else 0),
            "trainer.total_steps": 100_000,
            "trainer.time_budget_s": horizon_s,
            "evaluation.during_run": False,
        },
    )


def execute(config: RunConfig, mode: str) -> None:
    from sluice.flows.train import train
    from sluice.flows.train_sync import train_sync

    if mode == "sync":
        train_sync(config, run_id=config.name)
    else:
        train(config, run_id=config.name)


def _err(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return predicted / measured - 1.0


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:+.0f}%" if signed else f"{100 * x:.0f}%"


def predict(run: RunMeasurements, calibration: Calibration) -> SimResult:
    """The simulator's view of `run`: its own layout and workload (lengths, the share of
    tokens its trainer kept), the calibration's costs."""
    layout = layout_of(run)
    return simulate(workload_of(run), calibration.costs_for(layout), layout, steps=PREDICT_STEPS)


def table_a(measured: dict[str, RunMeasurements], calibration: Calibration) -> list[str]:
    lines = [
        "| run | trainer idle measured | predicted | error | trained tok/s measured | predicted | error | rollout idle measured | predicted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in CPU_RUNS:
        if run.calibration:
            continue
        m = measured[run.label]
        result = predict(m, calibration)
        lines.append(
            f"| {run.label} | {_pct(m.trainer_idle_ratio)} | {_pct(result.trainer_idle_ratio)} "
            f"| {_pct(result.trainer_idle_ratio - m.trainer_idle_ratio, True)} pts "
            f"| {m.trained_tokens_per_s:,.0f} | {result.trained_tokens_per_s:,.0f} "
            f"| {_pct(_err(result.trained_tokens_per_s, m.trained_tokens_per_s), True)} "
            f"| {_pct(m.rollout_idle_ratio)} | {_pct(result.rollout_idle_ratio)} |"
        )
    return lines


def run_validation(config: RunConfig, *, horizon_s: float, say: Any = print) -> int:
    tag = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    from sluice.flows.planner.measurements import measure_run

    measured: dict[str, RunMeasurements] = {}
    for run in CPU_RUNS:
        run_config = cpu_run_config(config, run, tag, horizon_s)
        say(f"validation run {run.label} ({horizon_s:g} s): {run_config.name}")
        execute(run_config, run.mode)
        measured[run.label] = measure_run(run_config, run_config.name)
    calibration = calibrate([measured[r.label] for r in CPU_RUNS if r.calibration])
    say(f"# sluice plan --validate ({tag} UTC)\n")
    say(run_shape(config) + f"; horizon {horizon_s:g} s per run\n")
    say("(a) Sluice's own CPU runs, predicted from costs calibrated on the two calibration runs:\n")
    say("\n".join(table_a(measured, calibration)))
    say("\ncalibration:\n" + "\n".join(f"- {n}" for n in calibration.notes))
    say("\n(b) published results, predicted from the papers' settings on datasheet figures:\n")
    say("\n".join(table_b()))
    return 0
