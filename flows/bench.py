"""`sluice bench async-vs-sync`: the synchronous baseline against asynchronous variants.

One invocation runs every variant one after another on the same machine, from the same
warm-started policy, with the same seed and the same number of PPO steps:

- ``sync``: the colocated baseline (flows/train_sync.py) — generate a batch, wait for
  its longest response, score, train, reload, repeat, on the same cores;
- ``async η=E, interruptible|drain``: the train flow with max staleness E, weight updates
  that interrupt generation in flight or wait for it to drain.

Effective training throughput is trained response tokens per second of the trainer's
wall clock (from the trainer being ready to its last step, the `train/wall_time_s`
metric both modes log the same way); the final held-out reward shows what the speed
cost in learning, if anything (AReaL Table 2: decoupled PPO at η=4 holds). Ratios are
against the sync row of the same invocation: numbers from different runs or machines
are never divided by each other.

Departure from a cluster benchmark: here the "devices" are two CPU cores shared by every
role, so async wins only what sync wastes waiting on the longest response, not what a
dedicated inference fleet adds.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from infra.config import ConfigError, RunConfig
from infra.tracking import get_metric_history

# Bench-sized defaults: enough steps for throughput to settle, eval only at both ends so
# the held-out role steals the same little CPU from every variant. Overridable by --set.
BENCH_DEFAULTS: dict[str, Any] = {"trainer.total_steps": 60, "trainer.eval_every": 0}


@dataclass(frozen=True)
class Variant:
    label: str
    mode: str
    """`sync` or `async`."""
    max_staleness: int = 0
    interruptible: bool = True


def default_variants() -> list[Variant]:
    variants = [Variant("sync", "sync")]
    for eta in (0, 1, 4):
        for interruptible in (True, False):
            label = f"async η={eta} {'interrupt' if interruptible else 'drain'}"
            variants.append(Variant(label, "async", eta, interruptible))
    return variants


@dataclass
class VariantResult:
    label: str
    run_id: str
    steps: int
    trained_tokens_per_s: float | None
    train_wall_time_s: float | None
    flow_wall_time_s: float
    held_out_start: float | None
    held_out_final: float | None
    staleness_max: float | None
    trainer_idle_ratio: float | None


def variant_config(base: RunConfig, variant: Variant, tag: str) -> RunConfig:
    config = base.model_copy(deep=True)
    config.name = (
        f"bench-{tag}-{variant.label.replace(' ', '-').replace('=', '').replace('η', 'eta')}"
    )
    config.staleness.max_staleness = variant.max_staleness
    config.rollout.interruptible = variant.interruptible
    return config


def _last(history: list[tuple[int, float]]) -> float | None:
    return history[-1][1] if history else None


def collect(
    config: RunConfig, variant: Variant, result: dict[str, Any], flow_wall_s: float
) -> VariantResult:
    uri, mlflow_run = config.tracking.uri, result["mlflow_run_id"]
    staleness = get_metric_history(uri, mlflow_run, "staleness/max")
    return VariantResult(
        label=variant.label,
        run_id=result["run_id"],
        steps=int(result.get("final_policy_version") or 0),
        trained_tokens_per_s=result.get("effective_tokens_per_s"),
        train_wall_time_s=result.get("train_wall_time_s"),
        flow_wall_time_s=flow_wall_s,
        held_out_start=result.get("held_out_reward_start"),
        held_out_final=result.get("held_out_reward_final"),
        staleness_max=max((v for _, v in staleness), default=None),
        trainer_idle_ratio=_last(get_metric_history(uri, mlflow_run, "train/idle_ratio")),
    )


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def ratio_table(results: list[VariantResult]) -> str:
    """Markdown table; ratios are against the sync row measured in the same invocation."""
    base = next((r for r in results if r.label == "sync"), None)
    lines = [
        "| variant | steps | trained tok/s | × sync | train wall s | sync wall / wall "
        "| held-out start → final | max staleness | trainer idle |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        speedup = wall_ratio = None
        if base and base.trained_tokens_per_s and r.trained_tokens_per_s:
            speedup = r.trained_tokens_per_s / base.trained_tokens_per_s
        if base and base.train_wall_time_s and r.train_wall_time_s:
            wall_ratio = base.train_wall_time_s / r.train_wall_time_s
        lines.append(
            f"| {r.label} | {r.steps} | {_fmt(r.trained_tokens_per_s, ',.0f')} "
            f"| {_fmt(speedup, '.2f')} | {_fmt(r.train_wall_time_s, '.0f')} "
            f"| {_fmt(wall_ratio, '.2f')} "
            f"| {_fmt(r.held_out_start, '.3f')} → {_fmt(r.held_out_final, '.3f')} "
            f"| {_fmt(r.staleness_max, '.0f')} | {_fmt(r.trainer_idle_ratio, '.2f')} |"
        )
    return "\n".join(lines)


@flow(name="sluice-bench-async-vs-sync", log_prints=True)
def bench_async_vs_sync(
    config: RunConfig, variants: list[str] | None = None, report_dir: str | None = None
) -> list[dict[str, Any]]:
    """Run the sync baseline and the async variants back to back; print the ratio table."""
    from flows.train import train
    from flows.train_sync import train_sync

    logger = get_run_logger()
    chosen = default_variants()
    if variants:
        known = {v.label: v for v in chosen}
        unknown = [v for v in variants if v not in known]
        if unknown:
            raise ConfigError(f"unknown bench variant(s) {unknown}; known: {list(known)}")
        chosen = [known[v] for v in variants]
    tag = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    results: list[VariantResult] = []
    for variant in chosen:
        config_v = variant_config(config, variant, tag)
        logger.info("bench variant %s (run %s)", variant.label, config_v.name)
        started = time.monotonic()
        if variant.mode == "sync":
            outcome = train_sync(config_v, run_id=config_v.name)
        else:
            outcome = train(config_v, run_id=config_v.name)
        results.append(collect(config_v, variant, outcome, time.monotonic() - started))
        print(ratio_table(results), flush=True)
    table = ratio_table(results)
    header = (
        f"# sluice bench async-vs-sync ({tag} UTC)\n\n"
        f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
        f"python {platform.python_version()}; steps {config.trainer.total_steps}, "
        f"B {config.trainer.prompts_per_batch} × G {config.rollout.group_size}, "
        f"max_new_tokens {config.rollout.max_new_tokens}\n\n"
    )
    report = header + table + "\n"
    print("\n" + report, flush=True)
    out = Path(report_dir or Path(config.workdir) / "bench")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"async-vs-sync-{tag}.md").write_text(report)
    (out / f"async-vs-sync-{tag}.json").write_text(
        json.dumps([asdict(r) for r in results], indent=2)
    )
    create_markdown_artifact(report, key="bench-async-vs-sync", description="async vs sync")
    return [asdict(r) for r in results]


def apply_bench_defaults(config: RunConfig, overrides: list[str]) -> RunConfig:
    """Bench-sized steps and eval cadence unless the user set them explicitly."""
    explicit = {o.partition("=")[0].strip() for o in overrides}
    for key, value in BENCH_DEFAULTS.items():
        if key in explicit:
            continue
        section, field = key.split(".")
        setattr(getattr(config, section), field, value)
    return config


def run_from_cli(
    name: str,
    config: RunConfig,
    overrides: list[str] | None = None,
    variants: list[str] | None = None,
) -> int:
    if name != "async-vs-sync":
        raise ConfigError(f"unknown benchmark '{name}'")
    config = apply_bench_defaults(config, overrides or [])
    bench_async_vs_sync(config, variants=variants)
    return 0
