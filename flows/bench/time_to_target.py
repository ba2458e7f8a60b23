"""`sluice bench time-to-target`: held-out reward against wall-clock time, sync vs async.

What a user buys Sluice for is a better policy sooner, so this benchmark puts the
synchronous colocated baseline and the asynchronous flow with η ∈ {1, 4} on one clock
and asks when each reaches the start's held-out reward + `delta` (0.2 by default).

- Every contender starts from the same policy (the shipped warm start, or
  `model.path`), with the same config except the mode and η, seed by seed; the order
  of contenders rotates with the seed, so a machine that slows down over an hour
  hurts none of them more than the others.
- The clock starts when the flow is called and includes everything a user waits for:
  the MLflow run, committing version 0, starting the role processes and the inference
  server. Each run stops at `horizon_s` (`trainer.time_budget_s`).
- Nothing is evaluated while the clock runs (`evaluation.during_run=false`): every
  committed version stays in storage with its commit time in the registry, and after
  the run the versions newest at fixed times (`EVAL_TIMES`, stretched for a horizon
  longer than 300 s) are scored in this process, on the roles' cores, which are idle
  by then; then the run's checkpoints are deleted. Where the target is crossed
  between two scored versions, the versions between are bisected (at most
  `REFINE_EVALS` more), so the time to target is a commit time, not a grid point.
- All versions of all runs are scored on the same held-out prompts with the same
  sampling seeds (`evaluation.samples` per prompt at the rollout temperature, the
  RL objective), so two versions differ by their weights, not their luck.

Reported per contender, mean ± std over seeds: the time to target, the held-out
reward at 60, 120 and 300 s (stretched likewise), steps done by the horizon, and
trainer / rollout idle ratios; the ratio column is the sync mean time over the
contender's, both measured in this invocation. A PNG of the curves goes to the benchmark's MLflow run.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from sluice.flows.bench.async_vs_sync import (
    bench_tag,
    choose,
    label_slug,
    publish_report,
    run_shape,
    with_settings,
)
from sluice.flows.bench.studies import pin_initial_policy
from sluice.flows.bench.study_stats import (
    TIME_TO_TARGET_CONTENDERS,
    TIME_TO_TARGET_DEFAULT,
    mean_std,
)
from sluice.infra.config.run import RunConfig
from sluice.infra.tracking import get_metric_history

EVAL_TIMES: tuple[float, ...] = (
    0,
    5,
    10,
    15,
    20,
    25,
    30,
    40,
    50,
    60,
    80,
    100,
    120,
    150,
    180,
    240,
    300,
)
"""Seconds since the flow was called at which the newest committed version is scored."""
FIXED_TIMES: tuple[float, ...] = (60, 120, 300)
REFINE_EVALS = 4
PNG = "plots/time_to_target.png"
DEFAULT_DELTA = 0.2
DEFAULT_HORIZON_S = 300.0
# Settings every run of this benchmark takes (the time budget replaces the step count).
TTT_DEFAULTS: dict[str, Any] = {
    "trainer.total_steps": 100_000,
    "evaluation.during_run": False,
}


@dataclass(frozen=True)
class Contender:
    label: str
    mode: str
    """`sync` (colocated, flows/train_sync.py) or `async` (flows/train.py)."""
    max_staleness: int | None = 0
    """η; None keeps the config's."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Config keys the contender sets on top of the run's, e.g. dynamic sampling."""


CONTENDERS: tuple[Contender, ...] = tuple(
    Contender(label, mode, eta, dict(settings))
    for label, (mode, eta, settings) in TIME_TO_TARGET_CONTENDERS.items()
)


@dataclass
class Trial:
    """One run of one contender with one seed, scored after it stopped."""

    label: str
    seed: int
    run_id: str
    steps: int
    """Newest policy version committed by the horizon."""
    v0_at_s: float | None
    """When version 0 was committed: the start-up a user waits through."""
    curve: list[tuple[float, int, float]] = field(default_factory=list)
    """(seconds since the flow was called, policy version, held-out reward) of scored versions."""
    time_to_target_s: float | None = None
    reward_at: dict[str, float | None] = field(default_factory=dict)
    trainer_idle_ratio: float | None = None
    rollout_idle_ratio: float | None = None
    staleness_mean: float | None = None
    extra_groups_per_batch: float | None = None
    """Dynamic sampling's cost: groups generated and dropped per training batch."""


