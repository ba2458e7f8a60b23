"""`sluice plan`: how many devices for rollout, which η and batch size, before the money is spent.

Two sources of costs:
- ``--from-run RUN`` (repeatable): what Sluice runs measured (``flows/planner/measurements.py``),
  fitted by ``sluice.engines.planner.calibrate``; the workload (prompt and response lengths)
  is the first run's own. Runs on different device counts (a ``--sync`` run on every
  core and an async one on a core per role) also fit how costs scale with devices.
- ``--hardware GPU --model NAME``: documented per-GPU figures and stated efficiencies
  (``sluice.engines.planner.hardware``), with a lognormal response-length distribution.

Then every async split of ``--devices`` in whole inference servers × each η × each
batch size goes through the simulator (``sluice.engines.planner.simulate``), next to the
synchronous colocated baseline on the same devices, and ``sluice.engines.planner.search``
picks the layout to run. The table, the recommendation, the calibration notes and a
plot of throughput against the split are printed and written under
``{workdir}/plans/``; the plan is also logged to MLflow (a run ``plan-{tag}`` holding
the markdown, the PNG and the recommendation as params). ``plan_runs`` is the same
plan from runs as a Prefect flow (the table becomes the flow run's markdown artifact).
``--validate`` prints the validation tables instead (``flows/planner/validation.py``).
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from prefect import flow
from prefect.artifacts import create_markdown_artifact

from sluice.engines.planner.costs import CostModel, Layout, Workload
from sluice.engines.planner.search import Candidate, async_layouts, recommend, sweep
from sluice.engines.planner.simulate import simulate
from sluice.flows.planner.args import DEFAULT_ETAS
from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import RunConfig

PLOT_ARTIFACT = "plots/plan.png"


@dataclass(frozen=True)
class Plan:
    source: str
    """Where the costs came from (runs or hardware), one line."""
    notes: tuple[str, ...]
    costs: CostModel
    workload: Workload
    devices: int
    candidates: tuple[Candidate, ...]
    sync: Candidate
    best: Candidate
    staleness_cap: int | None


def build_plan(
    source: str,
    notes: tuple[str, ...],
    costs: CostModel,
    workload: Workload,
    base: Layout,
    *,
    costs_for: Callable[[Layout], CostModel] | None = None,
    etas: tuple[int, ...],
    batches: tuple[int, ...],
    staleness_cap: int | None,
    steps: int,
    one_server: bool = False,
) -> Plan:
    """Sweep the async layouts of `base` and simulate the sync baseline beside them.

    `one_server`: a CPU plan, where a role's threads are its devices: the rollout's are
    one server, and the sync baseline runs one server on every device (as
    `sluice train --sync` does). `costs_for`: costs measured on a layout's own device
    counts where a calibration run had them (else `costs`)."""
    cost_of = costs_for or (lambda _layout: costs)
    layouts = async_layouts(base, etas=etas, batch_sizes=batches, one_server=one_server)
    if not layouts:
        raise ConfigError(
            f"no async layout fits {base.devices} devices with {base.devices_per_server} per server"
        )
    candidates = sweep(workload, cost_of, layouts, steps=steps)
    best = recommend(candidates, staleness_cap=staleness_cap)
    sync_layout = replace(
        base,
        mode="sync",
        prompts_per_batch=best.layout.prompts_per_batch,
        devices_per_server=base.devices if one_server else base.devices_per_server,
    )
    sync = Candidate(
        sync_layout, simulate(workload, cost_of(sync_layout), sync_layout, steps=steps)
    )
    return Plan(
        source, notes, costs, workload, base.devices, tuple(candidates), sync, best, staleness_cap
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def candidate_row(c: Candidate, sync_throughput: float, mark: str = "") -> str:
    layout, r = c.layout, c.result
    split = (
        "all (sync)"
        if layout.mode == "sync"
        else f"{layout.rollout_devices}:{layout.train_devices}"
    )
    eta = "-" if layout.mode == "sync" else str(layout.max_staleness)
    return (
        f"| {split}{mark} | {eta} | {layout.prompts_per_batch} | {r.trained_tokens_per_s:,.0f} | "
        f"{r.trained_tokens_per_s / sync_throughput:.2f}x | {r.seconds_per_step:.3g} | "
        f"{_pct(r.trainer_idle_ratio)} | {_pct(r.rollout_idle_ratio)} | "
        f"{r.staleness_mean:.2f} / {r.staleness_max} |"
    )


def format_plan(plan: Plan, top: int = 12) -> str:
    sync_tps = plan.sync.result.trained_tokens_per_s
    ranked = sorted(plan.candidates, key=lambda c: -c.throughput)[:top]
    w = plan.workload
    lengths = np.array(w.response_lengths)
    lines = [
        f"# sluice plan: {plan.devices} devices, costs from {plan.source}",
        "",
        f"workload: G={w.group_size}, responses mean {lengths.mean():.0f} / p50 "
        f"{np.median(lengths):.0f} / p99 {np.percentile(lengths, 99):.0f} / max {lengths.max()} tokens, "
        f"prompts mean {np.mean(w.prompt_lengths):.0f}",
        "",
        "| rollout:train | η | B | trained tok/s | vs sync | s/step | trainer idle | rollout idle | staleness mean / max |",
        "|---|---|---|---|---|---|---|---|---|",
        candidate_row(plan.sync, sync_tps),
    ]
    lines += [candidate_row(c, sync_tps, " ←" if c is plan.best else "") for c in ranked]
    b = plan.best
    cap = "" if plan.staleness_cap is None else f" (staleness cap {plan.staleness_cap})"
    lines += [
        "",
        f"**recommended{cap}**: rollout {b.layout.rollout_devices} / train {b.layout.train_devices} "
        f"devices, η={b.layout.max_staleness}, B={b.layout.prompts_per_batch}: "
        f"{b.throughput:,.0f} trained tokens/s predicted, {b.throughput / sync_tps:.2f}x the sync "
        f"baseline; trainer idle {_pct(b.result.trainer_idle_ratio)}, rollout idle "
        f"{_pct(b.result.rollout_idle_ratio)}, staleness mean {b.result.staleness_mean:.2f}",
        "",
        "calibration:",
        *(f"- {n}" for n in plan.notes),
    ]
    return "\n".join(lines) + "\n"


def plot_plan(plan: Plan) -> Any:
    """Predicted trained tokens/s against the share of devices serving generation, a line
    per η (at the recommended batch size), the sync baseline dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    batch = plan.best.layout.prompts_per_batch
    etas = sorted({c.layout.max_staleness for c in plan.candidates})
    for index, eta in enumerate(etas):
        points = sorted(
            (c.layout.rollout_devices / plan.devices, c.throughput)
            for c in plan.candidates
            if c.layout.max_staleness == eta and c.layout.prompts_per_batch == batch
        )
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", color=f"C{index}", label=f"async η={eta}")
    ax.axhline(plan.sync.throughput, color="black", linestyle="--", label="sync (colocated)")
    best = plan.best
    ax.plot(
        [best.layout.rollout_devices / plan.devices],
        [best.throughput],
        marker="*",
        markersize=16,
        color="red",
        linestyle="none",
        label="recommended",
    )
    ax.set_xlabel(f"share of the {plan.devices} devices serving generation")
    ax.set_ylabel("predicted trained tokens / s")
    ax.set_title(f"sluice plan (B={batch}): {plan.source}")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return fig


