"""The colocated synchronous baseline: generate a batch, wait for its longest response,
score it, train on it, load the new weights, repeat — on the same cores.

This is how synchronous systems (verl-style) spend a step, and what `sluice bench
async-vs-sync` compares against. It shares every engine with the async path (the
same inference engine, verifier and trainer step) and commits each version to the
same registry, so evaluation and reports read both runs the same way.
"""

from __future__ import annotations

import shutil
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from sluice.engines.env.verifiers import load_verifier
from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.types import GenerationRequest, SamplingParams
from sluice.engines.inference.weight_sync import unique_named_tensors
from sluice.engines.policy.model import resolve_device
from sluice.engines.rl.groups import sample_seed
from sluice.engines.rl.samples import (
    batch_rows,
    batch_table,
)
from sluice.engines.rl.trainer_files import ADAPTER_DIR
from sluice.infra.config.run import RunConfig
from sluice.tasks.process.ray_ranks import RankStart
from sluice.tasks.prompts import PromptSource
from sluice.tasks.run.cadence import cadence_of, must_be_durable
from sluice.tasks.run.metrics_file import log_step_metrics
from sluice.tasks.run.state_timer import OTHER, StateTimer
from sluice.tasks.run.threads import Background
from sluice.tasks.run.versions import fetch_reference, save_version, save_version_later
from sluice.tasks.train.base import (
    TrainingRole,
    build_trainer,
)
from sluice.tasks.train.steps import StepBook

SYNC_STATES = ("start", "generate", "score", "proximal", "train", "publish", "reload")
"""Where the colocated role's time goes (tasks/run/state_timer.py): setup, generating a
batch to its longest response, scoring it, the π_prox pass the step measures, the rest
of the step, the publish on the critical path (the wait for the previous write and
commit, the save or host copy), and loading the new weights into the engine."""
SAMPLED_LENGTHS = 4096
"""How many of the newest (prompt, response) lengths the status keeps: the planner's workload."""


def step_requests(
    config: RunConfig, source: Any, step: int
) -> tuple[list[tuple[int, dict[str, Any], list[int]]], list[GenerationRequest]]:
    """Step `step`'s B prompt groups x G samples: (group index, prompt row, prompt ids) and
    the seeded generation request of every response, in the same order.

    `source` is the run's `PromptSource` (anything with `train_prompt(index, version)` and
    `stop_token_ids`, the policy's end tokens).
    """
    B, G = config.trainer.prompts_per_batch, config.rollout.group_size
    rollout = config.rollout
    prompts, requests = [], []
    for g in range(step * B, (step + 1) * B):
        row, ids = source.train_prompt(g, step)
        for k in range(G):
            prompts.append((g, row, ids))
            requests.append(
                GenerationRequest(
                    prompt_token_ids=ids,
                    sampling=SamplingParams(
                        max_new_tokens=rollout.max_new_tokens,
                        temperature=rollout.temperature,
                        top_p=rollout.top_p,
                        top_k=rollout.top_k,
                        stop_token_ids=source.stop_token_ids,
                        seed=sample_seed(config.seed, g, k),
                    ),
                )
            )
    return prompts, requests