def scaled_times(times: Sequence[float], horizon_s: float) -> list[float]:
    """`times` (made for the default horizon) up to `horizon_s`, stretched in proportion
    when the horizon is longer: a real model's run of 15 minutes is scored at 0, 15,
    30 .. 900 s, as many points as a toy's of 5 minutes."""
    stretch = max(1.0, horizon_s / DEFAULT_HORIZON_S)
    return [t * stretch for t in times if t * stretch <= horizon_s]


def newest_at(times: Sequence[tuple[int, float]], at_s: float) -> int | None:
    """The newest version committed by `at_s`; `times` is [(version, seconds)] by time."""
    index = bisect.bisect_right([t for _, t in times], at_s)
    return times[index - 1][0] if index else None


def time_to_target(
    times: Sequence[tuple[int, float]],
    score: Callable[[int], float],
    target: float,
    grid: Sequence[float],
    refine_evals: int = REFINE_EVALS,
) -> float | None:
    """Commit time of the first version found at or above `target`, or None.

    Scores the version newest at each grid time in order until one reaches the
    target, then bisects the versions committed between that one and the last that
    did not (assuming reward rises between two neighbouring grid points), spending
    at most `refine_evals` more scores.
    """
    at = dict(times)
    below: int | None = None
    for grid_s in grid:
        version = newest_at(times, grid_s)
        if version is None:
            continue
        if score(version) >= target:
            # Nothing scored below the target yet: every earlier version is a candidate.
            low = below if below is not None else times[0][0] - 1
            high = version
            spent = 0
            while high - low > 1 and spent < refine_evals:
                middle = low + (high - low) // 2
                if middle in at:  # versions are committed in order; gaps would skip
                    if score(middle) >= target:
                        high = middle
                    else:
                        low = middle
                    spent += 1
                else:
                    low = middle
            return at[high]
        below = version
    return None


def reward_at(
    times: Sequence[tuple[int, float]], score: Callable[[int], float], at_s: float
) -> float | None:
    version = newest_at(times, at_s)
    return None if version is None else score(version)


@dataclass
class ScoredRun:
    """Scores versions of one finished run on the held-out prompts, each at most once."""

    config: RunConfig
    run_id: str
    started_at: float
    """time.time() when the flow was called."""
    scores: dict[int, float] = field(default_factory=dict)
    checkpoints: dict[int, str] = field(default_factory=dict)

    def version_times(self) -> list[tuple[int, float]]:
        from sluice.tasks.run.paths import run_registry

        versions = [v for v in run_registry(self.config, self.run_id).versions() if not v.lost]
        self.checkpoints = {v.policy_version: v.checkpoint_uri for v in versions}
        return sorted(
            ((v.policy_version, v.created_at_ms / 1000.0 - self.started_at) for v in versions),
            key=lambda vt: vt[1],
        )

    def score(self, version: int) -> float:
        if version not in self.scores:
            from sluice.tasks.evaluate.role import evaluate_checkpoint

            metrics = evaluate_checkpoint(
                self.config, self.run_id, version, self.checkpoints[version]
            )
            self.scores[version] = metrics["eval/reward"]
        return self.scores[version]

    def release(self) -> int:
        """Delete the run's checkpoints once it is scored (every version was kept for the
        scoring; a real model's would fill the disk within a few runs); how many went."""
        from sluice.infra.checkpoints import delete_checkpoint
        from sluice.tasks.run.paths import run_registry

        registry = run_registry(self.config, self.run_id)
        gone = 0
        for version, url in self.checkpoints.items():
            gone += delete_checkpoint(url, self.config.storage.options)
            registry.mark_deleted(version)
        return gone


def eval_config(config: RunConfig) -> RunConfig:
    """The scoring settings every version of every run shares: seed 0, no greedy pass."""
    return with_settings(config, {"seed": 0, "evaluation.greedy": False})


def run_config(
    base: RunConfig, contender: Contender, tag: str, seed: int, horizon_s: float
) -> RunConfig:
    eta = (
        {}
        if contender.max_staleness is None
        else {"staleness.max_staleness": contender.max_staleness}
    )
    return with_settings(
        base,
        {
            "name": f"ttt-{tag}-{label_slug(contender.label)}-s{seed}",
            "seed": seed,
            **eta,
            **contender.settings,
            "trainer.time_budget_s": horizon_s,
            # Any version may be scored after the run (the refining search picks them).
            "storage.keep_versions": 0,
        },
    )


