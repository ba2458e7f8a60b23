"""Discrete-event simulator of the Sluice pipeline: seconds per step from costs and a layout.

``simulate(workload, costs, layout)`` plays a run forward (warm-up steps, then measured
steps) and reports throughput, idle shares, staleness and weight-update costs. It is
pure compute (numpy for the draws, :func:`sluice.engines.rl.batching.dynamic_micro_batches` for
the micro-batch count) and fast enough to call thousands of times in a sweep: decode
time between two events is closed form (:mod:`sluice.engines.planner.server`), never a loop
over steps.

Semantics
---------
- **Groups.** Group n = 0, 1, 2, ... has one prompt length and G response lengths,
  drawn with ``numpy.random.default_rng(seed)`` one batch block of B groups at a time
  (prompts, then responses), so group n is the same in every unsliced layout with the
  same B, G and seed (sliced: see Slicing). Lengths are capped at ``max_new_tokens``; ``fixed_response_lengths``
  replaces the response draw.
- **Gate (async).** Group n starts, i.e. is dispatched, as soon as
  floor(n / B) <= v + eta, v the newest version visible to the rollout (0 at t=0).
- **Sync.** Played as the async pipeline with eta = 0 on servers = D // devices_per_server,
  training on all D devices and publish_every = 1: step k dispatches groups
  kB .. kB+B-1 when version k becomes visible, waits for the last reward, trains, then
  after ``publish_s`` every server (idle by then) pauses ``weight_load_s`` (or both
  together replaced by ``sync_step_overhead_s`` when set) before it admits step k+1.
  A measured ``sync_step_overhead_s`` also holds the step's scoring, so ``reward_s``
  is not added on top of it.
- **Dispatch.** A group's G samples go to one server, the least loaded (fewest active +
  queued samples, ties to the lowest index), and queue there; a server admits queued
  samples FIFO at a step boundary while it has free slots. Admitted prompts are
  prefilled (once per group per server if ``prefill_shared_by_group``) as part of the
  next step, which also yields the sample's first token.
- **Decode.** A step costs (a + b*r + c*d) / devices_per_server**decode_scaling; every
  active sequence gains one token per step; a sample finishes with its drawn length.
  An event that lands inside a step (a dispatch, a weight update) takes effect at the
  end of that step: a step in progress is never cut.
- **Reward.** A sample's reward arrives ``reward_s`` after its last token; a group is
  complete when all G samples are scored.
- **Trainer.** Step k starts once the trainer is idle and batch k is complete ("issue":
  groups kB .. kB+B-1; "finish": the (kB+1)-th to (k+1)B-th groups to complete). It
  takes (train_step_s + sum over micro-batches of (train_micro_batch_s + tokens *
  train_token_s)) / T**train_scaling. When it ends version k+1 exists, and if
  (k+1) % publish_every == 0 it becomes visible ``publish_s`` later.
- **Weight update (async)**, when a server is behind the visible version, at its next
  step boundary: interruptible = pause ``weight_load_s`` + one prefill pass
  (``prefill_call_s`` + ``prefill_token_s`` a token) over every active
  sequence's full context (no prompt sharing: the cache is stale), then continue;
  drain = stop admitting from the moment the version is visible, decode until no
  sequence is active (the drain wait), pause ``weight_load_s``, admit again. A server
  loads the newest visible version at the end of its pause, so a version published
  during a drain or pause is covered by the same update.
- **Measurement.** The window runs from the end of train step ``warmup_steps - 1`` (t=0
  without warm-up) to the end of the last step. Trainer idle = window minus the
  measured steps' train time. Rollout idle = server time with no active sequence
  outside a weight-update pause; the pause share is reported apart. Staleness is
  per trained group of the measured steps: train step minus the version visible when
  the group was dispatched. Update costs average over server updates whose pause
  starts inside the window.
- **Slicing.** With more servers than ``slice_servers`` the simulator plays
  ``slice_servers`` of them and B_slice = max(1, round(B * slice_servers / servers))
  groups per batch, and scales the trainer's token and micro-batch work (and the
  reported token throughputs) by servers / slice_servers. Least-loaded dispatch treats
  servers symmetrically, so a slice sees the same load per server as the whole fleet.
  ``batch_scale`` reports the rounding (the batch simulated stands for B * batch_scale
  groups). The slice's groups are a systematic sample of a whole drawn batch that keeps
  its longest group (:mod:`sluice.engines.planner.draws`), so a batch that waits for its
  longest response waits as long as the fleet's would. What slicing cannot keep is the
  maximum over more servers: when a batch waits for its slowest server (sync, eta = 0)
  a slice runs a few percent faster than the fleet (3-4% for B=512, G=16 on 96 servers
  sliced to 8; up to ~10% when a server holds one group at a time).
"""

from __future__ import annotations

