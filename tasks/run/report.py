"""What a finished run leaves for people: reward curves, a summary, a table of versions.

MLflow gets one PNG (`plots/reward_curve.png`): training-batch reward, held-out reward
and held-out greedy accuracy against policy version, and beside it the same against
wall-clock seconds, which is how an asynchronous and a synchronous run of the same
config are compared; and `plots/staleness_histogram.png`: how many of the run's trained
samples were generated 0, 1, ... eta versions behind the weights they trained (the sum
of the per-step `staleness/count_lag_{k}` counts). Prefect gets
a markdown summary artifact and a table artifact with the held-out result of every
evaluated policy version.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from sluice.infra.config.run import RunConfig
from sluice.infra.config.staleness import describe_mode
from sluice.infra.config.tracking import ui_command
from sluice.infra.policy_version import TAG_EVAL_REWARD, eval_tag
from sluice.infra.tracking import (
    end_run,
    get_metric_history,
    get_metric_timeline,
    log_figure_png,
    run_ui_url,
)
from sluice.tasks.run.failovers import failover_summary, read_failovers
from sluice.tasks.run.paths import registered_model_name, run_paths, run_registry
from sluice.tasks.run.status import read_statuses
from sluice.tasks.run.threads import role_threads

REWARD_CURVE_ARTIFACT = "plots/reward_curve.png"
STALENESS_HISTOGRAM_ARTIFACT = "plots/staleness_histogram.png"

Curve = Sequence[tuple[float, float]]


def figure_png(fig: Any) -> bytes:
    """A matplotlib figure as PNG bytes; the figure is closed."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def reward_curve_png(
    train_reward: Curve,
    held_out: Curve,
    title: str,
    *,
    train_reward_by_time: Curve = (),
    held_out_by_time: Curve = (),
    held_out_greedy: Curve = (),
    held_out_greedy_by_time: Curve = (),
) -> bytes:
    """PNG bytes: reward against policy version, plus a panel against seconds if given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = bool(train_reward_by_time or held_out_by_time)
    fig, axes = plt.subplots(
        1, 2 if timed else 1, figsize=(12 if timed else 7, 4), squeeze=False, sharey=True
    )
    panels = [(axes[0][0], train_reward, held_out, held_out_greedy, "policy version")]
    if timed:
        panels.append(
            (
                axes[0][1],
                train_reward_by_time,
                held_out_by_time,
                held_out_greedy_by_time,
                "seconds since policy version 0 was committed",
            )
        )
    for ax, train, evaluated, greedy, xlabel in panels:
        if train:
            ax.plot(*zip(*train, strict=True), label="training batch reward", alpha=0.6)
        if evaluated:
            ax.plot(*zip(*evaluated, strict=True), "o-", label="held-out reward")
        if greedy:
            ax.plot(*zip(*greedy, strict=True), "s--", label="held-out greedy accuracy")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
        if train or evaluated:
            ax.legend()
    fig.suptitle(title)
    return figure_png(fig)


def rewards_by_time(
    train_timeline: Sequence[tuple[int, float, int]],
    held_out: Curve,
    committed_at_ms: Mapping[int, int],
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(training reward, held-out reward) against seconds since version 0 was committed.

    A held-out point sits at the commit time of the version it evaluated, not at the
    time its evaluation finished: the evaluate role runs at low priority and skips
    ahead, so its own timestamps lag by a varying amount, while a version's commit is
    when that policy started to exist. Training rewards sit at their MLflow timestamps
    (logged right after the step that produced the version). Without a commit time for
    version 0 there is no common zero, and both lists are empty.
    """
    if 0 not in committed_at_ms:
        return [], []
    zero_ms = committed_at_ms[0]
    # Sorted by time: a resumed run logs its re-trained steps again, later.
    train = sorted(((at_ms - zero_ms) / 1000.0, reward) for _, reward, at_ms in train_timeline)
    evaluated = sorted(
        ((committed_at_ms[int(version)] - zero_ms) / 1000.0, reward)
        for version, reward in held_out
        if int(version) in committed_at_ms
    )
    return train, evaluated