def run_trial(
    config: RunConfig,
    contender: Contender,
    seed: int,
    scoring: RunConfig,
    target: float,
    grid: Sequence[float],
    fixed_times: Sequence[float],
) -> Trial:
    from sluice.flows.train import train
    from sluice.flows.train_sync import train_sync

    started_at = time.time()
    if contender.mode == "sync":
        outcome = train_sync(config, run_id=config.name)
    else:
        outcome = train(config, run_id=config.name)
    # The clock has stopped: from here on nothing is timed.
    scored = ScoredRun(scoring, config.name, started_at)
    times = scored.version_times()
    uri, mlflow_run = config.tracking.uri, outcome["mlflow_run_id"]

    def last(metric: str) -> float | None:
        history = get_metric_history(uri, mlflow_run, metric)
        return history[-1][1] if history else None

    staleness = get_metric_history(uri, mlflow_run, "staleness/mean")
    trial = Trial(
        label=contender.label,
        seed=seed,
        run_id=config.name,
        steps=max((v for v, _ in times), default=0),
        v0_at_s=dict(times).get(0),
        trainer_idle_ratio=last("train/idle_ratio"),
        rollout_idle_ratio=last("rollout/idle_ratio"),
        staleness_mean=(sum(v for _, v in staleness) / len(staleness)) if staleness else None,
        extra_groups_per_batch=last("dynamic_sampling/extra_groups_per_batch"),
    )
    trial.time_to_target_s = time_to_target(times, scored.score, target, grid)
    for at_s in fixed_times:
        trial.reward_at[f"{at_s:g}"] = reward_at(times, scored.score, at_s)
    for at_s in grid:  # the whole curve, not only up to the target
        reward_at(times, scored.score, at_s)
    at = dict(times)
    trial.curve = sorted((at[v], v, r) for v, r in scored.scores.items())
    scored.release()
    return trial


# ---------------------------------------------------------------- report


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_table(
    trials: Sequence[Trial], target: float, horizon_s: float, fixed_times: Sequence[float]
) -> str:
    labels = list(dict.fromkeys(t.label for t in trials))
    # The ratio's numerator: the sync baseline where it ran, else the first contender
    # (e.g. the config without dynamic sampling, against the config with it).
    baseline = "sync" if "sync" in labels else labels[0]
    base_time = mean_std(t.time_to_target_s for t in trials if t.label == baseline).mean
    fixed = [f"{t:g}" for t in fixed_times if t <= horizon_s]
    lines = [
        f"| contender | seeds | reached | time to {target:.3f} (s) | {baseline} time / time "
        + "".join(f"| reward @{t} s " for t in fixed)
        + "| steps by horizon | v0 committed (s) | trainer idle | rollout idle "
        + "| extra groups / batch |",
        "|---|---|---|---|---|" + "---|" * len(fixed) + "---|---|---|---|---|",
    ]
    for label in labels:
        mine = [t for t in trials if t.label == label]
        reached = [t for t in mine if t.time_to_target_s is not None]
        time_stats = mean_std(t.time_to_target_s for t in reached)
        ratio = (
            base_time / time_stats.mean
            if base_time and time_stats.mean and len(reached) == len(mine)
            else None
        )
        time_text = time_stats.format(".0f")
        if len(reached) < len(mine):
            time_text = f"{time_text} (> {horizon_s:g} for {len(mine) - len(reached)})"
        lines.append(
            f"| {label} | {len(mine)} | {len(reached)}/{len(mine)} | {time_text} "
            f"| {_fmt(ratio, '.2f')} "
            + "".join(
                f"| {mean_std(t.reward_at.get(k) for t in mine).format('.3f')} " for k in fixed
            )
            + f"| {mean_std(t.steps for t in mine).format('.0f')} "
            f"| {mean_std(t.v0_at_s for t in mine).format('.1f')} "
            f"| {mean_std(t.trainer_idle_ratio for t in mine).format('.2f')} "
            f"| {mean_std(t.rollout_idle_ratio for t in mine).format('.2f')} "
            f"| {mean_std(t.extra_groups_per_batch for t in mine).format('.2f')} |"
        )
    return "\n".join(lines)


def curve_at(trial: Trial, at_s: float, start: float) -> float:
    """Held-out reward of the newest scored version committed by `at_s` (start before v0)."""
    reward = start
    for seconds, _, value in trial.curve:
        if seconds > at_s:
            break
        reward = value
    return reward


def curve_table(trials: Sequence[Trial], start: float, grid: Sequence[float]) -> str:
    """Mean held-out reward over seeds at each grid time, one row per contender."""
    labels = list(dict.fromkeys(t.label for t in trials))
    lines = [
        "| contender | " + " | ".join(f"{t:g} s" for t in grid) + " |",
        "|---|" + "---|" * len(grid),
    ]
    for label in labels:
        mine = [t for t in trials if t.label == label]
        cells = [f"{sum(curve_at(t, at_s, start) for t in mine) / len(mine):.3f}" for at_s in grid]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seed_lines(trials: Sequence[Trial]) -> list[str]:
    return [
        f"- {t.label} seed {t.seed}: time to target {_fmt(t.time_to_target_s, '.0f')} s, "
        f"{t.steps} steps, curve " + ", ".join(f"{s:.0f}s v{v}:{r:.3f}" for s, v, r in t.curve)
        for t in trials
    ]


