"""Held-out evaluation of committed policy versions.

The held-out reward (`eval/reward`) is the mean reward of `problem.eval_samples`
samples per held-out prompt at `problem.eval_temperature` (default: the rollout
temperature). That is the quantity RL maximises, measured on prompts it never trains
on. Greedy accuracy (`eval/greedy_accuracy`) is logged beside it: it moves more slowly,
because RL first sharpens the sampling distribution towards answers the policy could
already give, and it says whether the policy's single most likely answer improved.
Results go to MLflow (`eval/reward` at step = policy version) and onto the model
version as tags, so the registry shows which version is best.

As a role beside training, it polls the registry and evaluates version 0, every
`eval_every`-th version and the final one; it runs at low CPU priority so it takes
what generation and training leave. On demand, `evaluate_version` is the Prefect task
the `evaluate` flow (`sluice eval`) runs for one chosen version.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engines.inference.engine import InferenceEngine
from engines.inference.types import GenerationRequest, SamplingParams
from engines.verifiers import load_verifier
from infra.checkpoints import fetch_checkpoint
from infra.config import RunConfig
from infra.registry import CheckpointRegistry, CommittedVersion, RegistryError
from infra.tracking import log_metrics
from tasks.common import RunControl, StatusReporter, run_paths, run_registry
from tasks.problem import PromptSource, load_tokenizer

log = logging.getLogger("sluice.evaluate")


def evaluate_model_dir(
    config: RunConfig, model_dir: Path, policy_version: int = 0
) -> dict[str, float]:
    """pass@1 of the weights in `model_dir` on the run's held-out prompts."""
    source = PromptSource(config, load_tokenizer(model_dir))
    rows = source.eval_rows()
    verifier = load_verifier(
        config.reward.verifier,
        correct_reward=config.reward.correct_reward,
        incorrect_reward=config.reward.incorrect_reward,
    )
    k = config.problem.eval_samples
    temperature = config.problem.eval_temperature
    if temperature is None:
        temperature = config.rollout.temperature
    with_greedy = config.problem.eval_greedy and temperature > 0
    engine = InferenceEngine(
        model_dir,
        max_batch_size=config.rollout.max_batch_size,
        seed=config.seed,
        weight_version=policy_version,
    )
    started = time.monotonic()
    requests = []
    for i, row in enumerate(rows):
        ids = source.encode_prompt(row)
        # Fixed seeds: every version is scored on the same random numbers, so two
        # versions differ by their weights, not by their luck.
        for j in range(k):
            sampling = SamplingParams(
                max_new_tokens=config.rollout.max_new_tokens,
                temperature=temperature,
                seed=config.seed * 1_000_003 + i * 101 + j,
            )
            requests.append(GenerationRequest(prompt_token_ids=ids, sampling=sampling))
        if with_greedy:
            sampling = SamplingParams(max_new_tokens=config.rollout.max_new_tokens, temperature=0.0)
            requests.append(GenerationRequest(prompt_token_ids=ids, sampling=sampling))
    outputs = engine.generate(requests)
    engine.shutdown()
    per_prompt = k + int(with_greedy)
    rewards, correct, lengths, greedy_correct = [], [], [], []
    for n, out in enumerate(outputs):
        row = rows[n // per_prompt]
        text = source.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
        reward = float(verifier(row, text))
        if with_greedy and n % per_prompt == k:
            greedy_correct.append(reward >= config.reward.correct_reward)
            continue
        rewards.append(reward)
        correct.append(reward >= config.reward.correct_reward)
        lengths.append(len(out.output_token_ids))
    metrics = {
        "eval/reward": float(np.mean(rewards)),
        "eval/pass_at_1": float(np.mean(correct)),
        "eval/response_length_mean": float(np.mean(lengths)),
        "eval/prompts": float(len(rows)),
        "eval/time_s": time.monotonic() - started,
    }
    metrics.update(reward_by_size(rows, rewards, k))
    if with_greedy:
        metrics["eval/greedy_accuracy"] = float(np.mean(greedy_correct))
    elif temperature == 0:
        metrics["eval/greedy_accuracy"] = metrics["eval/pass_at_1"]
    return metrics


SIZE_BUCKETS = ((2, 2), (3, 4), (5, 8), (9, 16), (17, 1_000_000))
"""Problem sizes (the built-in task's `num_terms`) reported separately: RL gains and
losses are rarely spread evenly over easy and hard prompts."""


def reward_by_size(rows: list[dict[str, Any]], rewards: list[float], k: int) -> dict[str, float]:
    """Held-out reward per size bucket, for rows that carry a `num_terms` size."""
    out: dict[str, float] = {}
    if not rows or any(not isinstance(r.get("num_terms"), int) for r in rows):
        return out
    for low, high in SIZE_BUCKETS:
        chosen = [
            rewards[i * k + j]
            for i, row in enumerate(rows)
            if low <= row["num_terms"] <= high
            for j in range(k)
        ]
        if chosen:
            name = f"{low}" if low == high else f"{low}-{high}" if high < 1_000_000 else f"{low}_up"
            out[f"eval/reward_terms_{name}"] = float(np.mean(chosen))
    return out


def eval_weights_dir(config: RunConfig, run_id: str) -> Path:
    """Local cache of the checkpoints evaluated for one run (role and on-demand flow share it)."""
    return Path(config.workdir) / "runs" / run_id / "eval-weights"


def evaluate_checkpoint(
    config: RunConfig, run_id: str, policy_version: int, checkpoint_uri: str
) -> dict[str, float]:
    """Fetch one committed checkpoint into the run's evaluation cache and score it.

    The evaluate role, `sluice eval` and the time-to-target benchmark share the cache,
    so weights one of them fetched are not downloaded again.
    """
    local = fetch_checkpoint(
        checkpoint_uri,
        eval_weights_dir(config, run_id),
        storage_options=config.storage.options,
        keep_latest=2,
    )
    return evaluate_model_dir(config, local, policy_version)


def should_evaluate(version: int, config: RunConfig) -> bool:
    every = config.trainer.eval_every
    return (
        version == 0
        or version >= config.trainer.total_steps
        or (every > 0 and version % every == 0)
    )


def record(
    config: RunConfig,
    registry: CheckpointRegistry,
    mlflow_run_id: str,
    version: CommittedVersion,
    metrics: dict[str, float],
) -> None:
    log_metrics(config.tracking.uri, mlflow_run_id, metrics, step=version.policy_version)
    registry.set_tag(version.policy_version, "eval.pass_at_1", f"{metrics['eval/pass_at_1']:.4f}")
    registry.set_tag(version.policy_version, "eval.reward", f"{metrics['eval/reward']:.4f}")


def evaluate_loop(config: RunConfig, run_id: str, mlflow_run_id: str) -> None:
    with contextlib.suppress(OSError):
        os.nice(5)
    paths = run_paths(config, run_id)
    control = RunControl(config, paths)
    control.install_signal_handlers()
    status = StatusReporter(config, paths, "evaluate")
    registry = run_registry(config, run_id)
    done: dict[int, dict[str, Any]] = {
        v.policy_version: {"eval/reward": float(v.tags["eval.reward"])}
        for v in registry.versions()
        if "eval.reward" in v.tags
    }
    history = sorted((v, m["eval/reward"]) for v, m in done.items())
    while True:
        finished = control.done_marker() is not None
        versions = [v for v in registry.versions() if v.policy_version not in done]
        wanted = [v for v in versions if should_evaluate(v.policy_version, config)]
        if finished and not wanted:
            # The run ended: make sure the newest version was evaluated, then leave.
            latest = registry.latest()
            if latest is not None and latest.policy_version not in done:
                wanted = [latest]
            else:
                break
        if not wanted:
            status.update(state="waiting", last_reward=history[-1][1] if history else None)
            control.sleep(config.rollout.poll_interval_s * 2)
            if control._stop.is_set():
                break
            continue
        # Oldest first for a readable curve, but never fall behind by more than one.
        target = wanted[0] if len(wanted) == 1 else wanted[-1] if not finished else wanted[0]
        metrics = evaluate_checkpoint(config, run_id, target.policy_version, target.checkpoint_uri)
        record(config, registry, mlflow_run_id, target, metrics)
        done[target.policy_version] = metrics
        history.append((target.policy_version, metrics["eval/reward"]))
        log.info(
            "policy version %d: held-out reward %.3f", target.policy_version, metrics["eval/reward"]
        )
        status.update(
            force=True,
            state="running",
            last_version=target.policy_version,
            last_reward=metrics["eval/reward"],
            history=history,
        )
        # Versions skipped in favour of a newer one are not evaluated later.
        for v in wanted:
            if v.policy_version < target.policy_version:
                done.setdefault(v.policy_version, {"skipped": True})
    status.update(force=True, state="stopped", history=history)


@task(name="evaluate-version", cache_policy=NO_CACHE, persist_result=False)
def evaluate_version(
    config: dict[str, Any], run_id: str, policy_version: int, mlflow_run_id: str
) -> dict[str, float]:
    """pass@1 of committed `policy_version` of `run_id`, logged to `mlflow_run_id` and tagged.

    Plain arguments only: the task may run in another process than the flow that calls it.
    """
    cfg = RunConfig.model_validate(config)
    registry = run_registry(cfg, run_id)
    target = registry.get(policy_version)
    if target is None:
        raise RegistryError(
            f"policy version {policy_version} of run {run_id!r} is not committed in "
            f"{registry.model_name!r} at {cfg.tracking.uri}"
        )
    metrics = evaluate_checkpoint(cfg, run_id, policy_version, target.checkpoint_uri)
    record(cfg, registry, mlflow_run_id, target, metrics)
    get_run_logger().info(
        "run %s policy version %d: held-out reward %.3f, pass@1 %.3f",
        run_id,
        policy_version,
        metrics["eval/reward"],
        metrics["eval/pass_at_1"],
    )
    return metrics
