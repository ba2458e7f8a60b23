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
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pebble import ProcessExpired

from sluice.engines.env.verifiers import load_verifier, outcome_of
from sluice.engines.rl.samples import score_table
from sluice.infra.checkpoints import CheckpointIncomplete
from sluice.infra.config.run import RunConfig
from sluice.infra.streams.names import ShardRef
from sluice.tasks.call_pool import CallPool
from sluice.tasks.prompts import load_policy_tokenizer
from sluice.tasks.role import Role
from sluice.tasks.run.paths import ROLLOUTS, SCORED
from sluice.tasks.run.state_timer import OTHER, StateTimer
from sluice.tasks.run.versions import fetch_tokenizer
from sluice.tasks.sandbox import code_sandbox

log = logging.getLogger("sluice.reward")
REWARD_STATES = ("start", "wait_data", "score", "write")
"""Where the reward role's time goes (tasks/run/state_timer.py): its setup (tokenizer,
verifier pool), waiting for rollouts (the polls after a sleep and the shard's read
included), scoring a shard, writing and acking it."""


class VerifierPool:
    """Scores (row, text) pairs with a deadline per call; a hung or crashing call costs
    its own score and its worker, never its neighbours'.

    The verifiers run in spawned worker processes (`CallPool`): a call past `timeout_s`
    or one that kills its worker scores `incorrect`, pebble replaces that worker, and
    the other calls of the batch score as they would have.

    With a container sandbox (``sandbox``) the verifiers run in threads of this
    process instead: the code runs in the containers, each run's deadline is enforced
    by killing its container, and one warm pool of containers serves every thread.
    """

    def __init__(
        self,
        spec: str,
        workers: int,
        timeout_s: float,
        correct: float,
        incorrect: float,
        sandbox: Any = None,
        closeness: float = 0.0,
    ):
        self.spec, self.workers, self.timeout_s = spec, workers, timeout_s
        self.correct, self.incorrect = correct, incorrect
        self.timeouts = 0
        # Responses with no answer in the expected format; verifier calls that failed;
        # code rows whose tests cannot be judged by calls (excluded, never guessed).
        self.unparsed = self.errors = self.unjudgeable = 0
        # The built-in checker is a string compare: a process hop would cost more than it.
        self.inline = spec == "builtin" and workers == 1
        self.threads = sandbox is not None
        self.verifier = load_verifier(
            spec,
            correct_reward=correct,
            incorrect_reward=incorrect,
            sandbox=sandbox,
            numeric_closeness=closeness,
        )
        self._threads: cf.ThreadPoolExecutor | None = None
        self._pool: CallPool | None = None
        if not self.inline and not self.threads:
            self._pool = CallPool(
                workers,
                timeout_s,
                load_verifier,
                spec,
                correct_reward=correct,
                incorrect_reward=incorrect,
                numeric_closeness=closeness,
            )

    def score(self, rows: list[dict[str, Any]], texts: list[str]) -> list[float]:
        pairs = list(zip(rows, texts, strict=True))
        if self.inline:
            return [self._count(self.verifier(row, text)) for row, text in pairs]
        if self.threads:
            return self._score_in_threads(pairs)
        assert self._pool is not None
        return [self._settle(future) for future in self._pool.run_all(pairs)]

    def _score_in_threads(self, pairs: list[tuple[dict[str, Any], str]]) -> list[float]:
        if self._threads is None:
            self._threads = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="verifier")
        futures = [self._threads.submit(self.verifier, row, text) for row, text in pairs]
        # A thread cannot be stopped, so `timeout_s` bounds the batch, one limit per wave
        # of `workers` calls; the sandbox's own deadline is what ends each run.
        waves = -(-len(futures) // max(1, self.workers))
        cf.wait(futures, timeout=self.timeout_s * waves)
        return [self._settle(future) for future in futures]

    def _settle(self, future: cf.Future[Any]) -> float:
        """The score of one finished call; a call the pool gave up on is a timeout."""
        if not future.done() or future.cancelled():
            self.timeouts += 1
            return self.incorrect
        try:
            return self._count(future.result())
        except TimeoutError:
            self.timeouts += 1
        except ProcessExpired as err:  # the verifier killed its worker (os._exit, a crash)
            log.warning(
                "a verifier worker died (exit %s); scoring %s", err.exitcode, self.incorrect
            )
        except BaseException as err:  # noqa: BLE001 - sys.exit() in a verifier included
            if isinstance(err, KeyboardInterrupt):
                raise
            log.warning("verifier raised %r; scoring %s", err, self.incorrect)
        return self.incorrect

    def _count(self, value: float) -> float:
        outcome = outcome_of(value)
        self.unparsed += outcome == "unparsed"
        self.errors += outcome == "error"
        self.timeouts += outcome == "timeout"
        self.unjudgeable += outcome == "unjudgeable"
        return float(value)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None


class RewardRole(Role):
    name = "reward"

    @property
    def poll_interval_s(self) -> float:
        return self.config.reward.poll_interval_s

    def __init__(self, config: RunConfig, run_id: str, mlflow_run_id: str):
        super().__init__(config, run_id, mlflow_run_id)
        # A verifier that does not load (a plugin module that is not there, a bad spec)
        # stops the role at start, in one line, instead of after its first version.
        load_verifier(
            config.reward.verifier,
            correct_reward=config.reward.correct_reward,
            incorrect_reward=config.reward.incorrect_reward,
            numeric_closeness=config.reward.numeric_closeness,
        )
        self.reader = self.stream_reader(ROLLOUTS, consumer="reward")
        self.writer = self.stream_writer(SCORED, writer_id="reward")
        self.scored_groups = self.scored_samples = 0
        self.reward_sum = self.busy_s = 0.0
        self.started = time.monotonic()
        self.timer = StateTimer(REWARD_STATES, initial="start")

    def progress(self) -> dict[str, Any]:
        return {
            "groups_scored": self.scored_groups,
            "reward_mean": self.reward_sum / max(1, self.scored_samples),
            "busy_ratio": self.busy_s / max(1e-9, time.monotonic() - self.started),
            **self.timer.report(),
        }

    def fetch_tokenizer(self) -> Path:
        """The run's tokenizer files on local disk (no weights are read).

        Every version carries the same tokenizer; version 0's never changes, so a
        restarted role finds it in its cache. Once retention deleted version 0, or it
        was deleted outside Sluice, it comes from the newest version.
        """
        first = self.wait_for_first_version()
        cache = self.local_dir("reward-tokenizer")
        source = self.registry.get(0)
        if source is not None and not source.deleted:
            try:
                return fetch_tokenizer(self.config, source, cache)
            except CheckpointIncomplete as err:
                log.warning(
                    "version 0 cannot be read (%s); the tokenizer comes from the newest", err
                )
        return fetch_tokenizer(self.config, self.registry.newest_durable() or first, cache)

    def run(self) -> None:
        cfg = self.config
        tokenizer = load_policy_tokenizer(self.fetch_tokenizer())

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        sandbox = code_sandbox(cfg)
        pool = VerifierPool(
            cfg.reward.verifier,
            cfg.reward.num_workers,
            cfg.reward.timeout_s,
            cfg.reward.correct_reward,
            cfg.reward.incorrect_reward,
            sandbox=sandbox,
            closeness=cfg.reward.numeric_closeness,
        )

        def score(ref: ShardRef, table: pa.Table) -> None:
            t0 = time.monotonic()
            self.timer.enter("score")
            scored = score_table(table, pool.score, decode)
            self.timer.enter("write")
            self.writer.write(scored, shard_key=ref.name)
            self.reader.ack([ref])
            self.timer.enter(OTHER)
            self.busy_s += time.monotonic() - t0
            self.scored_groups += ref.num_groups
            self.scored_samples += scored.num_rows
            self.reward_sum += float(pc.sum(scored.column("reward")).as_py() or 0.0)
            self.status.update(
                state="running",
                verifier_timeouts=pool.timeouts,
                verifier_unparsed=pool.unparsed,
                verifier_errors=pool.errors,
                verifier_unjudgeable=pool.unjudgeable,
                **self.progress(),
            )

        def wait() -> None:
            self.timer.enter("wait_data")  # until the next shard is scored
            self.status.update(state="waiting", **self.progress())
            self.control.sleep(self.poll_interval_s)

        self.started = time.monotonic()
        self.timer.enter(OTHER)
        try:
            self.consume(self.reader, score, wait)
        finally:
            pool.close()
            if sandbox is not None:
                sandbox.close()
            self.status.update(
                force=True,
                state="stopped",
                groups_scored=self.scored_groups,
                **self.timer.report(),
            )