def publish_plan(config: RunConfig, plan: Plan) -> tuple[Path, Path, str]:
    """The markdown and PNG under {workdir}/plans/, and an MLflow run `plan-{tag}` (tag:
    the UTC time and a short random suffix, so two plans in one second stay apart)."""
    tag = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{uuid.uuid4().hex[:4]}"
    from sluice.infra.tracking import (
        end_run,
        log_artifact_file,
        log_config,
        log_figure_png,
        log_metrics,
        start_or_resume_run,
    )

    out = Path(config.workdir) / "plans"
    out.mkdir(parents=True, exist_ok=True)
    md, png = out / f"plan-{tag}.md", out / f"plan-{tag}.png"
    md.write_text(format_plan(plan))
    figure = plot_plan(plan)
    figure.savefig(png, format="png", dpi=100)
    uri = config.tracking.uri
    run = start_or_resume_run(
        uri,
        config.tracking.experiment,
        run_name=f"plan-{tag}",
        artifact_location=config.tracking.artifact_location,
        tags={"sluice.plan": plan.source},
    )
    b = plan.best
    log_config(
        uri,
        run,
        {
            "source": plan.source,
            "devices": plan.devices,
            "recommended.rollout_devices": b.layout.rollout_devices,
            "recommended.train_devices": b.layout.train_devices,
            "recommended.max_staleness": b.layout.max_staleness,
            "recommended.prompts_per_batch": b.layout.prompts_per_batch,
        },
        artifact_dir="plan",
    )
    log_metrics(
        uri,
        run,
        {
            "plan/trained_tokens_per_s": b.throughput,
            "plan/speedup_over_sync": b.throughput / plan.sync.throughput,
            "plan/trainer_idle_ratio": b.result.trainer_idle_ratio,
            "plan/rollout_idle_ratio": b.result.rollout_idle_ratio or 0.0,
        },
        step=0,
    )
    log_artifact_file(uri, run, md, artifact_path="plan")
    log_figure_png(uri, run, figure, PLOT_ARTIFACT)
    end_run(uri, run)
    return md, png, run


