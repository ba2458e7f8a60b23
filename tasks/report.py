"""What a finished run leaves for people: a reward curve, a summary, a table of versions.

MLflow gets the reward-curve PNG; Prefect gets a markdown summary artifact and a table
artifact with the held-out result of every evaluated policy version.
"""

from __future__ import annotations

import io
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from infra.config import RunConfig
from infra.tracking import end_run, get_metric_history, log_figure_png
from tasks.common import registered_model_name, run_registry


def reward_curve_png(
    train_reward: list[tuple[int, float]], held_out: list[tuple[int, float]], title: str
) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if train_reward:
        ax.plot(*zip(*train_reward, strict=True), label="training batch reward", alpha=0.6)
    if held_out:
        ax.plot(*zip(*held_out, strict=True), "o-", label="held-out reward")
    ax.set_xlabel("policy version")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def mlflow_run_url(tracking_uri: str, run_id: str) -> str:
    base = tracking_uri if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    return f"{base.rstrip('/')}/#/experiments/0/runs/{run_id}"


def summarise(config: RunConfig, run_id: str, mlflow_run_id: str) -> dict[str, Any]:
    uri = config.tracking.uri
    held_out = get_metric_history(uri, mlflow_run_id, "eval/reward")
    throughput = get_metric_history(uri, mlflow_run_id, "train/effective_tokens_per_s")
    wall = get_metric_history(uri, mlflow_run_id, "train/wall_time_s")
    registry = run_registry(config, run_id)
    versions = registry.versions()
    latest = registry.latest()
    result: dict[str, Any] = {
        "run_id": run_id,
        "mlflow_run_id": mlflow_run_id,
        "mlflow_run_url": mlflow_run_url(uri, mlflow_run_id),
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
    return result


@task(name="publish-summary", cache_policy=NO_CACHE, persist_result=False)
def publish_summary(config: dict[str, Any], run_id: str, mlflow_run_id: str) -> dict[str, Any]:
    """Reward curve to MLflow, summary and per-version table to Prefect; closes the MLflow run."""
    cfg = RunConfig.model_validate(config)
    result = summarise(cfg, run_id, mlflow_run_id)
    train_reward = get_metric_history(cfg.tracking.uri, mlflow_run_id, "reward/mean")
    png = reward_curve_png(train_reward, result["held_out_curve"], f"Sluice run {run_id}")
    log_figure_png(cfg.tracking.uri, mlflow_run_id, png, "plots/reward_curve.png")
    registry = run_registry(cfg, run_id)
    rows = [
        {
            "policy_version": v.policy_version,
            "model_version": v.model_version,
            "held_out_reward": v.tags.get("eval.reward", ""),
            "pass_at_1": v.tags.get("eval.pass_at_1", ""),
            "staleness_mean": v.tags.get("staleness_mean", ""),
            "checkpoint_uri": v.checkpoint_uri,
        }
        for v in registry.versions()
        if "eval.reward" in v.tags
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
        f"- effective training throughput: {result.get('effective_tokens_per_s', float('nan')):.0f} trained tokens/s",
        f"- checkpoint: `{result['checkpoint_uri']}`",
        f"- MLflow run: {result['mlflow_run_url']} (`mlflow ui --backend-store-uri {cfg.tracking.uri}`)",
    ]
    create_markdown_artifact(
        "\n".join(lines), key="run-summary", description=f"Summary of {run_id}"
    )
    end_run(cfg.tracking.uri, mlflow_run_id)
    return result
