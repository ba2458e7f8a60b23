"""The reward role: score the `rollouts` stream into the `scored` stream.

Each rollouts shard is read oldest first, every response is decoded and scored by
the configured verifier in a worker pool with a per-call deadline, and the shard is
rewritten to `scored` under the same key before it is acknowledged. A crash between
the write and the ack re-scores the shard and overwrites the same key, so `scored`
holds each group exactly once. Scoring runs beside generation (its own process), so
a slow verifier delays training data, never tokens.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from engines.verifiers import load_verifier
from infra.config import RunConfig
from infra.streams.errors import CorruptShardError
from infra.streams.reader import StreamReader
from infra.streams.writer import StreamWriter
from tasks.common import ROLLOUTS, SCORED, RunControl, StatusReporter, run_paths, run_registry
from tasks.problem import PromptSource, load_tokenizer

log = logging.getLogger("sluice.reward")

_worker_verifier: Callable[[dict[str, Any], str], float] | None = None


def _init_worker(spec: str, correct: float, incorrect: float) -> None:
    global _worker_verifier
    _worker_verifier = load_verifier(spec, correct_reward=correct, incorrect_reward=incorrect)


def _score_in_worker(row: dict[str, Any], text: str) -> float:
    assert _worker_verifier is not None
    return float(_worker_verifier(row, text))


class VerifierPool:
    """Scores (row, text) pairs with a deadline per call; a hung verifier costs one pool."""

    def __init__(self, spec: str, workers: int, timeout_s: float, correct: float, incorrect: float):
        self.spec, self.workers, self.timeout_s = spec, workers, timeout_s
        self.correct, self.incorrect = correct, incorrect
        self.timeouts = 0
        # The built-in checker is a string compare: a process hop would cost more than it.
        self.inline = spec == "builtin" and workers == 1
        self.verifier = load_verifier(spec, correct_reward=correct, incorrect_reward=incorrect)
        self._pool: cf.ProcessPoolExecutor | None = None

    def _executor(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(self.spec, self.correct, self.incorrect),
            )
        return self._pool

    def score(self, rows: list[dict[str, Any]], texts: list[str]) -> list[float]:
        if self.inline:
            return [float(self.verifier(row, text)) for row, text in zip(rows, texts, strict=True)]
        pool = self._executor()
        futures = [
            pool.submit(_score_in_worker, row, text) for row, text in zip(rows, texts, strict=True)
        ]
        deadline = time.monotonic() + self.timeout_s
        scores, hung = [], False
        for future in futures:
            try:
                scores.append(float(future.result(timeout=max(0.0, deadline - time.monotonic()))))
            except cf.TimeoutError:
                scores.append(self.incorrect)
                self.timeouts += 1
                hung = True
            except Exception as err:  # a verifier must not take the role down
                log.warning("verifier raised %s; scoring %s", err, self.incorrect)
                scores.append(self.incorrect)
        if hung:  # worker processes stuck in user code: replace the pool
            self.close()
        return scores

    def close(self) -> None:
        if self._pool is not None:
            for proc in list(getattr(self._pool, "_processes", {}).values()):
                proc.kill()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def score_table(
    table: pa.Table, pool: VerifierPool, decode: Callable[[list[int]], str]
) -> pa.Table:
    records = table.select(["prompt_id", "prompt", "answer", "task", "row_json"]).to_pylist()
    rows = [PromptSource.row_from_columns(r) for r in records]
    texts = [decode(ids) for ids in table.column("response_token_ids").to_pylist()]
    rewards = pool.score(rows, texts)
    index = table.schema.get_field_index("reward")
    return table.set_column(index, table.schema.field("reward"), pa.array(rewards, pa.float32()))


def reward_loop(config: RunConfig, run_id: str, mlflow_run_id: str) -> None:
    paths = run_paths(config, run_id)
    control = RunControl(config, paths)
    control.install_signal_handlers()
    status = StatusReporter(config, paths, "reward")
    registry = run_registry(config, run_id)
    first = None
    while first is None and not control.should_stop():
        first = registry.get(0) or registry.latest()
        if first is None:
            time.sleep(config.rollout.poll_interval_s)
    if first is None:
        return
    from infra.checkpoints import fetch_checkpoint

    local = fetch_checkpoint(
        first.checkpoint_uri,
        f"{config.workdir}/runs/{run_id}/reward-tokenizer",
        storage_options=config.storage.options,
    )
    tokenizer = load_tokenizer(local)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    reader = StreamReader(
        config.storage.url,
        run_id,
        ROLLOUTS,
        consumer="reward",
        storage_options=config.storage.options,
    )
    writer = StreamWriter(
        config.storage.url,
        run_id,
        SCORED,
        writer_id="reward",
        storage_options=config.storage.options,
    )
    pool = VerifierPool(
        config.reward.verifier,
        config.reward.num_workers,
        config.reward.timeout_s,
        config.reward.correct_reward,
        config.reward.incorrect_reward,
    )
    scored_groups = scored_samples = 0
    reward_sum = 0.0
    busy_s = 0.0
    started = time.monotonic()
    try:
        while not control.should_stop():
            refs = reader.poll()
            if not refs:
                status.update(
                    state="waiting",
                    groups_scored=scored_groups,
                    reward_mean=reward_sum / max(1, scored_samples),
                    busy_ratio=busy_s / max(1e-9, time.monotonic() - started),
                )
                control.sleep(config.rollout.poll_interval_s / 2)
                continue
            for ref in refs:
                t0 = time.monotonic()
                try:
                    table = reader.read(ref)
                except CorruptShardError as err:  # quarantined by the reader; the stream goes on
                    log.error("%s", err)
                    continue
                scored = score_table(table, pool, decode)
                writer.write(scored, shard_key=ref.name)
                reader.ack([ref])
                busy_s += time.monotonic() - t0
                scored_groups += ref.num_groups
                scored_samples += scored.num_rows
                reward_sum += float(pa.compute.sum(scored.column("reward")).as_py() or 0.0)
                status.update(
                    state="running",
                    groups_scored=scored_groups,
                    reward_mean=reward_sum / max(1, scored_samples),
                    verifier_timeouts=pool.timeouts,
                    busy_ratio=busy_s / max(1e-9, time.monotonic() - started),
                )
                if control.should_stop():
                    break
    finally:
        pool.close()
        status.update(force=True, state="stopped", groups_scored=scored_groups)
