"""The rollout role: generate prompt groups continuously, under the staleness gate.

Loop (DESIGN.md §1–2):
- the staleness gate says how many prompt groups may start now (floor(n/B) <= i + η,
  i = newest committed policy version, n counted over the whole run);
- each group is G samples of one prompt, sent to the inference servers through the
  SGLang-compatible client; a finished group becomes one shard of the `rollouts`
  stream, keyed by its group index so a retried write never duplicates it;
- a poller watches the registry alias; a newer committed version is fetched to local
  disk *before* generation is paused, then pause → update_weights_from_disk →
  continue (interruptible), or a plain update that drains in-flight requests first.

Resume: the group index n is re-based from the stream (groups already written); groups
that were in flight when the role died are re-issued with the same index and prompt.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.staleness import StalenessGate
from infra.checkpoints import fetch_checkpoint
from infra.config import RunConfig
from infra.registry import CommittedVersion
from infra.serving.client import InferenceClient
from infra.streams.reader import StreamReader
from infra.streams.schema import table_from_rows
from infra.streams.writer import StreamWriter
from tasks.common import (
    ROLLOUTS,
    RunControl,
    StatusReporter,
    group_index_of,
    group_key,
    run_paths,
    run_registry,
)
from tasks.inference_server import EmbeddedServer
from tasks.problem import PromptSource, load_tokenizer

log = logging.getLogger("sluice.rollout")


@dataclass
class RolloutStats:
    started_at: float = field(default_factory=time.monotonic)
    groups_written: int = 0
    samples_written: int = 0
    tokens_generated: int = 0
    idle_s: float = 0.0
    weight_updates: int = 0
    update_time_s: float = 0.0
    partial_samples: int = 0
    max_version_span: int = 0
    reward_hint: list[float] = field(default_factory=list)

    def as_status(self) -> dict[str, Any]:
        elapsed = max(1e-9, time.monotonic() - self.started_at)
        return {
            "groups_written": self.groups_written,
            "samples_written": self.samples_written,
            "tokens_generated": self.tokens_generated,
            "tokens_per_s": self.tokens_generated / elapsed,
            "idle_ratio": self.idle_s / elapsed,
            "weight_updates": self.weight_updates,
            "update_time_s": self.update_time_s,
            "partial_rollout_ratio": self.partial_samples / max(1, self.samples_written),
            "max_version_span": self.max_version_span,
        }


def committed_group_indices(config: RunConfig, run_id: str) -> set[int]:
    """Group indices already durable in the rollouts stream (what a restart must not redo)."""
    reader = StreamReader(
        config.storage.url,
        run_id,
        ROLLOUTS,
        consumer="rollout-rebase",
        storage_options=config.storage.options,
    )
    indices: set[int] = set()
    for ref in reader.committed():
        table = reader.read(ref)
        indices.update(group_index_of(g) for g in set(table.column("group_id").to_pylist()))
    return indices


class Rollout:
    """State of one rollout role process."""

    def __init__(self, config: RunConfig, run_id: str):
        self.config = config
        self.run_id = run_id
        self.paths = run_paths(config, run_id)
        self.control = RunControl(config, self.paths)
        self.status = StatusReporter(config, self.paths, "rollout")
        self.registry = run_registry(config, run_id)
        self.cache_dir = Path(config.workdir) / "runs" / run_id / "rollout-weights"
        self.writer = StreamWriter(
            config.storage.url,
            run_id,
            ROLLOUTS,
            writer_id=f"rollout-{os.getpid()}",
            storage_options=config.storage.options,
        )
        self.prompts = PromptSource(config)
        self.stats = RolloutStats()
        self.server: EmbeddedServer | None = None
        self.current: CommittedVersion | None = None

    # ------------------------------------------------------------ weights

    def wait_for_first_version(self, timeout_s: float = 600.0) -> CommittedVersion:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            latest = self.registry.latest()
            if latest is not None:
                return latest
            if self.control.should_stop():
                raise SystemExit(0)
            time.sleep(self.config.rollout.poll_interval_s)
        raise TimeoutError("no committed policy version appeared in the registry")

    def fetch(self, version: CommittedVersion) -> Path:
        # One digest-keyed cache for every version; keep the served weights and the next.
        return fetch_checkpoint(
            version.checkpoint_uri,
            self.cache_dir,
            storage_options=self.config.storage.options,
            keep_latest=2,
        )

    async def maybe_update_weights(self, client: InferenceClient) -> None:
        latest = await asyncio.to_thread(self.registry.latest)
        if (
            latest is None
            or self.current is None
            or latest.policy_version <= self.current.policy_version
        ):
            return
        # Fetch before pausing: generation keeps running while the bytes move.
        local = await asyncio.to_thread(self.fetch, latest)
        started = time.monotonic()
        if self.config.rollout.interruptible:
            await client.pause(self.config.rollout.pause_mode)
            try:
                await client.update_weights_from_disk(str(local), latest.policy_version)
            finally:
                await client.continue_()
        else:  # wait-for-drain baseline: the server finishes in-flight requests first
            await client.update_weights_from_disk(str(local), latest.policy_version)
        self.stats.update_time_s += time.monotonic() - started
        self.stats.weight_updates += 1
        log.info(
            "weights -> policy version %d (%.2fs)",
            latest.policy_version,
            time.monotonic() - started,
        )
        self.current = latest

    # ------------------------------------------------------------ groups

    async def generate_group(self, client: InferenceClient, index: int) -> list[dict[str, Any]]:
        row, prompt_ids = self.prompts.train_prompt(index)
        cfg = self.config.rollout
        sampling = {
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k,
        }
        results = await client.generate_group(prompt_ids, cfg.group_size, sampling)
        rows = []
        for k, result in enumerate(results):
            rows.append(
                {
                    "sample_id": f"{group_key(index)}-{k:03d}",
                    "group_id": group_key(index),
                    "prompt_id": str(row["prompt_id"]),
                    "prompt_token_ids": prompt_ids,
                    "response_token_ids": list(result.output_ids),
                    "behaviour_logprobs": list(result.behaviour_logprobs),
                    "token_versions": list(result.token_versions),
                    "finish_reason": result.finish_reason,
                    "reward": None,
                    "task": str(row.get("task", "")),
                    "worker": self.writer.writer_id,
                    "prompt": str(row["prompt"]),
                    "answer": str(row.get("answer", "")),
                    "row_json": self.prompts.row_json(row),
                }
            )
        return rows

    def write_group(self, index: int, rows: list[dict[str, Any]]) -> None:
        table = table_from_rows(rows, stream=ROLLOUTS)
        self.writer.write(table, shard_key=group_key(index))
        self.stats.groups_written += 1
        self.stats.samples_written += len(rows)
        for r in rows:
            self.stats.tokens_generated += len(r["response_token_ids"])
            versions = r["token_versions"]
            if versions and max(versions) != min(versions):
                self.stats.partial_samples += 1
                self.stats.max_version_span = max(
                    self.stats.max_version_span, max(versions) - min(versions)
                )

    # ------------------------------------------------------------ main loop

    async def run(self) -> None:
        cfg = self.config
        self.current = self.wait_for_first_version()
        local = self.fetch(self.current)
        self.prompts.set_tokenizer(load_tokenizer(local))
        early = self.server
        if early is not None and early.weight_version != self.current.policy_version:
            # Started from the flow's start document; the registry moved on since.
            log.info("early server holds version %d; restarting", early.weight_version)
            early.stop()
            self.server = None
        urls = list(cfg.rollout.server_urls)
        if urls and cfg.rollout.weight_noise_std:
            # An external server loads clean weights; running on would measure no
            # injected mismatch while the config claims some.
            raise ValueError(
                "rollout.weight_noise_std is applied by the embedded inference server only; "
                "unset rollout.server_urls or set rollout.weight_noise_std=0"
            )
        if not urls and self.server is not None:
            urls = [self.server.url]
        elif not urls:
            self.server = EmbeddedServer(
                cfg,
                local,
                self.current.policy_version,
                Path(cfg.workdir) / "runs" / self.run_id / "logs",
            )
            urls = [self.server.url]
        client = InferenceClient(urls, timeout_s=cfg.rollout.request_timeout_s)
        try:
            await client.wait_until_healthy(timeout_s=300)
            if cfg.rollout.server_urls:  # external servers start from whatever they hold
                await client.update_weights_from_disk(str(local), self.current.policy_version)
            await self._loop(client)
        finally:
            await client.aclose()
            if self.server is not None:
                self.server.stop()

    def resume_gate(self, written: set[int]) -> StalenessGate:
        """Re-base admission from durable state so a restart never bursts past the bound."""
        cfg = self.config
        version = self.current.policy_version if self.current else 0
        # Every trainer step consumes exactly B groups (B is a multiple of the shard
        # size), so the committed version says how many groups training has taken.
        consumed = min(len(written), version * cfg.trainer.prompts_per_batch)
        return StalenessGate.resume(
            cfg.trainer.prompts_per_batch,
            cfg.staleness.max_staleness,
            committed_version=version,
            groups_in_stream=len(written),
            groups_consumed=consumed,
        )

    async def _loop(self, client: InferenceClient) -> None:
        cfg = self.config
        written = committed_group_indices(cfg, self.run_id)
        next_index = max(written) + 1 if written else 0
        # Groups below the high-water mark that never reached the stream were in flight
        # when the previous process died: re-issue them with the same index and prompt.
        reissue = sorted(set(range(next_index)) - written)
        gate = self.resume_gate(written)
        if reissue:
            log.info("re-issuing %d groups that were in flight before the restart", len(reissue))
        max_in_flight = max(1, (2 * cfg.rollout.max_batch_size) // cfg.rollout.group_size)
        in_flight: dict[asyncio.Task[list[dict[str, Any]]], tuple[int, int]] = {}
        last_poll = 0.0
        idle_since: float | None = None
        while not self.control.should_stop():
            now = time.monotonic()
            if now - last_poll >= cfg.rollout.poll_interval_s:
                last_poll = now
                await self.maybe_update_weights(client)
            version = self.current.policy_version if self.current else 0
            while len(in_flight) < max_in_flight:
                ticket = gate.try_start(version)
                if ticket is None:
                    break
                if reissue:
                    index = reissue.pop(0)
                else:
                    index, next_index = next_index, next_index + 1
                task = asyncio.create_task(self.generate_group(client, index))
                in_flight[task] = (index, ticket)
            if not in_flight:
                idle_since = idle_since or time.monotonic()
                await asyncio.sleep(0.05)
                self._report(gate, version)
                continue
            if idle_since is not None:
                self.stats.idle_s += time.monotonic() - idle_since
                idle_since = None
            finished, _ = await asyncio.wait(
                in_flight, timeout=0.05, return_when=asyncio.FIRST_COMPLETED
            )
            for task in finished:
                index, ticket = in_flight.pop(task)
                rows = task.result()
                if any(r["finish_reason"] == "abort" for r in rows):
                    gate.abandon(ticket)  # aborted by a weight update: free the slot, ask again
                    # Kept sorted: the smallest issue number goes first, so every group's
                    # number stays below its admission position and batch floor(n/B)
                    # never trains it more than eta versions late.
                    bisect.insort(reissue, index)
                    continue
                await asyncio.to_thread(self.write_group, index, rows)
                gate.finish(ticket)
            self._report(gate, version)
        for task in in_flight:
            task.cancel()
        self.status.update(force=True, state="stopped", **self.stats.as_status())

    def _report(self, gate: StalenessGate, version: int) -> None:
        self.status.update(
            state="running",
            policy_version=version,
            groups_accepted=gate.accepted,
            groups_in_flight=gate.in_flight,
            **self.stats.as_status(),
        )


def rollout_loop(
    config: RunConfig, run_id: str, mlflow_run_id: str, server: EmbeddedServer | None = None
) -> None:
    """The rollout role; `server` is an embedded server already starting (`start_early`)."""
    try:
        rollout = Rollout(config, run_id)
    except BaseException:
        if server is not None:
            server.stop()
        raise
    rollout.server = server
    rollout.control.install_signal_handlers()
    log.info(
        "rollout %s starting (η=%d, interruptible=%s)",
        uuid.uuid4().hex[:6],
        config.staleness.max_staleness,
        config.rollout.interruptible,
    )
    asyncio.run(rollout.run())
