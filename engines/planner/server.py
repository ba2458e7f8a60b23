"""One simulated inference server: continuous batching, decode time in closed form.

A server decodes its active sequences one step at a time. A step with b active
sequences and total context c (prompt + generated tokens, summed over them) costs

    a + b*r + c*d            (a = decode_step_s, r = decode_row_s, d = decode_context_s)

divided by devices_per_server**decode_scaling, plus, on the first step after an
admission, the prefill of the admitted prompts. Between two events b is constant and c
grows by b per step, so k steps from context c0 with pending prefill P take

    T(k) = (P + k*(a + b*r) + d*(k*c0 + b*k*(k-1)/2)) / scale      (k >= 1; T(0) = 0)

and the simulator jumps from event to event instead of looping over steps.
:class:`Segment` holds one such stretch; :meth:`Segment.steps_done_by` inverts T by
the quadratic formula (checked and nudged on the integers, so float rounding never
puts a boundary on the wrong side of an event).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

IDLE, RUN, PAUSE = 0, 1, 2
"""Server states: no active sequence and no pause; decoding a segment; loading weights."""

SAMPLE_BITS = 32
"""Active-sample heap entries are ``finish_step << SAMPLE_BITS | sample_id`` (ints sort fast)."""
SAMPLE_MASK = (1 << SAMPLE_BITS) - 1


@dataclass(frozen=True)
class StepCosts:
    """Decode and prefill costs of one server, already divided by its device speed-up."""

    step_s: float
    """Seconds: fixed cost of one decode step."""
    row_s: float
    """Seconds per active sequence per step."""
    context_s: float
    """Seconds per context token of every active sequence per step."""
    prefill_token_s: float
    """Seconds per prefilled token."""


class Segment:
    """k_max decode steps of a server with b active sequences from context c0 at t0."""

    __slots__ = ("t0", "prefill_s", "per_step_s", "context_s", "c0", "b", "k_max")

    def __init__(
        self, t0: float, prefill_s: float, costs: StepCosts, b: int, c0: int, k_max: int
    ) -> None:
        self.t0 = t0
        self.prefill_s = prefill_s
        self.per_step_s = costs.step_s + b * costs.row_s
        self.context_s = costs.context_s
        self.c0 = c0
        self.b = b
        self.k_max = k_max

    def elapsed(self, k: int) -> float:
        """T(k): seconds from t0 to the end of step k (0 for k = 0)."""
        if k <= 0:
            return 0.0
        return (
            self.prefill_s
            + k * self.per_step_s
            + self.context_s * (k * self.c0 + self.b * k * (k - 1) / 2)
        )

    def end(self, k: int) -> float:
        """Time at which step k of the segment ends."""
        return self.t0 + self.elapsed(k)

    def steps_done_by(self, t: float) -> int:
        """Largest k in 0 .. k_max whose step ends at or before t."""
        y = t - self.t0
        if y < self.elapsed(1):
            return 0
        if self.end(self.k_max) <= t:
            return self.k_max
        # T(k) = P + beta*k + alpha*k**2 with alpha = d*b/2, beta = a + b*r + d*c0 - alpha.
        alpha = self.context_s * self.b / 2
        beta = self.per_step_s + self.context_s * self.c0 - alpha
        rest = y - self.prefill_s
        root = beta * beta + 4 * alpha * rest
        denominator = beta + math.sqrt(root) if root > 0 else beta
        k = int(2 * rest / denominator) if denominator > 0 else self.k_max
        k = min(max(k, 1), self.k_max)
        while k < self.k_max and self.end(k + 1) <= t:
            k += 1
        while k > 0 and self.end(k) > t:
            k -= 1
        return k

    def first_boundary_at_or_after(self, t: float) -> int:
        """Smallest k in 0 .. k_max whose step ends at or after t (the step in progress
        at t finishes; an event exactly on a boundary is taken there)."""
        if t <= self.t0:
            return 0
        k = self.steps_done_by(t)
        if k == self.k_max or (k > 0 and self.end(k) == t):
            return k
        return k + 1


class Server:
    """Mutable state of one simulated server (plain attributes: it sits in the hot loop)."""

    __slots__ = (
        "index",
        "state",
        "active",
        "queue",
        "b",
        "c",
        "step",
        "pending_prefill",
        "segment",
        "token",
        "wake_t",
        "version",
        "draining",
        "drain_start",
        "idle_since",
        "pause_start",
        "generated",
        "idle_s",
        "pause_s",
        "completed",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.state = IDLE
        self.active: list[int] = []
        """Heap of ``finish_step << SAMPLE_BITS | sample_id`` for the active sequences."""
        self.queue: deque[int] = deque()
        """Sample ids dispatched here and not yet admitted, FIFO."""
        self.b = 0
        self.c = 0
        self.step = 0
        """Decode steps this server has completed (finish steps are absolute)."""
        self.pending_prefill = 0
        """Prompt tokens admitted and not yet prefilled (charged to the next step)."""
        self.segment: Segment | None = None
        self.token = 0
        """Bumped whenever the scheduled wake changes; stale heap entries are skipped."""
        self.wake_t = -1.0
        self.version = 0
        self.draining = False
        self.drain_start = 0.0
        self.idle_since = 0.0
        self.pause_start = 0.0
        self.generated = 0
        """Tokens decoded by completed segment stretches."""
        self.idle_s = 0.0
        self.pause_s = 0.0
        self.completed: list[int] = []
        """Groups whose last sample the latest :meth:`retire` removed."""

    @property
    def load(self) -> int:
        """Active plus queued samples: what least-loaded dispatch compares."""
        return self.b + len(self.queue)

    def generated_by(self, t: float) -> int:
        """Tokens decoded up to t, counting the whole steps of the current segment done by t."""
        if self.state != RUN or self.segment is None:
            return self.generated
        return self.generated + self.segment.b * self.segment.steps_done_by(t)

    def advance(self, k: int) -> None:
        """Account k decode steps: every active sequence gained k tokens, prefill done."""
        self.step += k
        self.c += self.b * k
        self.generated += self.b * k
        self.pending_prefill = 0

    def admit(
        self, prompt: list[int], response: list[int], group_size: int, shared: bool, slots: int
    ) -> None:
        """Admit queued samples FIFO while slots are free; their prefill joins the next step."""
        q, active = self.queue, self.active
        while q and self.b < slots:
            sid = q.popleft()
            p = prompt[sid // group_size]
            if not shared or sid % group_size == 0:
                self.pending_prefill += p
            self.b += 1
            self.c += p
            heapq.heappush(active, ((self.step + response[sid]) << SAMPLE_BITS) | sid)

    def retire(
        self, prompt: list[int], response: list[int], group_size: int, left: list[int]
    ) -> int:
        """Remove the sequences whose last token came with the latest step.

        Decrements ``left`` (samples still unfinished per group); the groups that reach 0
        are in :attr:`completed` afterwards. Returns how many samples finished.
        """
        active, step = self.active, self.step
        completed: list[int] = []
        finished = 0
        while active and (active[0] >> SAMPLE_BITS) <= step:
            sid = heapq.heappop(active) & SAMPLE_MASK
            n = sid // group_size
            self.b -= 1
            self.c -= prompt[n] + response[sid]
            finished += 1
            left[n] -= 1
            if left[n] == 0:
                completed.append(n)
        self.completed = completed
        return finished
