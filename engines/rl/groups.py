"""Prompt groups by issue number: their ids, where a restart goes on, and batch k.

The rollout role issues prompt group n under the id `group_key(n)`, and the staleness
gate admits it only while floor(n / B) <= i + eta (i = the newest committed version).
So the trainer takes batch k as exactly the groups numbered kB .. kB+B-1, whatever
order they finished in (`GroupBuffer`): taking groups as they arrive would let a slow
group of batch k slip into batch k + 1, eta + 1 versions old. A restarted rollout role
re-issues the numbers below its high-water mark that never reached the stream
(`reissue_plan`) and re-bases its gate from durable counts (`resume_gate`).
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

import pyarrow as pa

from sluice.engines.rl.staleness import StalenessGate


def group_key(index: int) -> str:
    """The `group_id` of the prompt group the rollout role issued as number `index`."""
    return f"group-{index:09d}"


def group_index_of(group_id: str) -> int:
    """The issue number in a `group_id` made by `group_key`; ValueError for any other id."""
    head, _, number = group_id.rpartition("-")
    if head != "group" or not number.isdigit():
        raise ValueError(f"{group_id!r} is not a Sluice group id ('group-NNNNNNNNN')")
    return int(number)


def reissue_plan(written: set[int]) -> tuple[int, list[int]]:
    """Where a restarted rollout role goes on: the next new issue number, and the numbers
    below it that never reached the stream (in flight when the last process died), which
    are issued again, smallest first, with the same prompt."""
    next_index = max(written) + 1 if written else 0
    return next_index, sorted(set(range(next_index)) - written)


def resume_gate(
    groups_in_stream: int, policy_version: int, prompts_per_batch: int, max_staleness: int
) -> StalenessGate:
    """The staleness gate re-based from durable state, so a restart never bursts past it.

    Every trainer step consumes exactly B groups (B is a multiple of the shard size), so
    committed version v says training has taken v * B of the groups in the stream.
    """
    return StalenessGate.resume(
        prompts_per_batch,
        max_staleness,
        committed_version=policy_version,
        groups_in_stream=groups_in_stream,
        groups_consumed=min(groups_in_stream, policy_version * prompts_per_batch),
    )


class NamedShard(Protocol):
    """What the buffer needs of a stream shard: its unique name (a `ShardRef` has one)."""

    @property
    def name(self) -> str: ...


ShardT = TypeVar("ShardT", bound=NamedShard)


class GroupBuffer(Generic[ShardT]):
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
        self._refs: dict[str, ShardT] = {}
        self._done: list[ShardT] = []

    def indices(self, step: int) -> range:
        return range(step * self.prompts_per_batch, (step + 1) * self.prompts_per_batch)

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, ref: ShardT, table: pa.Table, step: int) -> list[str]:
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

    def take(self, step: int) -> tuple[pa.Table | None, list[ShardT]]:
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
