"""`sluice bench staleness` and `sluice bench mismatch`: learning fidelity over seeds.

- **staleness**: η ∈ {0, 1, 2, 4, 8} × {decoupled PPO, naive PPO with π_old = π_behav}.
  AReaL Table 2 is the claim under test: the decoupled objective holds its final reward
  as η grows, the naive one degrades.
- **mismatch**: train–inference mismatch injected on purpose (the rollout engine serves
  its weights with relative Gaussian noise, `rollout.weight_noise_std`; the trainer and
  the evaluator keep clean ones), then the rollout-correction modes compared: none,
  token TIS, sequence MIS, geometric RS ("When Speed Kills Stability").

Every cell runs once per seed through the real asynchronous `train` flow, and the table
reports mean ± std over seeds (rules in flows/bench/study_stats.py, stated in each report).
Seeds are `seed + k` for k < `--seeds`. A seed changes the training and held-out prompts,
sampling, minibatch order and, in the mismatch study, the injected noise; it never
changes the initial policy. Version 0 is resolved once (the base seed's warm start,
cached) and every run starts from it through `model.path`, so the spread over seeds is
RL's alone and no seed pays for a warm start of its own.

The mismatch study runs at η = 0 by default: without injection π_prox = π_behav there
up to float rounding (k3 ≈ 1e-9), so the k3 KL it reports is the injected mismatch
alone, not staleness mixed in. `--set staleness.max_staleness=4` studies both together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from prefect import flow, get_run_logger

from sluice.flows.bench.async_vs_sync import (
    bench_tag,
    publish_report,
    run_shape,
    with_settings,
    write_report_files,
)
from sluice.flows.bench.study_stats import (
    COLLAPSE_RULE,
    Cell,
    SeedRun,
    failure_lines,
    mismatch_cells,
    mismatch_table,
    staleness_cells,
    staleness_table,
    summarise,
)
from sluice.infra.config.run import RunConfig
from sluice.infra.tracking import get_metric_history

# Bench-sized defaults, overridable by --set: the async-vs-sync step count, held-out
# evaluation only at both ends (the evaluator steals the same little CPU from every run).
STALENESS_DEFAULTS: dict[str, Any] = {"trainer.total_steps": 60, "evaluation.every": 0}
# weight_noise_std 0.05, measured on a 20%-accurate warm-start snapshot (16 prompts × 8
# samples, noise seeds 0-5): k3 KL 1e-3 to 2e-2 per noise draw (mean 8e-3; 0 noise gives
# 1e-13), token weights up to ~2, 0-3% of responses over C = 2, rollout reward 0.34 ->
# ~0.32. 0.03 gave k3 3e-4 to 3e-3 with no response over C (sequence MIS would equal
# none); 0.07 gave 5e-3 to 8e-2 and token weights up to 17.
MISMATCH_DEFAULTS: dict[str, Any] = {
    "trainer.total_steps": 60,
    "evaluation.every": 0,
    "staleness.max_staleness": 0,
    "rollout.weight_noise_std": 0.05,
}


@dataclass(frozen=True)
class Study:
    name: str
    question: str
    """One line under the report title: what the study measures."""
    columns: str
    """What the study's own columns mean, for the report header."""
    defaults: dict[str, Any]
    table: Callable[[Sequence[Cell], Sequence[SeedRun]], str]


STALENESS = Study(
    "staleness",
    "Final held-out reward vs max staleness η, decoupled PPO vs naive PPO (π_old = π_behav).",
    "max staleness = the largest per-batch staleness over steps and seeds; k3 KL = mean "
    "over steps of mismatch/kl_k3, KL(π_behav‖π_prox).",
    STALENESS_DEFAULTS,
    staleness_table,
)
MISMATCH = Study(
    "mismatch",
    "Rollout-correction modes under injected train–inference mismatch (noisy rollout weights).",
    "k3 KL = mean over steps of mismatch/kl_k3, KL(π_behav‖π_prox); masked fraction, IS "
    "weight mean and ESS = means over steps, IS weight max = max over steps and seeds, of "
    "the behaviour weights the loss used (after correction).",
    MISMATCH_DEFAULTS,
    mismatch_table,
)
STUDIES = {s.name: s for s in (STALENESS, MISMATCH)}


