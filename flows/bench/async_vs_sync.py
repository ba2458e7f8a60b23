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

The machinery every `sluice bench` shares lives here too: bench-sized defaults that
yield to explicit `--set`, and `publish_report` (markdown + JSON under
`{workdir}/bench/`, a Prefect markdown artifact, and both files on an MLflow run named
for the benchmark). The learning-fidelity studies are in flows/bench/studies.py.
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

from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import RunConfig
from sluice.infra.tracking import (
    end_run,
    get_metric_history,
    log_artifact_file,
    log_config,
    log_figure_png,
    start_or_resume_run,
)

# Bench-sized defaults: enough steps for throughput to settle, eval only at both ends so
# the held-out role steals the same little CPU from every variant. Overridable by --set.
BENCH_DEFAULTS: dict[str, Any] = {"trainer.total_steps": 60, "evaluation.every": 0}


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
    config.name = f"bench-{tag}-{label_slug(variant.label)}"
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
    from sluice.flows.train import train
    from sluice.flows.train_sync import train_sync

    logger = get_run_logger()
    chosen = choose(default_variants(), variants, "bench variant")
    tag = bench_tag()
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
    report = f"# sluice bench async-vs-sync ({tag} UTC)\n\n{run_shape(config)}\n\n{table}\n"
    print("\n" + report, flush=True)
    payload = [asdict(r) for r in results]
    publish_report(config, "async-vs-sync", tag, report, payload, report_dir)
    return payload


# ---------------------------------------------------------------- shared machinery


def label_slug(label: str) -> str:
    """A variant's label as run names allow it: 'async η=4 drain' -> 'async-eta4-drain'."""
    return label.replace(" ", "-").replace("=", "").replace("η", "eta")


def choose(options: list[Any], labels: list[str] | None, what: str) -> list[Any]:
    """The options whose `.label` is in `labels`, in that order (all of them for None)."""
    if not labels:
        return options
    known = {option.label: option for option in options}
    unknown = [label for label in labels if label not in known]
    if unknown:
        raise ConfigError(f"unknown {what}(s) {unknown}; known: {list(known)}")
    return [known[label] for label in labels]


def bench_tag() -> str:
    """UTC start time: names the report files and the MLflow run of one invocation."""
    return datetime.now(UTC).strftime("%Y%m%d-%H%M%S")


def run_shape(config: RunConfig) -> str:
    """One line of what every run of a benchmark shares: machine and batch shape."""
    return (
        f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
        f"python {platform.python_version()}; steps {config.trainer.total_steps}, "
        f"B {config.trainer.prompts_per_batch} × G {config.rollout.group_size}, "
        f"max_new_tokens {config.rollout.max_new_tokens}"
    )


def with_settings(config: RunConfig, settings: dict[str, Any]) -> RunConfig:
    """A validated copy of `config` with dotted keys (any depth) set to new values."""
    data = config.model_dump(mode="json")
    for key, value in settings.items():
        node = data
        *sections, leaf = key.split(".")
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            raise ConfigError(f"unknown config key '{key}'")
        node[leaf] = value
    try:
        return RunConfig.model_validate(data)
    except ValueError as err:
        raise ConfigError(f"bad bench setting {settings}: {err}") from None


def apply_bench_defaults(
    config: RunConfig, overrides: list[str], defaults: dict[str, Any] | None = None
) -> RunConfig:
    """Bench-sized settings (`BENCH_DEFAULTS` unless given) except keys set by --set."""
    explicit = {o.partition("=")[0].strip() for o in overrides}
    chosen = BENCH_DEFAULTS if defaults is None else defaults
    return with_settings(config, {k: v for k, v in chosen.items() if k not in explicit})


def report_paths(
    config: RunConfig, name: str, tag: str, report_dir: str | None
) -> tuple[Path, Path]:
    out = Path(report_dir or Path(config.workdir) / "bench")
    return out / f"{name}-{tag}.md", out / f"{name}-{tag}.json"


def write_report_files(
    config: RunConfig, name: str, tag: str, report: str, payload: Any, report_dir: str | None
) -> tuple[Path, Path]:
    """`{name}-{tag}.md|json`; rewritten after every run, so a stopped study keeps its rows."""
    md, js = report_paths(config, name, tag, report_dir)
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(report)
    js.write_text(json.dumps(payload, indent=2, default=str))
    return md, js


def publish_report(
    config: RunConfig,
    name: str,
    tag: str,
    report: str,
    payload: Any,
    report_dir: str | None = None,
    figures: dict[str, Any] | None = None,
) -> str:
    """Files, a Prefect markdown artifact, and an MLflow run `bench-{name}-{tag}` holding both
    files (under `bench/`), the resolved base config and any `figures` (artifact path ->
    matplotlib figure or PNG bytes). Returns the MLflow run id."""
    md, js = write_report_files(config, name, tag, report, payload, report_dir)
    create_markdown_artifact(report, key=f"bench-{name}", description=f"sluice bench {name}")
    uri = config.tracking.uri
    mlflow_run = start_or_resume_run(
        uri,
        config.tracking.experiment,
        run_name=f"bench-{name}-{tag}",
        artifact_location=config.tracking.artifact_location,
        tags={"sluice.bench": name},
    )
    log_config(uri, mlflow_run, config)
    for path in (md, js):
        log_artifact_file(uri, mlflow_run, path, artifact_path="bench")
    for artifact_file, figure in (figures or {}).items():
        log_figure_png(uri, mlflow_run, figure, artifact_file)
    end_run(uri, mlflow_run)
    return mlflow_run
