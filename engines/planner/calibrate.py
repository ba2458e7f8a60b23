"""Fit the planner's cost model to what a run measured (pure compute).

A run leaves (``flows/planner/measurements.py`` collects them into :class:`RunMeasurements`):

- the inference engine's **step profile**: least-squares sums of every decode step's
  time against (1, rows, context tokens) and the prefill tokens and seconds
  (``sluice.engines.inference.profile``);
- the trainer's **per-step timings**: compute seconds, trained tokens, micro-batches;
- **wall clock and idle ratios** of the roles, weight-update pauses, commit times;
- the **lengths** of the prompts and responses it sampled.

The fit, per device (one CPU thread, or one GPU):

- decode ``a + r*b + d*c``: the profile's normal equations, solved with the terms
  that come out negative dropped (a line fitted to a narrow range of rows can tip
  below zero; a cost cannot). Then the server's own overhead around the steps (HTTP,
  JSON, the scheduler's thread sharing the interpreter) — its busy wall time minus
  the profiled step time, per step — is added to ``a``: it is paid per step.
- prefill ``a_p + p*tokens`` per admission pass (a pass of 20 prompt tokens and a
  recompute of thousands cost very different amounts per token).
- training: ``s + k*tokens`` over the steps (least squares), plus the trainer's wall
  time per step outside its compute (reading the batch, bookkeeping) added to ``s``.
- ``weight_load_s``: the rollout's measured pause per update. ``publish_s``: the
  commit time plus half the rollout's poll interval.
- ``reward_s``: half the reward role's poll interval plus half the trainer's (the
  scoring itself is milliseconds here).

Measured on k devices, a cost is converted to one device with the scaling exponents
(``cost_1 = cost_k * k**scaling``). Given runs on different device counts (a
synchronous run on both cores and an asynchronous one on one core per role), the
exponents are fitted from the two; otherwise they stay at the values passed in and
the calibration says it assumed them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sluice.engines.inference.profile import StepProfile
from sluice.engines.planner.costs import CostModel, Layout, Workload


@dataclass(frozen=True)
class TrainStep:
    compute_s: float
    """The trainer's compute for the step (``train/step_time_s``: proximal pass included)."""
    trained_tokens: int
    micro_batches: int


@dataclass(frozen=True)
class RunMeasurements:
    """What one Sluice run measured, reduced to plain numbers (no I/O here)."""

    run_id: str
    mode: str
    """"sync" or "async"."""
    rollout_threads: int
    """Devices the inference server used (sync: all of them, shared with training)."""
    train_threads: int
    prompts_per_batch: int
    group_size: int
    max_staleness: int
    interruptible: bool
    publish_every: int
    slots_per_server: int
    max_tokens_per_micro_batch: int
    response_lengths: tuple[int, ...]
    prompt_lengths: tuple[int, ...]
    profile: StepProfile
    train_steps: tuple[TrainStep, ...]
    steps: int
    """Policy versions trained in the measured window."""
    wall_s: float
    """Wall time of the measured window (from the first measured step to the last)."""
    trainer_idle_ratio: float
    trained_tokens_per_s: float
    rollout_busy_s: float
    """Server time spent generating (async: rollout wall time not idle, minus update
    pauses; sync: the steps' generation time)."""
    weight_updates: int = 0
    update_time_s: float = 0.0
    rollout_idle_ratio: float | None = None
    commit_s: float = 0.0
    rollout_poll_s: float = 0.0
    reward_poll_s: float = 0.0
    trainer_poll_s: float = 0.0
    generate_s_per_step: float | None = None
    """Sync only: the generation part of a step (waiting for the longest response)."""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Calibration:
    costs: CostModel
    """Per-device costs, from the runs on the fewest devices."""
    notes: tuple[str, ...] = field(default=())
    """How each number was obtained, one line each (what was assumed, what measured)."""
    by_devices: dict[tuple[int, int], CostModel] = field(default_factory=dict)
    """(devices per inference server, train devices) -> per-device costs from the runs
    measured on exactly those counts."""

    def costs_for(self, layout: Layout) -> CostModel:
        """The costs to simulate `layout` with: those measured on its device counts where
        a run had them (a measured cost beats one scaled by a fitted exponent), else the
        per-device costs."""
        return self.by_devices.get((layout.devices_per_server, layout.train_devices), self.costs)