def log_reward_curves(config: RunConfig, run_id: str, mlflow_run_id: str) -> str:
    """Plot the run's reward curves from MLflow and the registry, log the PNG; return its path."""
    uri = config.tracking.uri
    train_timeline = get_metric_timeline(uri, mlflow_run_id, "reward/mean")
    held_out = get_metric_history(uri, mlflow_run_id, "eval/reward")
    committed_at_ms = {
        v.policy_version: v.created_at_ms for v in run_registry(config, run_id).versions()
    }
    train_by_time, held_out_by_time = rewards_by_time(train_timeline, held_out, committed_at_ms)
    greedy = get_metric_history(uri, mlflow_run_id, "eval/greedy_accuracy")
    _, greedy_by_time = rewards_by_time(train_timeline, greedy, committed_at_ms)
    png = reward_curve_png(
        [(step, reward) for step, reward, _ in train_timeline],
        held_out,
        f"Sluice run {run_id}",
        train_reward_by_time=train_by_time,
        held_out_by_time=held_out_by_time,
        held_out_greedy=greedy,
        held_out_greedy_by_time=greedy_by_time,
    )
    log_figure_png(uri, mlflow_run_id, png, REWARD_CURVE_ARTIFACT)
    return REWARD_CURVE_ARTIFACT


def lag_distribution(uri: str, mlflow_run_id: str, max_staleness: int) -> list[int]:
    """Trained samples at each lag 0, 1, ... over the whole run, from the per-step counts.

    A step logged twice (retrained after a resume) counts once, as last logged. Buckets
    run to eta, and past it as far as a step logged any (they are logged contiguously).
    """
    counts: list[int] = []
    lag = 0
    while True:
        timeline = get_metric_timeline(uri, mlflow_run_id, f"staleness/count_lag_{lag}")
        if not timeline and lag > max_staleness:
            return counts
        # Ordered by step, then time: the latest logging of each step wins.
        per_step = {step: value for step, value, _ in timeline}
        counts.append(round(sum(per_step.values())))
        lag += 1


def staleness_histogram_png(counts: Sequence[int], max_staleness: int, title: str) -> bytes:
    """PNG bytes: a bar of trained samples per lag, each labelled with its share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    total = sum(counts)
    fig, ax = plt.subplots(figsize=(7, 4))
    lags = list(range(len(counts)))
    bars = ax.bar(lags, counts, color="tab:blue")
    for bar, n in zip(bars, counts, strict=True):
        if total and n:
            ax.annotate(
                f"{100 * n / total:.0f}%",
                (bar.get_x() + bar.get_width() / 2, n),
                ha="center",
                va="bottom",
            )
    ax.axvline(
        max_staleness + 0.5, color="tab:red", linestyle="--", label=f"bound η = {max_staleness}"
    )
    ax.set_xticks(lags)
    ax.set_xlim(-0.6, max(len(counts) - 1, max_staleness) + 1)
    ax.set_ylim(0, max(1, max(counts, default=0)) * 1.15)  # room for the shares
    ax.set_xlabel("lag: versions behind the weights trained (policy version − version_start)")
    ax.set_ylabel("trained samples")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(title)
    return figure_png(fig)


def log_staleness_histogram(
    config: RunConfig, run_id: str, mlflow_run_id: str
) -> tuple[str | None, list[int]]:
    """Plot the run's lag distribution from MLflow, log the PNG; return its path (None
    when the run trained no sample) and the counts per lag."""
    eta = config.staleness.max_staleness
    counts = lag_distribution(config.tracking.uri, mlflow_run_id, eta)
    if not sum(counts):
        return None, counts
    title = f"Sluice run {run_id}: {sum(counts)} trained samples by staleness"
    png = staleness_histogram_png(counts, eta, title)
    log_figure_png(config.tracking.uri, mlflow_run_id, png, STALENESS_HISTOGRAM_ARTIFACT)
    return STALENESS_HISTOGRAM_ARTIFACT, counts


def staleness_line(artifact: str | None, counts: Sequence[int]) -> str:
    """The summary's line on the lag distribution."""
    total = sum(counts)
    if not total:
        return "- staleness: no trained samples"
    shares = ", ".join(f"lag {k} {100 * n / total:.0f}%" for k, n in enumerate(counts))
    return f"- staleness of the {total} trained samples: {shares} (`{artifact}` in the MLflow run)"


def _mean_after_warmup(history: list[tuple[int, float]], skip: int = 5) -> float | None:
    values = [v for _, v in history[skip:]] or [v for _, v in history]
    return sum(values) / len(values) if values else None


