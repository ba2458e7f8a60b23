"""Dynamic sampling on the rollout side: give back the staleness gate's slot of every
group the reward role scored as uninformative (all rewards equal).

The trainer drops such groups and draws further (engines/rl/groups.py), so they never
hold a place in a batch; once the rollout role knows one, it may start another group in
its place, which is the refill. It learns them from the scored stream, read here
without consuming it (each shard once; a restart reads them all, so the gate is
re-based from durable state as before). A group not scored yet keeps its slot, which
only makes the gate stricter.
"""

from __future__ import annotations

import logging

from sluice.engines.rl.groups import group_index_of, informative
from sluice.infra.streams.errors import CorruptShardError
from sluice.infra.streams.reader import StreamReader

log = logging.getLogger("sluice.rollout")


class UninformativeGroups:
    """The issue numbers of groups scored with all rewards equal, read as they appear."""

    def __init__(self, scored: StreamReader) -> None:
        self.scored = scored
        self.seen_shards: set[str] = set()
        self.numbers: set[int] = set()

    def poll(self) -> int:
        """Read the scored shards not seen yet; how many new uninformative groups."""
        found = 0
        for ref in self.scored.committed():
            if ref.name in self.seen_shards:
                continue
            self.seen_shards.add(ref.name)
            try:
                table = self.scored.read(ref)
            except CorruptShardError as exc:  # the trainer counts it lost; the slot stays
                log.warning("dynamic sampling: %s", exc)
                continue
            rewards: dict[int, list[float]] = {}
            for group, reward in zip(
                table.column("group_id").to_pylist(),
                table.column("reward").to_pylist(),
                strict=True,
            ):
                rewards.setdefault(group_index_of(str(group)), []).append(float(reward))
            for number, values in rewards.items():
                if not informative(values) and number not in self.numbers:
                    self.numbers.add(number)
                    found += 1
        return found