def _nonnegative(
    solve: Callable[[list[int]], np.ndarray], active: list[int], size: int
) -> list[float]:
    """Least squares over the `active` terms, dropping the most negative term and solving
    again until none is negative (a cost cannot be; a line fitted over a narrow range can
    tip below zero). Dropped terms are 0."""
    coef = [0.0] * size
    active = list(active)
    while active:
        solution = solve(active)
        if (solution >= 0).all():
            for index, value in zip(active, solution, strict=True):
                coef[index] = float(value)
            break
        active.pop(int(np.argmin(solution)))
    return coef


def fit_decode(profile: StepProfile) -> tuple[float, float, float]:
    """(a, r, d) of ``t = a + r*rows + d*context`` from the profile's normal equations,
    dropping terms that would come out negative (then refitting the rest)."""
    if profile.decode_steps < 1:
        raise ValueError("the run's step profile holds no decode steps")
    xx = np.array(profile.xx, dtype=float)
    xt = np.array(profile.xt, dtype=float)

    def solve(active: list[int]) -> np.ndarray:
        solution, *_ = np.linalg.lstsq(xx[np.ix_(active, active)], xt[active], rcond=None)
        return np.asarray(solution)

    a, r, d = _nonnegative(solve, [0, 1, 2], 3)
    return a, r, d


def fit_prefill(profile: StepProfile) -> tuple[float, float]:
    """(per pass, per token) seconds of ``t = a_p + p*tokens`` over the profiled
    admissions; a profile without the per-pass sums gives (0, mean per token)."""
    calls, tokens = profile.prefill_calls, profile.prefill_tokens
    if calls == 0 or tokens == 0:
        return 0.0, 0.0
    squares, cross = profile.prefill_xx
    if squares <= 0:
        return 0.0, profile.prefill_s / tokens
    xx = np.array([[calls, tokens], [tokens, squares]], dtype=float)
    xt = np.array([profile.prefill_s, cross])

    def solve(active: list[int]) -> np.ndarray:
        solution, *_ = np.linalg.lstsq(xx[np.ix_(active, active)], xt[active], rcond=None)
        return np.asarray(solution)

    per_pass, per_token = _nonnegative(solve, [0, 1], 2)
    return per_pass, per_token


def fit_train(steps: Sequence[TrainStep]) -> tuple[float, float, float]:
    """(per step, per micro-batch, per token) seconds from the steps' compute times.

    The micro-batch term is fitted only when the count varies (else it is part of the
    per-step term). Negative terms are dropped as in :func:`fit_decode`.
    """
    if not steps:
        raise ValueError("the run logged no train steps (train/step_time_s)")
    t = np.array([s.compute_s for s in steps])
    columns = [
        np.ones(len(steps)),
        np.array([float(s.micro_batches) for s in steps]),
        np.array([float(s.trained_tokens) for s in steps]),
    ]
    if np.ptp(columns[2]) == 0:  # one token count: only the mean per token is known
        return 0.0, 0.0, float(t.mean() / max(1.0, columns[2][0]))

    def solve(active: list[int]) -> np.ndarray:
        x = np.stack([columns[i] for i in active], axis=1)
        solution, *_ = np.linalg.lstsq(x, t, rcond=None)
        return np.asarray(solution)

    s, m, k = _nonnegative(solve, [0, 2] if np.ptp(columns[1]) == 0 else [0, 1, 2], 3)
    return s, m, k


@dataclass(frozen=True)
class _Measured:
    """One run's costs on the devices it had (before conversion to one device)."""

    devices_rollout: int
    devices_train: int
    decode: tuple[float, float, float]
    prefill_token_s: float
    prefill_call_s: float
    train: tuple[float, float, float]
    mean_rows: float
    mean_context: float

    def step_at(self, rows: float, context: float) -> float:
        """The fitted decode-step time at this many rows and context tokens."""
        a, r, d = self.decode
        return a + r * rows + d * context


