"""The colocated synchronous baseline: generate a batch, wait for its longest response,
score it, train on it, load the new weights, repeat — on the same cores.

This is how synchronous systems (verl-style) spend a step, and what `sluice bench
async-vs-sync` compares against. It shares every engine with the async path (the
same inference engine, verifier and trainer step) and commits each version to the
same registry, so evaluation and reports read both runs the same way.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from engines.inference.engine import InferenceEngine
from engines.inference.types import GenerationRequest, SamplingParams
from engines.verifiers import load_verifier
from infra.checkpoints import fetch_checkpoint, save_checkpoint
from infra.config import RunConfig
from infra.tracking import log_metrics
from tasks.common import (
    Background,
    RunControl,
    StatusReporter,
    group_key,
    run_paths,
    run_registry,
)
from tasks.problem import PromptSource, load_tokenizer
from tasks.train import build_trainer, samples_from_table, staleness_stats

log = logging.getLogger("sluice.sync")


def sync_loop(config: RunConfig, run_id: str, mlflow_run_id: str) -> None:
    paths = run_paths(config, run_id)
    control = RunControl(config, paths)
    status = StatusReporter(config, paths, "train")
    registry = run_registry(config, run_id)
    latest = registry.latest()
    if latest is None:
        raise RuntimeError("no committed policy version: prepare the policy first")
    local_root = Path(config.workdir) / "runs" / run_id / "sync"
    model_dir = fetch_checkpoint(
        latest.checkpoint_uri, local_root / "init", storage_options=config.storage.options
    )
    source = PromptSource(config, load_tokenizer(model_dir))
    verifier = load_verifier(
        config.reward.verifier,
        correct_reward=config.reward.correct_reward,
        incorrect_reward=config.reward.incorrect_reward,
    )
    engine = InferenceEngine(
        model_dir,
        max_batch_size=config.rollout.max_batch_size,
        seed=config.seed,
        weight_version=latest.policy_version,
    )
    trainer = build_trainer(config, model_dir)
    cfg, B, G = config, config.trainer.prompts_per_batch, config.rollout.group_size
    version = latest.policy_version
    background = Background("sync-commit")

    def commit(local: Path, version: int, tags: dict[str, str]) -> None:
        uri = save_checkpoint(local, paths.checkpoint(version), storage_options=cfg.storage.options)
        registry.commit(version, uri, run_id=mlflow_run_id, trainer_step=version, tags=tags)

    started = time.monotonic()
    generate_s = trained_tokens = 0.0
    while version < cfg.trainer.total_steps and not control.should_stop():
        t0 = time.monotonic()
        rows, requests = [], []
        for g in range(version * B, (version + 1) * B):
            row, ids = source.train_prompt(g)
            for k in range(G):
                rows.append((g, k, row, ids))
                requests.append(
                    GenerationRequest(
                        prompt_token_ids=ids,
                        sampling=SamplingParams(
                            max_new_tokens=cfg.rollout.max_new_tokens,
                            temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p,
                            top_k=cfg.rollout.top_k,
                            seed=cfg.seed * 1_000_003 + g * 1009 + k,
                        ),
                    )
                )
        outputs = engine.generate(requests)  # returns when the longest response is done
        generate_s += time.monotonic() - t0
        rewards = [
            float(
                verifier(
                    row, source.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
                )
            )
            for (_, _, row, _), out in zip(rows, outputs, strict=True)
        ]
        table = pa.table(
            {
                "group_id": [group_key(g) for g, _, _, _ in rows],
                "reward": pa.array(rewards, pa.float32()),
                "prompt_token_ids": [ids for _, _, _, ids in rows],
                "response_token_ids": [o.output_token_ids for o in outputs],
                "behaviour_logprobs": [o.behaviour_logprobs for o in outputs],
                "finish_reason": [o.finish_reason for o in outputs],
                "version_start": pa.array(
                    [o.version_start or version for o in outputs], pa.int32()
                ),
                "version_end": pa.array([o.version_end or version for o in outputs], pa.int32()),
            }
        )
        samples, stats = samples_from_table(table, cfg)
        stats.update(staleness_stats(table, version))
        metrics = trainer.train_step(samples) if samples else {}
        version += 1
        out_dir = local_root / f"v{version:06d}"
        trainer.save(out_dir, extra={"policy_version": version})
        engine.update_weights_from_disk(out_dir, version)
        # The previous step's upload and commit had this step's generation and training
        # to run in; only now may its local copy go.
        background.wait()
        for old in local_root.glob("v*"):
            if old != out_dir:
                shutil.rmtree(old, ignore_errors=True)
        if version % cfg.trainer.publish_every == 0 or version == cfg.trainer.total_steps:
            background.submit(
                commit,
                out_dir,
                version,
                {"reward_mean": f"{stats['reward/mean']:.4f}", "mode": "sync"},
            )
        trained_tokens += metrics.get("train/trained_tokens", 0.0)
        elapsed = time.monotonic() - started
        longest = max(len(o.output_token_ids) for o in outputs)
        mean = float(np.mean([len(o.output_token_ids) for o in outputs]))
        metrics.update(stats)
        metrics.update(
            {
                "train/effective_tokens_per_s": trained_tokens / elapsed,
                "train/wall_time_s": elapsed,
                "train/idle_ratio": generate_s / elapsed,  # the trainer waits while generating
                "rollout/longest_over_mean_length": longest / max(1.0, mean),
            }
        )
        background.submit(log_metrics, cfg.tracking.uri, mlflow_run_id, metrics, step=version)
        status.update(
            state="running",
            step=version,
            reward_mean=stats["reward/mean"],
            staleness_mean=0.0,
            trained_tokens_per_s=metrics["train/effective_tokens_per_s"],
            wall_time_s=elapsed,
        )
    background.close()
    engine.shutdown()
    if version >= cfg.trainer.total_steps:
        control.mark_done(f"trained {cfg.trainer.total_steps} steps (sync)")
    status.update(force=True, state="finished", step=version)