def curves_png(trials: Sequence[Trial], target: float, start: float, title: str) -> Any:
    """Held-out reward against seconds: a thin step line per seed, a thick one per mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = list(dict.fromkeys(t.label for t in trials))
    horizon = max((s for t in trials for s, _, _ in t.curve), default=1.0)
    grid = np.linspace(0, horizon, 200)
    for index, label in enumerate(labels):
        color = f"C{index}"
        rows = []
        for trial in (t for t in trials if t.label == label):
            xs = [0.0] + [s for s, _, _ in trial.curve]
            ys = [start] + [r for _, _, r in trial.curve]
            ax.step(xs, ys, where="post", color=color, alpha=0.25, linewidth=1)
            rows.append(np.array(ys)[np.searchsorted(xs, grid, side="right") - 1])
        ax.step(
            grid,
            np.mean(rows, axis=0),
            where="post",
            color=color,
            linewidth=2.2,
            label=f"{label} (mean of {len(rows)})",
        )
    ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:.3f}")
    ax.set_xlabel("seconds since the flow was called (start-up included)")
    ax.set_ylabel("held-out reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


@flow(name="sluice-bench-time-to-target", log_prints=True)
def bench_time_to_target(
    config: RunConfig,
    contenders: Sequence[str] | None = None,
    seeds: int = 3,
    horizon_s: float = DEFAULT_HORIZON_S,
    delta: float = DEFAULT_DELTA,
    report_dir: str | None = None,
) -> dict[str, Any]:
    """Run every contender once per seed, score them afterwards, print the table."""
    from sluice.tasks.evaluate.role import evaluate_model_dir

    logger = get_run_logger()
    chosen = choose(list(CONTENDERS), list(contenders or TIME_TO_TARGET_DEFAULT), "contender")
    tag = bench_tag()
    config = pin_initial_policy(config)
    scoring = eval_config(config)
    # Every version is scored with the same prompts and seeds, so version 0 of every
    # run scores the same: score it once, before any clock runs.
    start = evaluate_model_dir(scoring, Path(str(config.model.path)), 0)["eval/reward"]
    target = start + delta
    grid = scaled_times(EVAL_TIMES, horizon_s)
    grid += [] if horizon_s in grid else [horizon_s]
    fixed = scaled_times(FIXED_TIMES, horizon_s)
    print(f"start policy held-out reward {start:.3f}; target {target:.3f} (+{delta:g})", flush=True)
    trials: list[Trial] = []
    header = (
        f"# sluice bench time-to-target ({tag} UTC)\n\n{run_shape(config)}; horizon "
        f"{horizon_s:g} s; held-out reward of the start {start:.3f}, target {target:.3f}; "
        f"{config.evaluation.num_prompts} held-out prompts × {config.evaluation.samples} "
        f"sample(s), scored after each run\n\n"
    )
    report = header
    for seed_index in range(seeds):
        seed = config.seed + seed_index
        order = chosen[seed_index % len(chosen) :] + chosen[: seed_index % len(chosen)]
        for contender in order:
            run_cfg = run_config(config, contender, tag, seed, horizon_s)
            logger.info("time-to-target: %s seed %d (run %s)", contender.label, seed, run_cfg.name)
            trial = run_trial(run_cfg, contender, seed, scoring, target, grid, fixed)
            trials.append(trial)
            report = (
                header
                + summary_table(trials, target, horizon_s, fixed)
                + "\n\nMean held-out reward by wall-clock time (the curve):\n\n"
                + curve_table(trials, start, grid)
                + "\n\nPer run (time since the flow was called, version, held-out reward):\n"
                + "\n".join(seed_lines(trials))
                + "\n"
            )
            print(report, flush=True)
    payload = {
        "start": start,
        "target": target,
        "horizon_s": horizon_s,
        "trials": [asdict(t) for t in trials],
    }
    figure = curves_png(trials, target, start, f"time to held-out reward {target:.3f}")
    mlflow_run = publish_report(
        config, "time-to-target", tag, report, payload, report_dir, figures={PNG: figure}
    )
    print(f"curves: {PNG} in MLflow run {mlflow_run}", flush=True)
    return payload