def seeds_of(config: RunConfig, count: int) -> list[int]:
    return [config.seed + k for k in range(count)]


def pin_initial_policy(config: RunConfig, say: Callable[[str], Any] = print) -> RunConfig:
    """`config` with `model.path` set to the policy version 0 every cell starts from."""
    if config.model.path:
        return config
    from sluice.tasks.run.prepare import initial_policy_dir

    path, facts = initial_policy_dir(config, say)
    say(f"every run starts from {path} ({facts['source']})")
    return with_settings(config, {"model.path": str(path)})


def run_config(base: RunConfig, study: Study, tag: str, cell: Cell, seed: int) -> RunConfig:
    name = f"{study.name}-{tag}-{cell.slug}-s{seed}"
    return with_settings(base, {**cell.settings, "seed": seed, "name": name})


def _mean(history: list[tuple[int, float]]) -> float | None:
    return sum(v for _, v in history) / len(history) if history else None


def _max(history: list[tuple[int, float]]) -> float | None:
    return max((v for _, v in history), default=None)


def collect_run(config: RunConfig, cell: Cell, outcome: dict[str, Any], wall_s: float) -> SeedRun:
    """One seed's numbers from the MLflow run its train flow logged into."""
    uri, mlflow_run = config.tracking.uri, outcome["mlflow_run_id"]

    def history(key: str) -> list[tuple[int, float]]:
        return get_metric_history(uri, mlflow_run, key)

    # The weights the loss used: after correction when the objective applies one (the
    # decoupled objective always logs them), else the raw exp δ.
    weight_mean = history("is/corrected_weight_mean") or history("is/token_weight_mean")
    weight_max = history("is/corrected_weight_max") or history("is/token_weight_max")
    ess = history("is/ess_corrected") or history("is/ess_token")
    # log_metrics drops non-finite values, so a step that trained (train/samples is
    # always finite) but has no loss/policy_loss is a step whose loss was NaN or inf.
    trained = {step for step, _ in history("train/samples")}
    finite_loss = {step for step, _ in history("loss/policy_loss")}
    return SeedRun(
        cell=cell.label,
        seed=config.seed,
        run_id=outcome["run_id"],
        held_out_start=outcome.get("held_out_reward_start"),
        held_out_final=outcome.get("held_out_reward_final"),
        staleness_max=_max(history("staleness/max")),
        kl_k3_mean=_mean(history("mismatch/kl_k3")),
        masked_fraction_mean=_mean(history("is/masked_fraction")),
        is_weight_mean=_mean(weight_mean),
        is_weight_max=_max(weight_max),
        ess_mean=_mean(ess),
        steps=int(outcome.get("final_policy_version") or 0),
        nan_loss_steps=len(trained - finite_loss),
        wall_s=wall_s,
    )


def report_text(
    study: Study,
    tag: str,
    base: RunConfig,
    seeds: list[int],
    cells: Sequence[Cell],
    runs: Sequence[SeedRun],
) -> str:
    correction = base.trainer.correction
    if study is MISMATCH:
        extra = (
            f"; rollout.weight_noise_std {base.rollout.weight_noise_std}, "
            f"η {base.staleness.max_staleness}, C {correction.threshold}, "
            f"geometric [{correction.geometric_lower}, {correction.geometric_upper}]"
        )
    else:
        extra = f"; decoupled PPO with {correction.mode} correction (C {correction.threshold})"
    lines = [
        f"# sluice bench {study.name} ({tag} UTC)",
        "",
        study.question,
        "",
        f"{run_shape(base)}{extra}; seeds {seeds}; initial policy `{base.model.path}`",
        "",
        f"mean ± sample std over seeds; Δ = final − start per seed; {COLLAPSE_RULE}. "
        + study.columns,
        "",
        study.table(cells, runs),
    ]
    failed = failure_lines(runs)
    if failed:
        lines += ["", *failed]
    return "\n".join(lines) + "\n"


