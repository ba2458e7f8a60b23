"""The prompt groups a rollout role issues: which numbers the stream holds, which go
again, under which shard key, and how groups go out in requests.

Issue numbers are the run's (engines/rl/groups.py). A restarted role goes on from the
stream: numbers below its high-water mark that never reached it go again. After a
trainer restart (docs/design.md §2) a group holding a token of a lost version does not
count as written: its number goes again as a new *attempt*, written under a shard key
of its own (`engines.rl.lineage.attempt_key`), since the stream takes a second write of
a key as a retry and keeps the first.
"""

from __future__ import annotations

import numpy as np

from sluice.engines.rl.groups import group_index_of, group_key
from sluice.engines.rl.lineage import LostAfter, attempt_key, lost_rows
from sluice.engines.trajectory import GROUP_ID
from sluice.infra.streams.reader import StreamReader


class WrittenGroups:
    """What the rollouts stream holds, per issue number, for the surviving lineage."""

    def __init__(self, reader: StreamReader) -> None:
        self.reader = reader
        self.written: set[int] = set()
        """Numbers with a shard that holds no token of a lost version."""
        self.attempts: dict[int, int] = {}
        """Shards written per number, lost ones included (the next attempt's number)."""
        self.lost_shards = 0
        """Groups in the stream that hold tokens of lost versions (as of `scan`)."""

    def scan(self, lost: LostAfter) -> None:
        """Read every committed shard again (a restart, or a lineage reset: rare)."""
        self.written, self.attempts, self.lost_shards = set(), {}, 0
        for ref in self.reader.committed():
            table = self.reader.read(ref)
            ids = table.column(GROUP_ID).to_pylist()
            bad = lost_rows(table, lost)
            for group_id in set(ids):
                index = group_index_of(group_id)
                self.attempts[index] = self.attempts.get(index, 0) + 1
                if bad[np.array([g == group_id for g in ids])].any():
                    self.lost_shards += 1
                else:
                    self.written.add(index)

    @property
    def dropped(self) -> set[int]:
        """Numbers written only with tokens of lost versions: they go again."""
        return {index for index in self.attempts if index not in self.written}

    def key(self, index: int) -> str:
        """The shard key group `index` is written under now."""
        return attempt_key(group_key(index), self.attempts.get(index, 0))

    def wrote(self, index: int) -> None:
        self.written.add(index)
        self.attempts[index] = self.attempts.get(index, 0) + 1


def request_groups(
    admitted: list[tuple[int, int]], one_request: bool, servers: int
) -> list[list[tuple[int, int]]]:
    """The requests the groups admitted together go out in: one per group, or (one
    request a batch) one per server, contiguous runs of issue numbers."""
    if not one_request or not admitted:
        return [[group] for group in admitted]
    size = -(-len(admitted) // max(1, min(servers, len(admitted))))  # ceil
    return [admitted[i : i + size] for i in range(0, len(admitted), size)]