import heapq
import itertools
import math
import warnings

import numpy as np

from sluice.engines.planner.costs import CostModel, Layout, Workload
from sluice.engines.planner.draws import draw_block
from sluice.engines.planner.result import SimResult
from sluice.engines.planner.server import (
    IDLE,
    PAUSE,
    RUN,
    SAMPLE_BITS,
    Segment,
    Server,
    StepCosts,
)
from sluice.engines.rl.batching import OverlongSequenceWarning, dynamic_micro_batches

__all__ = ["SimResult", "simulate"]

_WAKE, _GROUP, _TRAIN, _VISIBLE = 0, 1, 2, 3
"""Event kinds: a server's step boundary or pause end; a group's last reward; a train
step's end; a version becoming visible to the rollout."""


def simulate(
    workload: Workload,
    costs: CostModel,
    layout: Layout,
    *,
    steps: int = 20,
    warmup_steps: int = 3,
    seed: int = 0,
    slice_servers: int = 8,
) -> SimResult:
    """Simulate ``warmup_steps + steps`` train steps and measure the last ``steps``.

    Deterministic for a given seed. See the module docstring for the semantics.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if slice_servers < 1:
        raise ValueError(f"slice_servers must be >= 1, got {slice_servers}")
    return _Simulation(workload, costs, layout, steps, warmup_steps, seed, slice_servers).run()


class _Simulation:
    """One run: a heap of (time, sequence, kind, x, y) events, ties in push order."""

    def __init__(
        self,
        workload: Workload,
        costs: CostModel,
        layout: Layout,
        steps: int,
        warmup_steps: int,
        seed: int,
        slice_servers: int,
    ) -> None:
        self.workload, self.costs, self.layout = workload, costs, layout
        self.steps, self.warmup = steps, warmup_steps
        self.total = warmup_steps + steps
        self.sync = layout.mode == "sync"
        self.servers_total = layout.servers
        n_sim = min(self.servers_total, slice_servers)
        self.scale = self.servers_total / n_sim
        B = layout.prompts_per_batch
        self.B = B if n_sim == self.servers_total else max(1, round(B * n_sim / self.servers_total))
        self.batch_scale = self.B * self.scale / B
        self.G = workload.group_size
        if self.sync:
            self.eta, self.publish_every, self.interruptible = 0, 1, True
            self.by_issue = True
            overhead = costs.sync_step_overhead_s
            self.publish_s = costs.publish_s if overhead is None else 0.0
            self.weight_load_s = costs.weight_load_s if overhead is None else overhead
            self.reward_s = costs.reward_s if overhead is None else 0.0
        else:
            self.eta, self.publish_every = layout.max_staleness, layout.publish_every
            self.interruptible = layout.interruptible
            self.by_issue = layout.batch_order == "issue"
            self.publish_s, self.weight_load_s = costs.publish_s, costs.weight_load_s
            self.reward_s = costs.reward_s
        speed = layout.devices_per_server**costs.decode_scaling
        self.step_costs = StepCosts(
            step_s=costs.decode_step_s / speed,
            row_s=costs.decode_row_s / speed,
            context_s=costs.decode_context_s / speed,
            prefill_token_s=costs.prefill_token_s / speed,
        )
        self.prefill_call_s = costs.prefill_call_s / speed
        self.train_divisor = layout.train_devices**costs.train_scaling
        self.slots = layout.slots_per_server
        self.shared_prefill = workload.prefill_shared_by_group
        self.servers = [Server(i) for i in range(n_sim)]
        self.rng = np.random.default_rng(seed)
        # Per group / per sample (sample id = n * G + j); grown a batch block at a time.
        self.prompt: list[int] = []
        self.response: list[int] = []
        self.left: list[int] = []
        self.version_at_start: list[int] = []
        self.batch_complete: list[int] = []
        self.completed: list[int] = []
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = itertools.count()
        self.visible = 0
        self.next_group = 0
        self.next_step = 0
        self.training = False
        self.finished = 0
        self.trained_samples = 0
        self.trained_groups: set[int] = set()
        self.train_s: list[float] = []
        self.train_tokens: list[float] = []
        self.staleness: list[int] = []
        self.updates: list[tuple[float, int, float]] = []
        self.w0 = 0.0 if warmup_steps == 0 else math.inf
        self.w0_generated = 0
        self.w1 = math.nan

    def run(self) -> SimResult:
        self._open_gate(0.0)
        events = self.events
        servers = self.servers
        pop = heapq.heappop
        while events:
            t, _, kind, x, y = pop(events)
            if kind == _WAKE:
                s = servers[x]
                if y == s.token:
                    self._wake(s, t)
            elif kind == _GROUP:
                self._group_done(x, t)
            elif kind == _TRAIN:
                if self._train_end(x, t):
                    return self._result()
            else:
                self._version_visible(x, t)
        raise RuntimeError("simulation ran out of events before the last train step")

    def _push(self, t: float, kind: int, x: int, y: int = 0) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, x, y))

    def _clip(self, start: float, end: float) -> float:
        """Seconds of [start, end] inside the window (its start is inf until known)."""
        return max(0.0, end - max(start, self.w0))

    def _draw_block(self) -> None:
        prompts, responses = draw_block(
            self.rng, self.workload, self.layout.prompts_per_batch, self.B, len(self.response)
        )
        self.prompt.extend(prompts)
        self.response.extend(responses)
        self.left.extend([self.G] * self.B)
        self.version_at_start.extend([0] * self.B)
        self.batch_complete.append(0)

    def _open_gate(self, t: float) -> None:
        """Dispatch every group the staleness bound admits at version ``self.visible``."""
        limit = (self.visible + self.eta + 1) * self.B
        G, servers = self.G, self.servers
        touched: set[int] = set()
        while self.next_group < limit:
            n = self.next_group
            if n >= len(self.prompt):
                self._draw_block()
            target = min(servers, key=_load)
            target.queue.extend(range(n * G, n * G + G))
            self.version_at_start[n] = self.visible
            touched.add(target.index)
            self.next_group += 1
        for i in sorted(touched):
            s = servers[i]
            if s.b < self.slots and not s.draining:
                self._interrupt(s, t)

    def _group_done(self, n: int, t: float) -> None:
        if self.by_issue:
            self.batch_complete[n // self.B] += 1
        else:
            self.completed.append(n)
        self._try_train(t)

    def _schedule(self, s: Server, t: float) -> None:
        s.token += 1
        s.wake_t = t
        heapq.heappush(self.events, (t, next(self.seq), _WAKE, s.index, s.token))

    def _interrupt(self, s: Server, t: float) -> None:
        """Make the server reconsider at its first step boundary at or after t."""
        if s.state == PAUSE:
            return  # the end of the pause admits and loads the newest version
        if s.state == IDLE:
            if s.wake_t != t:
                self._schedule(s, t)
            return
        seg = s.segment
        assert seg is not None
        k = seg.first_boundary_at_or_after(t)
        if k < seg.k_max:
            seg.k_max = k
            self._schedule(s, seg.end(k))

    def _leave_idle(self, s: Server, t: float) -> None:
        if s.state == IDLE:
            s.idle_s += self._clip(s.idle_since, t)

    def _pause(self, s: Server, t: float, seconds: float, recomputed: int, drained: float) -> None:
        self._leave_idle(s, t)
        self.updates.append((t, recomputed, drained))
        s.state = PAUSE
        s.segment = None
        s.pause_start = t
        self._schedule(s, t + seconds)

    def _wake(self, s: Server, t: float) -> None:
        s.wake_t = -1.0
        if s.state == PAUSE:
            s.pause_s += self._clip(s.pause_start, t)
            s.version = self.visible
            s.state = IDLE
            s.idle_since = t
        elif s.state == RUN:
            seg = s.segment
            assert seg is not None
            if seg.k_max:
                s.advance(seg.k_max)
                finished = s.retire(self.prompt, self.response, self.G, self.left)
                self.finished += finished
                for n in s.completed:
                    self._push(t + self.reward_s, _GROUP, n)
            s.segment = None
            if s.b == 0:
                s.state = IDLE
                s.idle_since = t
        if s.version < self.visible:
            if self.interruptible:
                recomputed = s.c
                s.pending_prefill = 0  # the recompute prefills the newly admitted too
                seconds = self.weight_load_s + self._prefill_s(recomputed)
                self._pause(s, t, seconds, recomputed, 0.0)
                return
            if s.b == 0:
                drained = t - s.drain_start if s.draining else 0.0
                s.draining = False
                self._pause(s, t, self.weight_load_s, 0, drained)
                return
            if not s.draining:
                s.draining = True
                s.drain_start = t
        if not s.draining and s.queue and s.b < self.slots:
            s.admit(self.prompt, self.response, self.G, self.shared_prefill, self.slots)
        if s.b:
            self._leave_idle(s, t)
            k = (s.active[0] >> SAMPLE_BITS) - s.step
            prefill_s = self._prefill_s(s.pending_prefill)
            seg = Segment(t, prefill_s, self.step_costs, s.b, s.c, k)
            s.segment = seg
            s.state = RUN
            self._schedule(s, seg.end(k))

    def _version_visible(self, version: int, t: float) -> None:
        self.visible = max(self.visible, version)
        for s in self.servers:
            if s.version >= self.visible or s.state == PAUSE:
                continue
            if self.interruptible or s.state == IDLE:
                self._interrupt(s, t)
            elif not s.draining:
                s.draining = True
                s.drain_start = t
        self._open_gate(t)

    def _try_train(self, t: float) -> None:
        k, B, G = self.next_step, self.B, self.G
        if self.training or k >= self.total:
            return
        if self.by_issue:
            if k >= len(self.batch_complete) or self.batch_complete[k] < B:
                return
            groups: list[int] | range = range(k * B, (k + 1) * B)
        else:
            if len(self.completed) < (k + 1) * B:
                return
            groups = self.completed[k * B : (k + 1) * B]
        prompt, response = self.prompt, self.response
        lengths = [prompt[n] + response[sid] for n in groups for sid in range(n * G, n * G + G)]
        budget = self.layout.max_tokens_per_micro_batch
        if max(lengths) > budget:
            with warnings.catch_warnings():
                # Counted, not worth a warning per simulated step.
                warnings.simplefilter("ignore", OverlongSequenceWarning)
                micro_batches = len(dynamic_micro_batches(lengths, budget))
        else:
            micro_batches = len(dynamic_micro_batches(lengths, budget))
        # Dropped groups (Workload.trained_fraction) never reach the trainer.
        kept = self.workload.trained_fraction
        tokens = kept * sum(lengths)
        micro_batches = max(1, math.ceil(kept * micro_batches))
        c = self.costs
        work = micro_batches * c.train_micro_batch_s + tokens * c.train_token_s
        seconds = (c.train_step_s + self.scale * work) / self.train_divisor
        self.training = True
        self.train_s.append(seconds)
        self.train_tokens.append(tokens)
        self.trained_samples += len(lengths)
        self.trained_groups.update(groups)
        if k >= self.warmup:
            self.staleness.extend(k - self.version_at_start[n] for n in groups)
        self._push(t + seconds, _TRAIN, k)

    def _train_end(self, k: int, t: float) -> bool:
        """Version k+1 exists; returns True when that was the last step."""
        self.training = False
        self.next_step = k + 1
        if k == self.warmup - 1:
            self.w0 = t
            self.w0_generated = sum(s.generated_by(t) for s in self.servers)
        if k == self.total - 1:
            self.w1 = t
            return True
        if (k + 1) % self.publish_every == 0:
            self._push(t + self.publish_s, _VISIBLE, k + 1)
        self._try_train(t)
        return False

    def _prefill_s(self, tokens: int) -> float:
        """One prefill pass over `tokens` (none: no pass, no cost)."""
        if tokens <= 0:
            return 0.0
        return self.prefill_call_s + tokens * self.step_costs.prefill_token_s

    def _result(self) -> SimResult:
        w0, w1, servers = self.w0, self.w1, self.servers
        elapsed = w1 - w0
        if not elapsed > 0:
            raise ValueError(
                "the measured window took no time: every cost on the critical path is zero"
            )
        generated = sum(s.generated_by(w1) for s in servers) - self.w0_generated
        for s in servers:
            if s.state == IDLE:
                s.idle_s += self._clip(s.idle_since, w1)
            elif s.state == PAUSE:
                s.pause_s += self._clip(s.pause_start, w1)
        server_time = len(servers) * elapsed
        measured_train_s = self.train_s[self.warmup :]
        updates = [u for u in self.updates if w0 <= u[0] < w1]
        dispatched = self.next_group * self.G
        return SimResult(
            steps=self.steps,
            elapsed_s=elapsed,
            seconds_per_step=elapsed / self.steps,
            trained_tokens_per_s=sum(self.train_tokens[self.warmup :]) * self.scale / elapsed,
            generated_tokens_per_s=generated * self.scale / elapsed,
            trainer_idle_ratio=max(0.0, 1.0 - sum(measured_train_s) / elapsed),
            rollout_idle_ratio=None if self.sync else sum(s.idle_s for s in servers) / server_time,
            rollout_update_ratio=None
            if self.sync
            else sum(s.pause_s for s in servers) / server_time,
            staleness_mean=float(np.mean(self.staleness)) if self.staleness else 0.0,
            staleness_max=max(self.staleness, default=0),
            recomputed_tokens_per_update=float(np.mean([u[1] for u in updates]))
            if updates
            else 0.0,
            drain_wait_s_per_update=float(np.mean([u[2] for u in updates])) if updates else 0.0,
            train_s_per_step=float(np.mean(measured_train_s)),
            server_updates=len(updates),
            servers=self.servers_total,
            simulated_servers=len(servers),
            simulated_prompts_per_batch=self.B,
            batch_scale=self.batch_scale,
            trained_samples_total=self.trained_samples,
            trained_groups_distinct=len(self.trained_groups),
            dispatched_samples_total=dispatched,
            finished_samples_total=self.finished,
            in_flight_samples_at_end=dispatched - self.finished,
        )


def _load(s: Server) -> int:
    return s.b + len(s.queue)