def _measure(run: RunMeasurements) -> tuple[_Measured, list[str]]:
    notes: list[str] = []
    a, r, d = fit_decode(run.profile)
    steps = run.profile.decode_steps
    profiled = run.profile.xt[0] + run.profile.prefill_s
    overhead = max(0.0, run.rollout_busy_s - profiled) / steps
    notes.append(
        f"{run.run_id}: decode step {1e3 * a:.3f} ms + {1e6 * r:.2f} µs/row + "
        f"{1e9 * d:.1f} ns/context token over {steps} profiled steps; serving overhead "
        f"{1e3 * overhead:.3f} ms/step ({run.rollout_busy_s:.1f} s busy, "
        f"{profiled:.1f} s in steps)"
    )
    mean_rows = run.profile.xx[0][1] / steps
    mean_context = run.profile.xx[0][2] / steps
    prefill_call, prefill = fit_prefill(run.profile)
    notes.append(
        f"{run.run_id}: prefill {1e3 * prefill_call:.3f} ms a pass + {1e6 * prefill:.2f} µs/token "
        f"over {run.profile.prefill_calls} passes, {run.profile.prefill_tokens} tokens"
    )
    s, m, k = fit_train(run.train_steps)
    mean_compute = float(np.mean([x.compute_s for x in run.train_steps]))
    train_wall = run.wall_s * (1.0 - run.trainer_idle_ratio) / max(1, run.steps)
    # A sync step's busy part is everything but generation; what is neither generation
    # nor training compute is the step's overhead, charged separately (_sync_overhead).
    train_overhead = 0.0 if run.mode == "sync" else max(0.0, train_wall - mean_compute)
    notes.append(
        f"{run.run_id}: train {1e6 * k:.2f} µs/token + {1e3 * s:.1f} ms/step"
        + (f" + {1e3 * m:.1f} ms/micro-batch" if m else "")
        + f" over {len(run.train_steps)} steps; overhead {1e3 * train_overhead:.1f} ms/step"
    )
    return (
        _Measured(
            devices_rollout=run.rollout_threads,
            devices_train=run.train_threads,
            decode=(a + overhead, r, d),
            prefill_token_s=prefill,
            prefill_call_s=prefill_call,
            train=(s + train_overhead, m, k),
            mean_rows=mean_rows,
            mean_context=mean_context,
        ),
        notes,
    )


def _exponent(
    cost_small: float, devices_small: int, cost_large: float, devices_large: int
) -> float | None:
    """s with cost_large = cost_small * (devices_small / devices_large)**s, at least 0: more
    devices that measured slower (noise, or threads fighting) count as no speed-up. None
    where a cost came out zero (too few steps to separate it) and nothing can be said."""
    if cost_small <= 0 or cost_large <= 0 or devices_large <= devices_small:
        return None
    exponent = math.log(cost_small / cost_large) / math.log(devices_large / devices_small)
    return max(0.0, exponent)


def _mean_or(values: list[float | None], default: float) -> float:
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else default


def calibrate(
    runs: Sequence[RunMeasurements],
    *,
    decode_scaling: float = 1.0,
    train_scaling: float = 1.0,
) -> Calibration:
    """Per-device costs from one or more runs (see the module docstring).

    Costs are averaged over the runs measured on the fewest devices; runs on more
    devices, if any, fix the scaling exponents.
    """
    if not runs:
        raise ValueError("calibrate needs at least one run")
    measured: list[_Measured] = []
    notes: list[str] = []
    for run in runs:
        m, lines = _measure(run)
        measured.append(m)
        notes.extend(lines)
    fewest = min(m.devices_rollout for m in measured)
    base = [m for m in measured if m.devices_rollout == fewest]
    more = [m for m in measured if m.devices_rollout > fewest]
    if more:
        # Both fitted lines at one common point (the runs' mean rows and context), so a
        # run with longer contexts does not pass for a slower device.
        rows = float(np.mean([m.mean_rows for m in measured]))
        context = float(np.mean([m.mean_context for m in measured]))
        base_step = float(np.mean([m.step_at(rows, context) for m in base]))
        base_token = float(np.mean([m.train[2] for m in base]))
        base_train = min(m.devices_train for m in base)
        decode_scaling = _mean_or(
            [
                _exponent(base_step, fewest, x.step_at(rows, context), x.devices_rollout)
                for x in more
            ],
            decode_scaling,
        )
        train_scaling = _mean_or(
            [_exponent(base_token, base_train, x.train[2], x.devices_train) for x in more],
            train_scaling,
        )
        notes.append(
            f"scaling exponents fitted from runs on {fewest} and "
            f"{sorted({x.devices_rollout for x in more})} devices: decode "
            f"{decode_scaling:.2f}, train {train_scaling:.2f}"
        )
    else:
        notes.append(
            f"every run had {fewest} device(s) per role: scaling exponents assumed "
            f"(decode {decode_scaling:.2f}, train {train_scaling:.2f})"
        )

    asynchronous = [r for r in runs if r.mode == "async"]
    updates = [r.update_time_s / r.weight_updates for r in asynchronous if r.weight_updates]
    shared = {
        "weight_load_s": _mean(updates),
        "publish_s": _mean([r.commit_s + r.rollout_poll_s / 2 for r in asynchronous]),
        "reward_s": _mean([(r.reward_poll_s + r.trainer_poll_s) / 2 for r in asynchronous]),
        "train_scaling": train_scaling,
        "decode_scaling": decode_scaling,
    }
    costs = _per_device(base, shared)
    sync_runs = [r for r in runs if r.mode == "sync"]
    if sync_runs:
        shared["sync_step_overhead_s"] = _mean([_sync_overhead(r) for r in sync_runs])
        costs = replace(costs, sync_step_overhead_s=shared["sync_step_overhead_s"])
    by_devices = {
        key: _per_device(
            [m for m in measured if (m.devices_rollout, m.devices_train) == key], shared
        )
        for key in {(m.devices_rollout, m.devices_train) for m in measured}
    }
    notes.append(
        f"weight update pause {costs.weight_load_s * 1e3:.0f} ms "
        f"({sum(r.weight_updates for r in asynchronous)} updates); publish "
        f"{costs.publish_s * 1e3:.0f} ms (commit + half a rollout poll); reward "
        f"{costs.reward_s * 1e3:.0f} ms (half the reward and trainer polls)"
    )
    return Calibration(costs=costs, notes=tuple(notes), by_devices=by_devices)


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


