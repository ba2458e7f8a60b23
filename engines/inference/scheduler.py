"""The request lifecycle of the inference engine: queues, futures, pause, abort, steps.

``Scheduler`` decides what runs when; the ``SlotBatch`` it drives runs it. Every
public method takes effect between two scheduler steps, from any thread: a caller
takes the lock ahead of the scheduler loop (``_control``), so a pause, abort or
weight update never waits behind a long run of steps. ``InferenceEngine``
(``sluice.engines.inference.engine``) is a scheduler over a loaded model that adds weight
updates.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future

import numpy as np
import torch

from sluice.engines.inference.batch import Finished, RequestState, SlotBatch
from sluice.engines.inference.profile import StepProfile
from sluice.engines.inference.types import (
    EngineShutdownError,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    PauseMode,
)


class Scheduler:
    """Continuous batching over a ``SlotBatch``: admission, pauses, aborts, the step loop.

    Thread-safe: ``submit``/``abort``/``pause`` may be called from any thread; they
    take effect between scheduler steps. Drive it either with ``start()`` (a
    background scheduler thread) or by calling ``step()`` yourself; ``result()``
    and ``generate()`` step inline when no background thread runs.
    """

    def __init__(
        self,
        batch: SlotBatch,
        *,
        vocab_size: int,
        max_seq_len: int,
        max_batch_size: int,
        eos_token_ids: frozenset[int],
        seed: int,
        weight_version: int,
    ) -> None:
        """Schedule onto ``batch``, whose model has ``vocab_size`` tokens and these EOS ids.

        Args:
            seed: seeds the per-request sampling seeds of requests without one.
            weight_version: policy version stamped on tokens until the next update.
        """
        self._batch = batch
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.eos_token_ids = eos_token_ids
        self._weight_version = int(weight_version)
        self._seed_rng = np.random.default_rng(seed)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._waiters_lock = threading.Lock()
        self._control_waiters = 0
        self._waiting: deque[RequestState] = deque()
        self._in_flight: dict[str, RequestState] = {}
        self._futures: dict[str, Future[GenerationOutput]] = {}
        self._paused = False
        self._admitting = True
        self._arrivals = 0
        self._thread: threading.Thread | None = None
        self._stop_thread = False
        self._closed = False
        self.step_count = 0
        self.profile = StepProfile()
        """Measured decode-step and prefill costs (what the capacity planner fits)."""

    # ------------------------------------------------------------ properties

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def is_serving(self) -> bool:
        """True while the background scheduler thread runs."""
        return self._thread_alive() and not self._closed

    @property
    def draining(self) -> bool:
        """True while a drain update holds back admission of waiting requests."""
        return not self._admitting

    @property
    def num_running(self) -> int:
        return len(self._batch.running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # Work counters, for tests and benchmarks.

    @property
    def decode_forwards(self) -> int:
        return self._batch.decode_forwards

    @property
    def prefill_forwards(self) -> int:
        return self._batch.prefill_forwards

    @property
    def generated_tokens(self) -> int:
        """Tokens sampled so far, recomputed ones not counted again."""
        return self._batch.generated_tokens

    @property
    def recomputed_tokens(self) -> int:
        """Tokens re-prefilled after a retract or a weight update."""
        return self._batch.recomputed_tokens

    @property
    def prefilled_tokens(self) -> int:
        return self._batch.prefilled_tokens

    # --------------------------------------------------------------- control

    class _Control:
        """Takes the lock ahead of the scheduler loop (which otherwise re-grabs it)."""

        def __init__(self, scheduler: Scheduler) -> None:
            self.scheduler = scheduler

        def __enter__(self) -> None:
            with self.scheduler._waiters_lock:
                self.scheduler._control_waiters += 1
            self.scheduler._lock.acquire()

        def __exit__(self, *exc: object) -> None:
            with self.scheduler._waiters_lock:
                self.scheduler._control_waiters -= 1
            self.scheduler._changed.notify_all()
            self.scheduler._lock.release()

    def _control(self) -> Scheduler._Control:
        return Scheduler._Control(self)

    def validate_request(self, request: GenerationRequest) -> None:
        """Raise ValueError naming what is wrong with ``request``; queues nothing."""
        prompt = request.prompt_token_ids
        if isinstance(prompt, str | bytes) or len(prompt) == 0:
            raise ValueError("prompt_token_ids must hold at least one token")
        for token_id in prompt:
            if isinstance(token_id, bool) or not isinstance(token_id, int | np.integer):
                raise ValueError(f"prompt_token_ids must be integers, got {token_id!r}")
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"prompt token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )
        if len(prompt) >= self.max_seq_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens but max_seq_len is {self.max_seq_len}; "
                "no room to generate"
            )
        request.sampling.validate(self.vocab_size)

    def submit(self, request: GenerationRequest) -> str:
        """Queue a request and return its id. Raises ValueError on bad input (nothing queued)."""
        self.validate_request(request)
        prompt = tuple(int(t) for t in request.prompt_token_ids)
        params = request.sampling
        with self._control():
            if self._closed:
                raise EngineShutdownError("the inference engine has been shut down")
            request_id = request.request_id or uuid.uuid4().hex
            if request_id in self._in_flight:
                raise ValueError(f"request id {request_id!r} is already in flight")
            seed = (
                params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**63))
            )
            stop_ids = frozenset(params.stop_token_ids) | (
                frozenset() if params.ignore_eos else self.eos_token_ids
            )
            seq = RequestState(
                request_id=request_id,
                prompt=prompt,
                params=params,
                seed=seed,
                stop_ids=stop_ids,
                future=Future(),
                submitted_at=time.perf_counter(),
                arrival=self._arrivals,
            )
            self._arrivals += 1
            self._futures[request_id] = seq.future
            if params.max_new_tokens == 0:
                self._finish(seq, "length")
            else:
                self._in_flight[request_id] = seq
                self._waiting.append(seq)
            return request_id

    def submit_many(self, requests: Iterable[GenerationRequest]) -> list[str]:
        """Queue `requests`, in order, as one arrival: the next scheduler step finds all of
        them waiting (and admits as many as fit), never a part. A server answering one
        call for a whole batch this way schedules it as `generate` does in-process, so
        the batch is computed the same way. Raises ValueError on bad input (nothing queued).
        """
        requests = list(requests)
        for request in requests:
            self.validate_request(request)
        with self._control():
            return [self.submit(request) for request in requests]

    def future(self, request_id: str) -> Future[GenerationOutput]:
        """The future that resolves to the request's output."""
        with self._lock:
            if request_id not in self._futures:
                raise KeyError(f"unknown request id {request_id!r}")
            return self._futures[request_id]

    def result(self, request_id: str, timeout_s: float | None = None) -> GenerationOutput:
        """Block until the request finishes and return (and forget) its output.

        Without a background thread, this drives the scheduler itself.
        """
        fut = self.future(request_id)
        if not self._thread_alive():
            while not fut.done():
                if not self.step() and not fut.done():
                    raise RuntimeError(
                        f"request {request_id!r} cannot make progress: the engine is paused "
                        "and no scheduler thread is running"
                    )
        output = fut.result(timeout=timeout_s)
        with self._lock:
            self._futures.pop(request_id, None)
        return output

    def forget(self, request_id: str) -> None:
        """Drop the stored future of a request whose output was read through ``future()``."""
        with self._lock:
            self._futures.pop(request_id, None)

    async def generate_async(self, request: GenerationRequest) -> GenerationOutput:
        """Submit and await one request (needs the background thread from ``start()``)."""
        import asyncio

        request_id = self.submit(request)
        try:
            return await asyncio.wrap_future(self.future(request_id))
        finally:
            with self._lock:
                self._futures.pop(request_id, None)

    def generate(self, requests: Iterable[GenerationRequest]) -> list[GenerationOutput]:
        """Submit all requests, wait for all, return outputs in submission order."""
        ids = self.submit_many(requests)
        return [self.result(i) for i in ids]

    def abort(self, request_id: str, message: str = "aborted by request") -> bool:
        """Abort one waiting or running request; False if it is not in flight."""
        with self._control():
            seq = self._in_flight.get(request_id)
            if seq is None:
                return False
            if seq in self._waiting:
                self._waiting.remove(seq)
                self._finish(seq, "abort", abort_message=message)
            else:
                self._batch.release([seq])
                self._finish(seq, "abort", abort_message=message)
            return True

    def abort_all(self, message: str = "aborted by request") -> int:
        """Abort every waiting and running request; returns how many."""
        with self._control():
            return self._abort_all_locked(message)

    def _abort_all_locked(self, message: str) -> int:
        running = list(self._batch.running)
        count = len(self._waiting) + len(running)
        self._batch.release(running)
        for seq in running:
            self._finish(seq, "abort", abort_message=message)
        # Snapshot first: a done-callback that submits again must not extend this loop.
        waiting = list(self._waiting)
        self._waiting.clear()
        for seq in waiting:
            self._finish(seq, "abort", abort_message=message)
        return count

    def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> int:
        """Stop scheduling (SGLang semantics of ``mode``); returns the requests affected."""
        try:
            mode = PauseMode(mode)
        except ValueError:
            raise ValueError(
                f"pause mode must be one of {[m.value for m in PauseMode]}, got {mode!r}"
            ) from None
        with self._control():
            self._paused = True
            if mode is PauseMode.ABORT:
                return self._abort_all_locked("aborted by pause_generation")
            if mode is PauseMode.RETRACT:
                return self._retract_all_locked()
            return len(self._batch.running)

    def continue_generation(self) -> None:
        """Resume scheduling after ``pause``."""
        with self._control():
            self._paused = False

    def _retract_all_locked(self) -> int:
        """Drop the KV of every running sequence and put it back at the head of the queue."""
        retracted = sorted(self._batch.drop_all(), key=lambda s: s.arrival)
        self._waiting.extendleft(reversed(retracted))
        return len(retracted)

    def _drain(self) -> None:
        with self._control():
            if self._paused and self._batch.running:
                raise RuntimeError(
                    "a drain update cannot finish while generation is paused with requests "
                    "in flight; call continue_generation() first or use drain=False"
                )
            self._admitting = False
        if self._thread_alive():
            with self._changed:
                self._changed.wait_for(
                    lambda: not self._batch.running or self._paused or self._closed
                )
        else:
            while self._batch.running and not self._paused:
                self.step()
        with self._control():
            if self._batch.running:
                self._admitting = True
                raise RuntimeError(
                    "generation was paused or shut down while draining for a weight update; "
                    "the weights were not updated"
                )

    # ------------------------------------------------------------ step loop

    def start(self) -> None:
        """Run the scheduler in a background daemon thread."""
        with self._lock:
            if self._thread_alive():
                return
            if self._closed:
                raise EngineShutdownError("the inference engine has been shut down")
            self._stop_thread = False
            self._thread = threading.Thread(target=self._loop, name="sluice-inference", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Stop the scheduler thread and abort whatever is still in flight."""
        with self._lock:
            self._stop_thread = True
            self._closed = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self._abort_all_locked("the inference engine shut down")

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop_thread:
            while self._control_waiters > 0 and not self._stop_thread:
                time.sleep(0.0002)
            try:
                worked = self.step()
            except Exception as exc:  # keep serving: fail what was in flight, not the thread
                self._fail_in_flight(exc)
                continue
            if not worked:
                with self._changed:
                    if not self._stop_thread and not self._has_work():
                        self._changed.wait(timeout=0.05)

    def _fail_in_flight(self, exc: Exception) -> None:
        with self._lock:
            failed = [*self._batch.drop_all(), *self._waiting]
            self._waiting.clear()
            for seq in failed:
                self._in_flight.pop(seq.request_id, None)
                if not seq.future.done():
                    seq.future.set_exception(
                        RuntimeError(f"inference step failed: {type(exc).__name__}: {exc}")
                    )
            self._changed.notify_all()

    def _has_work(self) -> bool:
        if self._paused:
            return False
        return bool(self._batch.running) or (self._admitting and bool(self._waiting))

    def step(self) -> bool:
        """One scheduler step: admit + prefill waiting prompts, then one decode step.

        Returns False when there was nothing to do (idle or paused).
        """
        with self._lock, torch.inference_mode():
            if not self._has_work():
                return False
            self.step_count += 1
            admitted: list[RequestState] = []
            if self._admitting:
                free = self.max_batch_size - len(self._batch.running)
                while self._waiting and len(admitted) < free:
                    admitted.append(self._waiting.popleft())
            if admitted:
                version = self._weight_version
                prefilled = self._batch.prefilled_tokens
                started = time.perf_counter()
                finished = self._batch.admit(admitted, step=self.step_count, version=version)
                self.profile.add_prefill(
                    self._batch.prefilled_tokens - prefilled, time.perf_counter() - started
                )
                self._finish_all(finished)
            if self._batch.running:
                rows = len(self._batch.running)
                started = time.perf_counter()
                finished = self._batch.decode(version=self._weight_version)
                elapsed = time.perf_counter() - started
                self.profile.add_decode(rows, self._batch.last_decode_context, elapsed)
                self._finish_all(finished)
            self._changed.notify_all()
            return True

    def _finish_all(self, finished: list[Finished]) -> None:
        for seq, reason, matched in finished:
            self._finish(seq, reason, matched_stop_token_id=matched)

    def _finish(
        self,
        seq: RequestState,
        reason: FinishReason,
        matched_stop_token_id: int | None = None,
        abort_message: str | None = None,
    ) -> None:
        """Resolve a request's future with its output."""
        self._in_flight.pop(seq.request_id, None)
        output = GenerationOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt,
            output_token_ids=list(seq.output_token_ids),
            behaviour_logprobs=list(seq.logprobs),
            token_versions=list(seq.versions),
            finish_reason=reason,
            matched_stop_token_id=matched_stop_token_id,
            abort_message=abort_message,
            admitted_step=seq.admitted_step,
            finished_step=self.step_count,
            e2e_latency_s=time.perf_counter() - seq.submitted_at,
        )
        if not seq.future.done():
            seq.future.set_result(output)