def core_split(config: RunConfig, uri: str, mlflow_run_id: str, sync: bool) -> dict[str, Any]:
    """Threads each role had and what they did with them, from the run's own metrics.

    `trainer_idle` is the share of the trainer's wall time spent waiting for a batch
    (sync: the generation half of every step); `rollout_idle` the share of the rollout
    role's time with nothing admitted (held by the staleness gate). Per step, the
    trainer's compute (`train/step_time_s`) against the wall time per step says how
    the cores were shared; `suggested` splits this machine's cores in proportion to
    the busy time each side measured.
    """
    cores = os.cpu_count() or 1
    history = {
        key: get_metric_history(uri, mlflow_run_id, key)
        for key in (
            "train/idle_ratio",
            "rollout/idle_ratio",
            "train/step_time_s",
            "train/wall_time_s",
        )
    }
    last = {k: (h[-1][1] if h else None) for k, h in history.items()}
    wall = history["train/wall_time_s"]
    out: dict[str, Any] = {
        "cores": cores,
        "threads": (
            {"sync": role_threads(config, "sync")}
            if sync
            else {
                "rollout": role_threads(config, "rollout"),
                "train": role_threads(config, "train"),
            }
        ),
        "trainer_idle": last["train/idle_ratio"],
        "rollout_idle": None if sync else last["rollout/idle_ratio"],
        "train_compute_s_per_step": _mean_after_warmup(history["train/step_time_s"]),
        "wall_s_per_step": (
            (wall[-1][1] - wall[0][1]) / (wall[-1][0] - wall[0][0])
            if len(wall) > 1 and wall[-1][0] > wall[0][0]
            else None
        ),
    }
    trainer_idle, rollout_idle = out["trainer_idle"], out["rollout_idle"]
    if not sync and trainer_idle is not None and rollout_idle is not None and cores >= 2:
        out["suggested"] = suggest_split(cores, trainer_idle, rollout_idle)
    return out


def suggest_split(cores: int, trainer_idle: float, rollout_idle: float) -> dict[str, int]:
    """Cores in proportion to each side's busy share, at least one each."""
    train_busy, rollout_busy = 1.0 - trainer_idle, 1.0 - rollout_idle
    share = train_busy / max(1e-9, train_busy + rollout_busy)
    train_threads = min(cores - 1, max(1, round(cores * share)))
    return {"rollout": cores - train_threads, "train": train_threads}


def core_split_lines(split: dict[str, Any]) -> list[str]:
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.0f}%"

    threads = ", ".join(f"{role} {n}" for role, n in split["threads"].items())
    lines = [f"- cores: {split['cores']}; torch threads: {threads}"]
    per_step = split.get("wall_s_per_step")
    compute = split.get("train_compute_s_per_step")
    if per_step and compute:
        lines.append(
            f"- per step: {per_step:.2f} s of wall time, {compute:.2f} s of it training compute"
        )
    lines.append(
        f"- trainer idle {pct(split['trainer_idle'])} (waiting for data)"
        + (
            ""
            if split["rollout_idle"] is None
            else f", rollout idle {pct(split['rollout_idle'])} (held by the staleness gate)"
        )
    )
    if "suggested" in split:
        suggested = split["suggested"]
        lines.append(
            f"- measured busy time suggests rollout {suggested['rollout']} / train "
            f"{suggested['train']} threads on this machine (`threads_per_role` sets both)"
        )
    return lines


def summarise(
    config: RunConfig, run_id: str, mlflow_run_id: str, sync: bool = False
) -> dict[str, Any]:
    uri = config.tracking.uri
    held_out = get_metric_history(uri, mlflow_run_id, "eval/reward")
    throughput = get_metric_history(uri, mlflow_run_id, "train/effective_tokens_per_s")
    wall = get_metric_history(uri, mlflow_run_id, "train/wall_time_s")
    registry = run_registry(config, run_id)
    versions = [v for v in registry.versions() if not v.lost]  # the surviving lineage
    latest = registry.newest_durable()
    result: dict[str, Any] = {
        "run_id": run_id,
        "mlflow_run_id": mlflow_run_id,
        "mlflow_run_url": run_ui_url(uri, mlflow_run_id),
        "registered_model": registered_model_name(config, run_id),
        "policy_versions": len(versions),
        "final_policy_version": latest.policy_version if latest else None,
        "checkpoint_uri": latest.checkpoint_uri if latest else None,
        "held_out_curve": held_out,
    }
    if held_out:
        result["held_out_reward_start"] = held_out[0][1]
        result["held_out_reward_final"] = held_out[-1][1]
    if throughput:
        result["effective_tokens_per_s"] = throughput[-1][1]
    if wall:
        result["train_wall_time_s"] = wall[-1][1]
    result["core_split"] = core_split(config, uri, mlflow_run_id, sync=sync)
    result["trainer_failovers"] = failover_summary(
        read_failovers(config, run_id), [v.created_at_ms / 1000 for v in versions]
    )
    train = read_statuses(config, run_paths(config, run_id)).get("train", {})
    result["watchdog"] = {
        "firings": train.get("watchdog_firings", 0),
        "by_signal": train.get("watchdog_by_signal", {}),
        "groups_skipped": train.get("groups_skipped", 0),
    }
    return result