def _per_device(group: list[_Measured], shared: dict[str, Any]) -> CostModel:
    """One device's costs from runs measured on the same device counts: a cost measured
    on k devices is k**scaling times what one device would take."""
    ds, ts = shared["decode_scaling"], shared["train_scaling"]
    return CostModel(
        decode_step_s=_mean([m.decode[0] * m.devices_rollout**ds for m in group]),
        decode_row_s=_mean([m.decode[1] * m.devices_rollout**ds for m in group]),
        decode_context_s=_mean([m.decode[2] * m.devices_rollout**ds for m in group]),
        prefill_token_s=_mean([m.prefill_token_s * m.devices_rollout**ds for m in group]),
        prefill_call_s=_mean([m.prefill_call_s * m.devices_rollout**ds for m in group]),
        train_step_s=_mean([m.train[0] * m.devices_train**ts for m in group]),
        train_micro_batch_s=_mean([m.train[1] * m.devices_train**ts for m in group]),
        train_token_s=_mean([m.train[2] * m.devices_train**ts for m in group]),
        **shared,
    )


def _sync_overhead(run: RunMeasurements) -> float:
    """A sync step's wall time outside generation and training compute."""
    per_step = run.wall_s / max(1, run.steps)
    compute = float(np.mean([s.compute_s for s in run.train_steps]))
    generate = run.generate_s_per_step or 0.0
    return max(0.0, per_step - generate - compute)


def workload_of(run: RunMeasurements) -> Workload:
    """The run's prompt and response lengths, and the share of the sampled tokens its
    trainer kept (Sluice drops groups whose rewards are all equal)."""
    if not run.response_lengths or not run.prompt_lengths:
        raise ValueError(f"run {run.run_id} has no measured prompt and response lengths")
    mean_tokens = float(np.mean(run.prompt_lengths)) + float(np.mean(run.response_lengths))
    sampled = run.prompts_per_batch * run.group_size * mean_tokens
    trained = (
        float(np.mean([s.trained_tokens for s in run.train_steps])) if run.train_steps else sampled
    )
    return Workload(
        response_lengths=run.response_lengths,
        prompt_lengths=run.prompt_lengths,
        group_size=run.group_size,
        trained_fraction=min(1.0, max(1e-3, trained / sampled)),
    )


def layout_of(run: RunMeasurements) -> Layout:
    """The run's own layout: CPU threads as devices."""
    if run.mode == "sync":
        devices = run.rollout_threads
        return Layout(
            mode="sync",
            devices=devices,
            rollout_devices=devices,
            prompts_per_batch=run.prompts_per_batch,
            devices_per_server=devices,
            slots_per_server=run.slots_per_server,
            max_tokens_per_micro_batch=run.max_tokens_per_micro_batch,
        )
    return Layout(
        mode="async",
        devices=run.rollout_threads + run.train_threads,
        rollout_devices=run.rollout_threads,
        prompts_per_batch=run.prompts_per_batch,
        max_staleness=run.max_staleness,
        interruptible=run.interruptible,
        publish_every=run.publish_every,
        devices_per_server=run.rollout_threads,
        slots_per_server=run.slots_per_server,
        max_tokens_per_micro_batch=run.max_tokens_per_micro_batch,
    )