def plan_from_runs(
    config: RunConfig,
    runs: list[str],
    *,
    overrides: list[str] | None = None,
    devices: int | None = None,
    etas: list[int] | None = None,
    batches: list[int] | None = None,
    staleness_cap: int | None = None,
    steps: int = 20,
) -> Plan:
    """A plan from what `runs` (under the config's workdir) measured; the workload is the
    first run's."""
    from sluice.engines.planner.calibrate import calibrate, layout_of, workload_of
    from sluice.flows.planner.measurements import measure_run
    from sluice.flows.run_dirs import resolve_run

    if not runs:
        raise ConfigError("a plan from runs needs at least one run")
    measured = []
    for run in runs:
        run_id, run_config = resolve_run(config, run, list(overrides or []))
        measured.append(measure_run(run_config, run_id))
    calibration = calibrate(measured)
    first = measured[0]
    base = replace(layout_of(first), mode="async")
    base = replace(base, devices=devices or base.devices, devices_per_server=1, rollout_devices=1)
    return build_plan(
        f"run{'s' if len(measured) > 1 else ''} {', '.join(m.run_id for m in measured)}",
        calibration.notes,
        calibration.costs,
        workload_of(first),
        base,
        costs_for=calibration.costs_for,
        etas=tuple(etas or DEFAULT_ETAS),
        batches=tuple(batches or (first.prompts_per_batch,)),
        staleness_cap=staleness_cap,
        steps=steps,
        one_server=True,
    )


@flow(name="sluice-plan", log_prints=True)
def plan_runs(
    config: RunConfig,
    runs: list[str],
    devices: int | None = None,
    etas: list[int] | None = None,
    batches: list[int] | None = None,
    staleness_cap: int | None = None,
) -> dict[str, Any]:
    """`sluice plan --from-run` as a Prefect flow (a deployment or another flow can run
    it): the plan's table is the flow run's markdown artifact, its plot and
    recommendation go to MLflow. Returns the recommendation."""
    plan = plan_from_runs(
        config, runs, devices=devices, etas=etas, batches=batches, staleness_cap=staleness_cap
    )
    md, png, mlflow_run = publish_plan(config, plan)
    create_markdown_artifact(format_plan(plan), key="sluice-plan", description=plan.source)
    best = plan.best
    return {
        "rollout_devices": best.layout.rollout_devices,
        "train_devices": best.layout.train_devices,
        "max_staleness": best.layout.max_staleness,
        "prompts_per_batch": best.layout.prompts_per_batch,
        "trained_tokens_per_s": best.throughput,
        "speedup_over_sync": best.throughput / plan.sync.throughput,
        "mlflow_run_id": mlflow_run,
        "plot": str(png),
        "table": str(md),
    }