def failover_lines(failovers: list[dict[str, Any]]) -> list[str]:
    """The summary's line on trainer failovers (none when there were none)."""
    if not failovers:
        return []

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f} s"

    each = "; ".join(
        f"next version committed {seconds(f['to_next_commit_s'])} after the loss, "
        f"{f['samples_generated_meanwhile'] if f['samples_generated_meanwhile'] is not None else '-'}"
        " samples generated meanwhile"
        for f in failovers
    )
    return [f"- trainer failovers: {len(failovers)} ({each})"]


def watchdog_line(watchdog: dict[str, Any]) -> str:
    """The summary's line on the mismatch watchdog."""
    by_signal = ", ".join(f"{name} {n}" for name, n in sorted(watchdog["by_signal"].items()))
    return (
        f"- mismatch watchdog: {watchdog['firings']} firing(s)"
        + (f" ({by_signal})" if by_signal else "")
        + f", {watchdog['groups_skipped']} group(s) skipped"
    )


@task(name="publish-summary", cache_policy=NO_CACHE, persist_result=False)
def publish_summary(
    config: dict[str, Any], run_id: str, mlflow_run_id: str, sync: bool = False
) -> dict[str, Any]:
    """Reward curves to MLflow, summary and per-version table to Prefect; closes the MLflow run.

    `sync`: the run came from the colocated baseline (one role, no rollout side).
    """
    cfg = RunConfig.model_validate(config)
    result = summarise(cfg, run_id, mlflow_run_id, sync=sync)
    result["reward_curve_artifact"] = curves = log_reward_curves(cfg, run_id, mlflow_run_id)
    histogram, lag_counts = log_staleness_histogram(cfg, run_id, mlflow_run_id)
    result["staleness_histogram_artifact"], result["lag_counts"] = histogram, lag_counts
    registry = run_registry(cfg, run_id)
    rows = [
        {
            "policy_version": v.policy_version,
            "model_version": v.model_version,
            "held_out_reward": v.tags.get(TAG_EVAL_REWARD, ""),
            "pass_at_1": v.tags.get(eval_tag("pass_at_1"), ""),
            "staleness_mean": v.tags.get("staleness_mean", ""),
            "checkpoint_uri": v.checkpoint_uri,
        }
        for v in registry.versions()
        if TAG_EVAL_REWARD in v.tags
    ]
    create_table_artifact(
        rows, key="policy-versions", description="Held-out results per policy version"
    )
    start, final = result.get("held_out_reward_start"), result.get("held_out_reward_final")
    lines = [
        f"# Sluice run `{run_id}`",
        "",
        f"- held-out reward: **{start if start is None else f'{start:.3f}'}** → **{final if final is None else f'{final:.3f}'}**",
        f"- policy versions committed: {result['policy_versions']} (newest: {result['final_policy_version']})",
        f"- staleness bound η = {cfg.staleness.max_staleness}, interruptible = {cfg.rollout.interruptible}",
        *([f"- {describe_mode(cfg)}"] if cfg.mode else []),
        f"- effective training throughput: {result.get('effective_tokens_per_s', float('nan')):.0f} trained tokens/s",
        watchdog_line(result["watchdog"]),
        f"- checkpoint: `{result['checkpoint_uri']}`",
        f"- MLflow run: {result['mlflow_run_url']} (`{ui_command(cfg.tracking.uri)}`)",
        f"- reward curves: `{curves}` in the MLflow run",
        staleness_line(histogram, lag_counts),
        *failover_lines(result["trainer_failovers"]),
        *core_split_lines(result["core_split"]),
    ]
    create_markdown_artifact(
        "\n".join(lines), key="run-summary", description=f"Summary of {run_id}"
    )
    end_run(cfg.tracking.uri, mlflow_run_id)
    return result
