"""Held-out evaluation of committed policy versions.

pass@1 on the run's fixed held-out prompts, averaged over `problem.eval_samples`
samples per prompt at the rollout temperature (greedy when eval_samples is 1 and
temperature would only add noise to a small held-out set: see `eval_temperature`).
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

from engines.inference import GenerationRequest, InferenceEngine, SamplingParams
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
    greedy = k == 1
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
        for j in range(k):
            sampling = SamplingParams(
                max_new_tokens=config.rollout.max_new_tokens,
                temperature=0.0 if greedy else config.rollout.temperature,
                seed=config.seed * 1_000_003 + i * 101 + j,
            )
            requests.append(GenerationRequest(prompt_token_ids=ids, sampling=sampling))
    outputs = engine.generate(requests)
    engine.shutdown()
    rewards, correct, lengths = [], [], []
    for n, out in enumerate(outputs):
        row = rows[n // k]
        text = source.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
        reward = float(verifier(row, text))
        rewards.append(reward)
        correct.append(reward >= config.reward.correct_reward)
        lengths.append(len(out.output_token_ids))
    return {
        "eval/reward": float(np.mean(rewards)),
        "eval/pass_at_1": float(np.mean(correct)),
        "eval/response_length_mean": float(np.mean(lengths)),
        "eval/prompts": float(len(rows)),
        "eval/time_s": time.monotonic() - started,
    }


def eval_weights_dir(config: RunConfig, run_id: str) -> Path:
    """Local cache of the checkpoints evaluated for one run (role and on-demand flow share it)."""
    return Path(config.workdir) / "runs" / run_id / "eval-weights"


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
    cache = eval_weights_dir(config, run_id)
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
        local = fetch_checkpoint(
            target.checkpoint_uri,
            cache / f"v{target.policy_version:06d}",
            storage_options=config.storage.options,
        )
        metrics = evaluate_model_dir(config, local, target.policy_version)
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
    # The evaluate role's cache, so weights it already fetched are not downloaded again.
    local = fetch_checkpoint(
        target.checkpoint_uri,
        eval_weights_dir(cfg, run_id) / f"v{policy_version:06d}",
        storage_options=cfg.storage.options,
    )
    metrics = evaluate_model_dir(cfg, local, policy_version)
    record(cfg, registry, mlflow_run_id, target, metrics)
    get_run_logger().info(
        "run %s policy version %d: held-out reward %.3f, pass@1 %.3f",
        run_id,
        policy_version,
        metrics["eval/reward"],
        metrics["eval/pass_at_1"],
    )
    return metrics
