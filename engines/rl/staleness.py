"""Admission control for rollouts: the staleness bound floor(n / B) <= i + eta (docs/design.md §1).

The rollout side asks :class:`StalenessGate` before it starts sampling a prompt group.
B = ``prompts_per_batch``, i = the newest committed policy version, eta =
``max_staleness``. Following AReaL, n counts the groups that hold a slot: accepted
(committed to the rollout stream, trained or not) plus in flight. A group that is
rejected or abandoned (filtered, timed out, lost in a crash) gives its slot back, so
it never pushes later groups toward the bound.

**Invariant.** Every admitted group had, at the moment it was admitted,

    n = accepted + in_flight (before it)  with  floor(n / B) <= i + eta,

equivalently ``accepted + in_flight <= (i + eta + 1) * B`` after every admission. When
the trainer consumes B groups per version, oldest first, and groups finish in the order
they started, a group started at version i is trained at a version <= i + eta.

A group that runs much longer than the ones started after it finishes after them.
Taking groups in finishing order would train it later than i + eta (AReaL has the
same gap); Sluice's trainer instead builds batch k from the groups issued as numbers
kB .. kB+B-1, whatever order they finish in, which keeps the bound for every group
(tasks/train/role.py). :meth:`StalenessGate.overdue` lists groups in flight past the bound.

**Restarts** (AReaL #1345/#1388). A gate that restarts from zero would admit
(i + eta + 1) * B groups at once. :meth:`StalenessGate.resume` re-bases the count from
durable state instead: n = committed_version * B + (groups in the stream not yet
consumed by the trainer). Groups that were in flight when the process died never
reached the stream and are treated as abandoned.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class _InFlight:
    policy_version: int
    """Policy version current when the group was admitted."""


class StalenessGate:
    """Counts prompt groups against the staleness bound; safe to share between threads.

    ``try_start`` returns a ticket for each admitted group; the ticket is unique for the
    life of the gate and is what ``finish`` / ``abandon`` take back. Without abandons the
    ticket equals the group's admission position n.
    """

    def __init__(self, prompts_per_batch: int, max_staleness: int, *, accepted: int = 0) -> None:
        """A gate with ``accepted`` groups already holding slots (see :meth:`resume`).

        Args:
            prompts_per_batch: B, prompt groups per training step.
            max_staleness: eta, how many versions behind a trained batch may be.
            accepted: groups already accepted before this gate existed.
        """
        if prompts_per_batch < 1:
            raise ValueError(f"prompts_per_batch must be >= 1, got {prompts_per_batch}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if accepted < 0:
            raise ValueError(f"accepted must be >= 0, got {accepted}")
        self.prompts_per_batch = prompts_per_batch
        self.max_staleness = max_staleness
        self._lock = threading.Lock()
        self._accepted = accepted
        self._abandoned = 0
        self._in_flight: dict[int, _InFlight] = {}
        self._next_ticket = accepted

    @classmethod
    def resume(
        cls,
        prompts_per_batch: int,
        max_staleness: int,
        *,
        committed_version: int,
        groups_in_stream: int,
        groups_consumed: int,
    ) -> StalenessGate:
        """Rebuild the gate after a restart from durable state, never from zero.

        Args:
            prompts_per_batch: B.
            max_staleness: eta.
            committed_version: newest policy version committed in the registry.
            groups_in_stream: prompt groups ever committed to the rollout stream.
            groups_consumed: of those, how many the trainer's ledger marks consumed.
        """
        return cls(
            prompts_per_batch,
            max_staleness,
            accepted=cls._rebased_count(
                prompts_per_batch, committed_version, groups_in_stream, groups_consumed
            ),
        )

    @staticmethod
    def _rebased_count(
        prompts_per_batch: int, committed_version: int, groups_in_stream: int, groups_consumed: int
    ) -> int:
        if committed_version < 0:
            raise ValueError(f"committed_version must be >= 0, got {committed_version}")
        if not 0 <= groups_consumed <= groups_in_stream:
            raise ValueError(
                f"need 0 <= groups_consumed ({groups_consumed}) <= groups_in_stream "
                f"({groups_in_stream})"
            )
        # The trainer at version v has trained v batches; what waits in the stream goes
        # into the next ones. Counting from v * B (not from the raw stream total) also
        # stays right when the trainer consumed more than B groups per step (filtered
        # groups): the pending queue is what delays new data.
        return committed_version * prompts_per_batch + (groups_in_stream - groups_consumed)

    def rebase(self, committed_version: int, groups_in_stream: int, groups_consumed: int) -> None:
        """Re-derive the accepted count from durable state, keeping groups still in flight."""
        with self._lock:
            self._accepted = self._rebased_count(
                self.prompts_per_batch, committed_version, groups_in_stream, groups_consumed
            )

    # ------------------------------------------------------------------ queries

    @property
    def accepted(self) -> int:
        """Groups accepted (or counted as accepted by a re-base)."""
        return self._accepted

    @property
    def in_flight(self) -> int:
        """Groups admitted and not yet finished or abandoned."""
        return len(self._in_flight)

    @property
    def abandoned(self) -> int:
        """Groups given back by :meth:`abandon` during the life of this gate."""
        return self._abandoned

    def _limit(self, policy_version: int) -> int:
        if policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        return (policy_version + self.max_staleness + 1) * self.prompts_per_batch

    def capacity(self, policy_version: int) -> int:
        """How many more groups may start now, at committed version ``policy_version``."""
        with self._lock:
            return max(0, self._limit(policy_version) - self._accepted - len(self._in_flight))

    def overdue(self, policy_version: int) -> list[int]:
        """Tickets in flight that were admitted more than eta versions before ``policy_version``."""
        with self._lock:
            return [
                t
                for t, g in self._in_flight.items()
                if policy_version - g.policy_version > self.max_staleness
            ]

    # ------------------------------------------------------------------ transitions

    def try_start(self, policy_version: int) -> int | None:
        """Admit one group if the bound allows it; returns its ticket, or None if full."""
        with self._lock:
            position = self._accepted + len(self._in_flight)
            if position >= self._limit(policy_version):
                return None
            ticket = self._next_ticket
            self._next_ticket += 1
            self._in_flight[ticket] = _InFlight(policy_version)
            return ticket

    def _take(self, ticket: int, action: str) -> _InFlight:
        try:
            return self._in_flight.pop(ticket)
        except KeyError:
            raise ValueError(
                f"cannot {action} group ticket {ticket}: it is not in flight "
                "(never admitted, already finished/abandoned, or from before a restart)"
            ) from None

    def finish(self, ticket: int) -> None:
        """The group was committed to the rollout stream: its slot stays taken."""
        with self._lock:
            self._take(ticket, "finish")
            self._accepted += 1

    def release(self, groups: int = 1) -> None:
        """Accepted groups that take no place in any batch after all (dynamic sampling:
        their rewards were all equal): their slots are given back. A group admitted
        later still has fewer than (i + eta + 1) * B groups before it that can be
        trained, so the bound holds for the batch it lands in."""
        if groups < 0:
            raise ValueError(f"groups must be >= 0, got {groups}")
        with self._lock:
            self._accepted = max(0, self._accepted - groups)

    def abandon(self, ticket: int) -> None:
        """The group was rejected or aborted: its slot is freed for a new group."""
        with self._lock:
            self._take(ticket, "abandon")
            self._abandoned += 1