class SyncRole(TrainingRole):
    """Generate, score and train on the same cores; writes the `train` status document."""

    name = "train"
    thread_role = "sync"
    finished_note = " (sync)"

    def keep_newest(
        self, trainer: Any, local_root: Path, version: int, last_durable_version: int
    ) -> None:
        """A clean stop keeps the newest published version: the trainer still holds its
        weights, so one not yet durable is saved and committed."""
        if last_durable_version < version and version % self.config.trainer.publish_every == 0:
            saved = save_version(trainer, local_root / f"v{version:06d}", version)
            self.commit_version(saved, version, {"mode": "sync"}, registered=True)

    def run(self) -> None:
        cfg = self.config
        timer = StateTimer(SYNC_STATES, initial="start")
        latest = self.start_version()
        local_root = self.local_dir("sync")
        model_dir = self.training_dir(latest, local_root)
        source = PromptSource(cfg).use_policy(model_dir)
        verifier = load_verifier(
            cfg.reward.verifier,
            correct_reward=cfg.reward.correct_reward,
            incorrect_reward=cfg.reward.incorrect_reward,
            numeric_closeness=cfg.reward.numeric_closeness,
        )
        adapter = model_dir / ADAPTER_DIR  # a resumed LoRA run: its base, then the adapter
        engine = InferenceEngine(
            model_dir,
            device=resolve_device(cfg.device),
            dtype=cfg.rollout.dtype,
            max_batch_size=cfg.rollout.max_batch_size,
            max_seq_len=cfg.rollout.max_seq_len,
            seed=cfg.seed,
            weight_version=0 if adapter.is_dir() else latest.policy_version,
        )
        if adapter.is_dir():
            engine.update_weights_from_disk(adapter, latest.policy_version)
        reference = fetch_reference(cfg, self.registry, local_root / "reference")
        trainer = build_trainer(
            cfg, model_dir, reference, start=RankStart(run_id=self.run_id, version=latest)
        )
        book = StepBook(cfg, self.mlflow_run_id)
        version = latest.policy_version
        background = Background("sync-metrics")
        durable = Background("sync-durable")
        total = cfg.trainer.total_steps
        cadence = cadence_of(cfg, version, time.monotonic())
        # Only a torch trainer of full weights serves a version without writing it.
        can_skip = (
            cfg.trainer.background_save
            and not cfg.trainer.lora.rank
            and cfg.trainer.backend == "torch"
            and cfg.trainer.world_size == 1
        )
        book.start(version)
        # (prompt, response) lengths of the newest samples: what the capacity planner
        # draws its workload from (the async roles' come from the rollouts stream).
        lengths: deque[tuple[int, int]] = deque(maxlen=SAMPLED_LENGTHS)
        while version < cfg.trainer.total_steps and not self.control.should_stop():
            timer.enter("generate")
            t0 = time.monotonic()
            prompts, requests = step_requests(cfg, source, version)
            outputs = engine.generate(requests)  # returns when the longest response is done
            step_generate_s = time.monotonic() - t0
            book.idle_s += step_generate_s  # the trainer waits while the engine generates
            lengths.extend((len(o.prompt_token_ids), len(o.output_token_ids)) for o in outputs)
            timer.enter("score")
            rewards = [
                float(
                    verifier(
                        row,
                        source.tokenizer.decode(out.output_token_ids, skip_special_tokens=True),
                    )
                )
                for (_, row, _), out in zip(prompts, outputs, strict=True)
            ]
            timer.enter("train")
            table = batch_table(batch_rows(prompts, outputs, rewards, version))
            samples, stats = book.batch(table, version)
            metrics, firings, verdict = book.train(trainer, samples, version + 1, timer)
            if verdict is not None and verdict.action == "stop":
                background.submit(
                    log_step_metrics,
                    cfg,
                    self.run_id,
                    self.mlflow_run_id,
                    book.stopped(metrics, stats, firings),
                    version + 1,
                )
                background.close()
                durable.close()
                # A refused update leaves the tensors at `version`: it can be made durable.
                if metrics.get("train/applied_minibatches", 1.0) <= 0:
                    self.keep_newest(trainer, local_root, version, cadence.last_durable_version)
                self.stop_for_watchdog(verdict, book.watch)
            book.settle(metrics, table, firings, verdict)
            version += 1
            timer.enter("publish")
            # The same durability policy as the train role (tasks/run/cadence.py): a
            # version the cadence does not make durable is served (the engine is right
            # here) and registered, and nothing of it is written.
            published = version % cfg.trainer.publish_every == 0 or version == total
            writing = durable.pending()
            must = must_be_durable(cfg, version) or not can_skip
            decision = (
                cadence.decide(version, time.monotonic(), must=must, writing=writing)
                if published
                else "servable"
            )
            if decision == "wait":
                # With every version durable, the step before's write, upload and commit
                # had this step's generation and training to run in.
                durable.wait()
            if published:
                cadence.published(version, time.monotonic(), decision)
            tags = {"reward_mean": f"{stats['reward/mean']:.4f}", "mode": "sync"}
            if published:
                tags.update(book.watch.take_tags())
            local = local_root / f"v{version:06d}"
            deferred = None
            if decision in ("durable", "wait") and cfg.trainer.background_save:
                deferred = save_version_later(trainer, local, version)
            if deferred is None and decision in ("durable", "wait"):
                saved = save_version(trainer, local, version)
                timer.enter("reload")
                engine.update_weights_from_disk(saved.policy, version)
            else:
                # The engine is in this process: it takes the weights themselves (one
                # copy, in its dtype), and the checkpoint is written, like the upload and
                # the commit, while the next step generates and trains.
                timer.enter("reload")
                named = unique_named_tensors(trainer.model.state_dict())
                engine.update_weights_from_tensors(named, version, source="the trainer")
            timer.enter(OTHER)
            if deferred is not None:
                saved, write, _ = deferred
                durable.submit(write)
            if decision in ("durable", "wait"):
                for old in local_root.glob("v*"):
                    if old != saved.policy.parent:
                        shutil.rmtree(old, ignore_errors=True)
                durable.submit(self.commit_version, saved, version, tags)
            elif published:
                background.submit(self.register_servable, version, tags)
            elapsed = book.rates(metrics, stats, self.last_commit_parts)
            longest = max(len(o.output_token_ids) for o in outputs)
            mean = float(np.mean([len(o.output_token_ids) for o in outputs]))
            metrics["rollout/longest_over_mean_length"] = longest / max(1.0, mean)
            metrics["rollout/generate_time_s"] = step_generate_s
            # The step's timeline (its states sum to `time/step_s`); the background
            # thread's write, upload and commit are outside it.
            metrics.update(timer.lap_metrics())
            metrics.update(background.report())
            metrics.update(durable.report("background/durable_"))
            metrics["train/durability_skipped"] = float(cadence.skipped)
            metrics["train/durability_lag_s"] = cadence.lag_s(time.monotonic())
            background.submit(
                log_step_metrics, cfg, self.run_id, self.mlflow_run_id, metrics, version
            )
            self.status.update(
                **book.status(version, stats, metrics, elapsed),
                engine_profile=engine.profile.as_dict(),
                sampled_lengths=list(lengths),
                **timer.report(),
                **background.report(),
            )
        background.close()
        durable.close()
        self.keep_newest(trainer, local_root, version, cadence.last_durable_version)
        trainer.close()
        engine.shutdown()
        self.finish(version)