def payload(
    study: Study,
    tag: str,
    base: RunConfig,
    seeds: list[int],
    cells: Sequence[Cell],
    runs: list[SeedRun],
) -> dict[str, Any]:
    return {
        "study": study.name,
        "tag": tag,
        "seeds": seeds,
        "collapse_rule": COLLAPSE_RULE,
        "cells": [
            {
                "label": cell.label,
                "settings": cell.settings,
                "stats": asdict(summarise([r for r in runs if r.cell == cell.label])),
            }
            for cell in cells
        ],
        "runs": [{**asdict(r), "delta": r.delta, "collapsed": r.collapsed} for r in runs],
        "base_config": base.model_dump(mode="json"),
    }


def run_study(
    study: Study,
    config: RunConfig,
    cells: Sequence[Cell],
    seeds: int,
    report_dir: str | None,
) -> dict[str, Any]:
    """Every cell × seed through the train flow; the table is rewritten after each run."""
    from sluice.flows.train import train

    logger = get_run_logger()
    tag = bench_tag()
    base = pin_initial_policy(config, logger.info)
    seed_list = seeds_of(base, seeds)
    runs: list[SeedRun] = []
    report = ""
    total = len(cells) * len(seed_list)
    study_started = time.monotonic()
    for cell in cells:
        for seed in seed_list:
            run_cfg = run_config(base, study, tag, cell, seed)
            done = len(runs)
            spent = time.monotonic() - study_started
            eta = f", about {spent / done * (total - done) / 60:.0f} min left" if done else ""
            logger.info(
                "%s run %d/%d: %s seed %d (run %s)%s",
                study.name,
                done + 1,
                total,
                cell.label,
                seed,
                run_cfg.name,
                eta,
            )
            started = time.monotonic()
            try:
                outcome = train(run_cfg, run_id=run_cfg.name)
                runs.append(collect_run(run_cfg, cell, outcome, time.monotonic() - started))
            except Exception as err:  # one crashed run must not cost the other cells
                logger.exception("%s seed %d failed", cell.label, seed)
                runs.append(
                    SeedRun(
                        cell.label,
                        seed,
                        run_cfg.name,
                        wall_s=time.monotonic() - started,
                        error=f"{type(err).__name__}: {err}"[:300],
                    )
                )
            report = report_text(study, tag, base, seed_list, cells, runs)
            write_report_files(
                base,
                study.name,
                tag,
                report,
                payload(study, tag, base, seed_list, cells, runs),
                report_dir,
            )
            print(study.table(cells, runs), flush=True)
    print("\n" + report, flush=True)
    mlflow_run = publish_report(
        base, study.name, tag, report, payload(study, tag, base, seed_list, cells, runs), report_dir
    )
    return {
        "tag": tag,
        "mlflow_run_id": mlflow_run,
        "report": report,
        "runs": [asdict(r) for r in runs],
    }


@flow(name="sluice-bench-staleness", log_prints=True)
def bench_staleness(
    config: RunConfig,
    etas: list[int] | None = None,
    objectives: list[str] | None = None,
    seeds: int = 3,
    report_dir: str | None = None,
) -> dict[str, Any]:
    """η × objective, each cell over `seeds` seeds; prints and publishes the table."""
    return run_study(STALENESS, config, staleness_cells(etas, objectives), seeds, report_dir)


@flow(name="sluice-bench-mismatch", log_prints=True)
def bench_mismatch(
    config: RunConfig,
    modes: list[str] | None = None,
    seeds: int = 3,
    report_dir: str | None = None,
) -> dict[str, Any]:
    """Correction modes under injected mismatch, each over `seeds` seeds."""
    return run_study(MISMATCH, config, mismatch_cells(modes), seeds, report_dir)