def plan_from_hardware(config: RunConfig, args: argparse.Namespace) -> Plan:
    from sluice.engines.planner.hardware import (
        GPUS,
        MODELS,
        Efficiency,
        gpu_costs,
        kv_slots,
        lognormal_lengths,
    )

    gpu, model = GPUS.get(args.hardware or ""), MODELS.get(args.model or "")
    if gpu is None:
        raise ConfigError(f"unknown --hardware {args.hardware!r}; known: {', '.join(GPUS)}")
    if model is None:
        raise ConfigError(f"unknown --model {args.model!r}; known: {', '.join(MODELS)}")
    if not args.devices:
        raise ConfigError("--hardware needs --devices N (GPUs to plan for)")
    cap = args.max_new_tokens
    lengths = lognormal_lengths(args.response_mean, args.response_sigma, cap)
    eff = Efficiency()
    costs = gpu_costs(gpu, model, eff)
    slots = kv_slots(gpu, model, args.prompt_tokens + float(np.mean(lengths)) / 2, args.tp, eff)
    workload = Workload(
        lengths, (args.prompt_tokens,), args.group_size or config.rollout.group_size
    )
    base = Layout(
        mode="async",
        devices=args.devices,
        rollout_devices=args.tp,
        prompts_per_batch=config.trainer.prompts_per_batch,
        devices_per_server=args.tp,
        slots_per_server=slots,
        max_tokens_per_micro_batch=config.trainer.max_tokens_per_micro_batch,
    )
    notes = (
        f"{gpu.name}: {gpu.bf16_tflops:g} TFLOPS BF16 dense, {gpu.hbm_tbps:g} TB/s, {gpu.memory_gib:g} GiB (datasheet)",
        f"{model.name}: {model.params / 1e9:.2f}B parameters, {model.kv_bytes_per_token // 1024} KiB of K/V per token",
        f"assumed efficiencies: {eff}",
        f"{slots} sequences per server (K/V memory at the mean context)",
    )
    return build_plan(
        f"{args.devices} x {gpu.name}, {model.name}",
        notes,
        costs,
        workload,
        base,
        etas=tuple(args.etas or DEFAULT_ETAS),
        batches=tuple(args.batches or (config.trainer.prompts_per_batch,)),
        staleness_cap=args.staleness_cap,
        steps=args.steps,
    )


def run_plan(args: argparse.Namespace, config: RunConfig) -> int:
    """The `sluice plan` command; bad input raises ConfigError or ValueError (one line)."""
    if args.validate:
        from sluice.flows.planner.validation import run_validation

        return run_validation(config, horizon_s=args.horizon)
    if bool(args.runs) == bool(args.hardware):
        raise ConfigError("sluice plan needs either --from-run RUN or --hardware GPU --model NAME")
    if args.runs:
        plan = plan_from_runs(
            config,
            args.runs,
            overrides=args.overrides,
            devices=args.devices,
            etas=args.etas,
            batches=args.batches,
            staleness_cap=args.staleness_cap,
            steps=args.steps,
        )
    else:
        plan = plan_from_hardware(config, args)
    md, png, mlflow_run = publish_plan(config, plan)
    print(format_plan(plan))
    print(f"plan: {md}\nplot: {png}\nMLflow run: {mlflow_run} ({PLOT_ARTIFACT})")
    return 0
