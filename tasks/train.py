"""The train role: consume `scored` in issue order, B groups a step, publish versions.

Per step k: train the B prompt groups the rollout role issued as numbers kB..kB+B-1
(read from the scored stream in whatever order they finished), compute group
advantages, recompute π_prox and run the decoupled PPO step (engines.trainer). Every
`publish_every` steps the weights are saved as a checkpoint, committed to the
registry as the next policy version (only once durable), and then the shards that
went into it are acknowledged with that version in the ledger meta.

Why by issue number and not by arrival: the staleness gate admitted group n only while
floor(n / B) <= i + eta (i = the version the rollout served), so training group n in
batch floor(n / B) keeps every sample at most eta versions old. Taking groups as they
arrive would let a slow group of batch k slip into batch k + 1 (eta + 1 versions old).
Training in issue order also makes exactly-once simple: version v has trained exactly
the groups numbered below v * B. A group whose shard was quarantined as corrupt (in
either stream) is lost: the step goes on without it once that is certain.

Exactly once: the checkpoint carries the list of shards it consumed. A crash after
the commit but before the ack is repaired on restart by acking that list; a crash
before the commit retrains those shards from the previous version, whose weights
never saw them.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from engines.advantages import make_advantage_fn
from engines.loss import make_policy_loss
from engines.rollout_correction import make_rollout_correction
from engines.trainer import PolicyTrainer, TrainerSettings, TrainingSample
from infra.checkpoints import fetch_checkpoint, save_checkpoint
from infra.config import RunConfig
from infra.streams.errors import CorruptShardError
from infra.streams.names import ShardRef, shard_key_tag
from infra.streams.reader import StreamReader
from infra.tracking import log_metrics
from tasks.common import (
    ROLLOUTS,
    SCORED,
    Background,
    RunControl,
    StatusReporter,
    group_index_of,
    group_key,
    read_json,
    read_statuses,
    run_paths,
    run_registry,
)

log = logging.getLogger("sluice.train")
CONSUMED_FILE = "consumed_shards.json"
LOST_CHECK_INTERVAL_S = 5.0
"""How often a trainer waiting on missing groups checks whether they were quarantined."""


def trainer_settings(config: RunConfig) -> TrainerSettings:
    t = config.trainer
    return TrainerSettings(
        lr=t.lr,
        adam_betas=t.adam_betas,
        adam_eps=t.adam_eps,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        temperature=config.rollout.temperature,
        ppo_minibatches=t.ppo_minibatches,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
        min_micro_batches=t.min_micro_batches,
        seed=config.seed,
    )


def build_trainer(config: RunConfig, model_dir: Path) -> PolicyTrainer:
    t = config.trainer
    correction = make_rollout_correction(**t.correction.model_dump()) if t.loss.decoupled else None
    device = (
        "cuda"
        if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    return PolicyTrainer(
        model_dir,
        trainer_settings(config),
        make_policy_loss(**t.loss.model_dump()),
        correction,
        device=device,
        decoupled=t.loss.decoupled,
    )


def samples_from_table(
    table: pa.Table, config: RunConfig
) -> tuple[list[TrainingSample], dict[str, float]]:
    """Group advantages, then one TrainingSample per response."""
    advantage_fn = make_advantage_fn(**config.trainer.advantage.model_dump())
    rewards = np.asarray(table.column("reward").to_numpy(zero_copy_only=False), dtype=np.float64)
    group_names = table.column("group_id").to_pylist()
    codes = {g: i for i, g in enumerate(dict.fromkeys(group_names))}
    result = advantage_fn(
        torch.as_tensor(rewards), group_ids=torch.tensor([codes[g] for g in group_names])
    )
    prompts = table.column("prompt_token_ids").to_pylist()
    responses = table.column("response_token_ids").to_pylist()
    behaviour = table.column("behaviour_logprobs").to_pylist()
    keep = result.keep_samples.tolist()
    samples = [
        TrainingSample(prompts[i], responses[i], behaviour[i], float(result.advantages[i]))
        for i in range(table.num_rows)
        if keep[i]
    ]
    lengths = np.array([len(r) for r in responses])
    stats = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/zero_variance_groups": float(result.zero_variance_groups.sum()),
        "reward/groups": float(len(codes)),
        **gradient_sources(rewards, result.group_index.numpy(), result.advantages.numpy()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/length_p50": float(np.percentile(lengths, 50)),
        "response/truncated_fraction": float(
            np.mean([f == "length" for f in table.column("finish_reason").to_pylist()])
        ),
    }
    return samples, stats


def gradient_sources(
    rewards: np.ndarray, group_index: np.ndarray, advantages: np.ndarray
) -> dict[str, float]:
    """Where a batch's policy gradient can come from, group by group.

    A group whose responses all scored the same carries no advantage: `all_wrong`
    groups are prompts the policy cannot solve yet, `all_right` ones it has mastered.
    Only `mixed` groups move the policy; among their samples, the positive ones
    reinforce what worked and the negative ones push down what failed.
    """
    num_groups = int(group_index.max()) + 1 if group_index.size else 0
    lowest = np.full(num_groups, np.inf)
    highest = np.full(num_groups, -np.inf)
    np.minimum.at(lowest, group_index, rewards)
    np.maximum.at(highest, group_index, rewards)
    flat = lowest == highest
    best = rewards.max() if rewards.size else 0.0
    all_right = flat & (highest >= best) & (best > rewards.min())
    return {
        "grad/mixed_groups": float((~flat).sum()),
        "grad/all_wrong_groups": float((flat & ~all_right & (highest <= rewards.min())).sum()),
        "grad/all_right_groups": float(all_right.sum()),
        "grad/positive_samples": float((advantages > 0).sum()),
        "grad/negative_samples": float((advantages < 0).sum()),
    }


def staleness_stats(table: pa.Table, policy_version: int) -> dict[str, float]:
    """How many versions behind the weights being updated each sample was generated."""
    start = table.column("version_start").to_numpy(zero_copy_only=False).astype(np.int64)
    end = table.column("version_end").to_numpy(zero_copy_only=False).astype(np.int64)
    lag = policy_version - start
    return {
        "staleness/min": float(lag.min()),
        "staleness/mean": float(lag.mean()),
        "staleness/max": float(lag.max()),
        "staleness/stale_samples": float((lag > 0).sum()),
        "rollout/partial_ratio": float((end != start).mean()),
        "rollout/max_version_span": float((end - start).max()),
    }


def lost_groups(rollouts: StreamReader, scored: StreamReader, indices: list[int]) -> list[int]:
    """Those of `indices` that can never reach `scored`: a shard of theirs was quarantined.

    The rollout role keys each group's shard by `group_key(index)` and the reward role
    keys the scored shard by the rollout shard's name, so both are found by key. When
    nothing was quarantined (the usual case) this costs two listings of empty folders.
    """
    bad_rollouts = rollouts.quarantined_tags()
    bad_scored = scored.quarantined_tags()
    if not bad_rollouts and not bad_scored:
        return []
    rollout_names = {ref.tag: ref.name for ref in rollouts.committed()} if bad_scored else {}
    lost = []
    for index in indices:
        tag = shard_key_tag(group_key(index))
        name = rollout_names.get(tag)
        if tag in bad_rollouts or (name is not None and shard_key_tag(name) in bad_scored):
            lost.append(index)
    return lost


class GroupBuffer:
    """Scored prompt groups keyed by issue number; batch k is numbers kB .. kB+B-1.

    Shards are acknowledged whole, so a shard is handed back for acking only once
    every group in it has been trained (or dropped as already trained before a
    restart, or as a duplicate).
    """

    def __init__(self, prompts_per_batch: int) -> None:
        self.prompts_per_batch = prompts_per_batch
        self._groups: dict[int, pa.Table] = {}
        self._shard_of: dict[int, str] = {}
        self._open: dict[str, set[int]] = {}
        self._refs: dict[str, ShardRef] = {}
        self._done: list[ShardRef] = []

    def indices(self, step: int) -> range:
        return range(step * self.prompts_per_batch, (step + 1) * self.prompts_per_batch)

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, ref: ShardRef, table: pa.Table, step: int) -> list[str]:
        """File a shard's groups for their batches; returns warnings for dropped groups.

        Groups numbered below ``step * B`` were trained before (a restart between the
        commit and the ack of a shard that spans batches) and are dropped, as is a
        second copy of a group already held. A group id that is not a Sluice id is a
        ValueError: the stream was written by something else.
        """
        names = table.column("group_id").to_pylist()
        by_index: dict[int, list[int]] = {}
        for row, name in enumerate(names):
            by_index.setdefault(group_index_of(str(name)), []).append(row)
        warnings = []
        kept: set[int] = set()
        for index, rows in by_index.items():
            if index < step * self.prompts_per_batch:
                warnings.append(f"{group_key(index)} in {ref.name} was trained before; skipped")
            elif index in self._groups:
                warnings.append(
                    f"{group_key(index)} in {ref.name} duplicates one from "
                    f"{self._shard_of[index]}; skipped"
                )
            else:
                self._groups[index] = table.take(rows)
                self._shard_of[index] = ref.name
                kept.add(index)
        if kept:
            self._open[ref.name] = kept
            self._refs[ref.name] = ref
        else:
            self._done.append(ref)
        return warnings

    def missing(self, step: int) -> list[int]:
        return [i for i in self.indices(step) if i not in self._groups]

    def take(self, step: int) -> tuple[pa.Table | None, list[ShardRef]]:
        """Batch `step` (the groups present, in issue order) and the shards it completes."""
        tables = []
        for index in self.indices(step):
            table = self._groups.pop(index, None)
            if table is None:
                continue
            tables.append(table)
            name = self._shard_of.pop(index)
            self._open[name].discard(index)
            if not self._open[name]:
                del self._open[name]
                self._done.append(self._refs.pop(name))
        done, self._done = self._done, []
        if not tables:
            return None, done
        return pa.concat_tables(tables, promote_options="permissive"), done


class TrainRole:
    def __init__(self, config: RunConfig, run_id: str, mlflow_run_id: str):
        self.config = config
        self.run_id = run_id
        self.mlflow_run_id = mlflow_run_id
        self.paths = run_paths(config, run_id)
        self.control = RunControl(config, self.paths)
        self.status = StatusReporter(config, self.paths, "train")
        self.registry = run_registry(config, run_id)
        self.local_root = Path(config.workdir) / "runs" / run_id / "trainer"
        self.reader = StreamReader(
            config.storage.url,
            run_id,
            SCORED,
            consumer="trainer",
            storage_options=config.storage.options,
        )
        self.buffer = GroupBuffer(config.trainer.prompts_per_batch)
        self._rollouts: StreamReader | None = None
        self.background = Background("trainer-commit")
        self._pending: tuple[int, list[ShardRef], Path] | None = None

    def reconcile_ledger(self, checkpoint_uri: str) -> None:
        """Ack what the committed version consumed, in case the last run died before acking."""
        names = read_json(self.config, f"{checkpoint_uri}/{CONSUMED_FILE}")
        if not names:
            return
        missing = [n for n in names if not self.reader.is_acked(n)]
        if missing:
            log.info(
                "acking %d shards consumed by the committed version before the restart",
                len(missing),
            )
            self.reader.ack(missing, meta={"reconciled": True})

    def next_batch(self, step: int) -> tuple[pa.Table | None, list[ShardRef], float, list[int]]:
        """Batch `step`: its B groups, whatever order they finished in.

        Returns the table (None when every group of the batch was lost), the shards
        completed by it, the seconds spent waiting, and the issue numbers found lost.
        """
        waited = 0.0
        last_check = time.monotonic()
        while True:
            missing = self.buffer.missing(step)
            if not missing:
                lost: list[int] = []
                break
            if self.control.should_stop():
                raise InterruptedError
            refs = self.reader.poll()
            for ref in refs:
                try:
                    table = self.reader.read(ref)
                except CorruptShardError as err:  # quarantined; its groups count as lost
                    log.error("%s", err)
                    continue
                for warning in self.buffer.add(ref, table, step):
                    log.warning("%s", warning)
            if refs:
                continue
            t0 = time.monotonic()
            self.control.sleep(0.05)
            waited += time.monotonic() - t0
            if time.monotonic() - last_check >= LOST_CHECK_INTERVAL_S:
                last_check = time.monotonic()
                lost = lost_groups(self.rollouts_audit(), self.reader, missing)
                if len(lost) == len(missing):
                    log.error(
                        "step %d goes on without %d group(s) lost to corrupt shards: %s",
                        step,
                        len(lost),
                        ", ".join(group_key(i) for i in lost),
                    )
                    break
        table, done = self.buffer.take(step)
        return table, done, waited, lost

    def rollouts_audit(self) -> StreamReader:
        """A reader of the rollouts stream that only looks (it never reads or acks)."""
        if self._rollouts is None:
            self._rollouts = StreamReader(
                self.config.storage.url,
                self.run_id,
                ROLLOUTS,
                consumer="trainer-audit",
                storage_options=self.config.storage.options,
            )
        return self._rollouts

    def publish(
        self, trainer: PolicyTrainer, version: int, consumed: list[ShardRef], tags: dict[str, Any]
    ) -> None:
        """Save version `version` now; upload and commit it while the next step trains.

        The weights are snapshotted to local disk synchronously (the next step changes
        them). Upload and registry commit run on the background thread; the shards the
        version consumed are acked by `finish_publish`, after the commit: a crash in
        between retrains them from the previous version (never committed) or acks them
        on restart (`reconcile_ledger`), as before.
        """
        self.finish_publish()
        local = self.local_root / f"v{version:06d}"
        if local.exists():
            shutil.rmtree(local)
        trainer.save(local, extra={"policy_version": version})
        (local / CONSUMED_FILE).write_text(json.dumps([r.name for r in consumed]))
        self.background.submit(self._commit, local, version, tags)
        self._pending = (version, consumed, local)

    def _commit(self, local: Path, version: int, tags: dict[str, Any]) -> str:
        uri = save_checkpoint(
            local, self.paths.checkpoint(version), storage_options=self.config.storage.options
        )
        self.registry.commit(
            version, uri, run_id=self.mlflow_run_id, tags=tags, trainer_step=version
        )
        return uri

    def finish_publish(self) -> None:
        """Wait for the pending commit (and metric logging), then ack what it consumed."""
        self.background.wait()
        if self._pending is None:
            return
        version, consumed, local = self._pending
        self._pending = None
        self.reader.ack(consumed, meta={"policy_version": version})
        # Keep the newest local copy only: the durable one is on storage.
        for old in self.local_root.glob("v*"):
            if old != local:
                shutil.rmtree(old, ignore_errors=True)

    def run(self) -> None:
        cfg = self.config
        latest = None
        while latest is None:
            if self.control.should_stop():
                return
            latest = self.registry.latest()
            if latest is None:
                time.sleep(cfg.rollout.poll_interval_s)
        self.reconcile_ledger(latest.checkpoint_uri)
        init_dir = fetch_checkpoint(
            latest.checkpoint_uri, self.local_root / "init", storage_options=cfg.storage.options
        )
        trainer = build_trainer(cfg, init_dir)
        version = latest.policy_version
        total = cfg.trainer.total_steps
        B = cfg.trainer.prompts_per_batch
        started = time.monotonic()
        waited_total = 0.0
        trained_tokens_total = 0.0
        unpublished: list[ShardRef] = []
        log.info("training from policy version %d to %d (B=%d)", version, total, B)
        self.status.update(force=True, state="running", step=version)
        while version < total:
            try:
                table, refs, waited, lost = self.next_batch(version)
            except InterruptedError:
                break
            waited_total += waited
            if table is None:  # every group of this batch was lost: the version moves on
                samples: list[TrainingSample] = []
                stats = {
                    k: float("nan") for k in ("reward/mean", "staleness/mean", "staleness/max")
                }
            else:
                samples, stats = samples_from_table(table, cfg)
                stats.update(staleness_stats(table, version))
            stats["train/lost_groups"] = float(len(lost))
            metrics = trainer.train_step(samples) if samples else {}
            version += 1
            unpublished.extend(refs)
            trained_tokens_total += metrics.get("train/trained_tokens", 0.0)
            elapsed = time.monotonic() - started
            metrics.update(stats)
            metrics["train/idle_ratio"] = waited_total / max(1e-9, elapsed)
            metrics["train/effective_tokens_per_s"] = trained_tokens_total / max(1e-9, elapsed)
            metrics["train/wall_time_s"] = elapsed
            rollout_status = read_statuses(cfg, self.paths).get("rollout", {})
            for key in ("tokens_per_s", "idle_ratio", "partial_rollout_ratio", "weight_updates"):
                if key in rollout_status:
                    metrics[f"rollout/{key}"] = rollout_status[key]
            if version % cfg.trainer.publish_every == 0 or version == total:
                tags = {
                    "staleness_mean": f"{stats['staleness/mean']:.3f}",
                    "staleness_max": f"{stats['staleness/max']:.0f}",
                    "reward_mean": f"{stats['reward/mean']:.4f}",
                }
                self.publish(trainer, version, unpublished, tags)
                unpublished = []
                log.info(
                    "step %d: reward %.3f, staleness %.2f, loss %.4f",
                    version,
                    stats["reward/mean"],
                    stats["staleness/mean"],
                    metrics.get("loss/policy_loss", float("nan")),
                )
            self.background.submit(
                log_metrics, cfg.tracking.uri, self.mlflow_run_id, metrics, step=version
            )
            self.status.update(
                state="running",
                step=version,
                reward_mean=stats["reward/mean"],
                staleness_mean=stats["staleness/mean"],
                trained_tokens_per_s=metrics["train/effective_tokens_per_s"],
                idle_ratio=metrics["train/idle_ratio"],
                wall_time_s=elapsed,
            )
        self.finish_publish()
        self.background.close()
        if version >= total:
            self.control.mark_done(f"trained {total} steps")
        self.status.update(
            force=True, state="finished" if version >= total else "stopped", step=version
        )


def train_loop(config: RunConfig, run_id: str, mlflow_run_id: str) -> None:
    role = TrainRole(config, run_id, mlflow_run_id)
    role.control.install_signal_handlers()
    role.run()
