"""Prompt groups by issue number: their ids, where a restart goes on, and batch k.

The rollout role issues prompt group n under the id `group_key(n)`, and the staleness
gate admits it only while floor(n / B) <= i + eta (i = the newest committed version).
So the trainer takes batch k as exactly the groups numbered kB .. kB+B-1, whatever
order they finished in (`GroupBuffer`): taking groups as they arrive would let a slow
group of batch k slip into batch k + 1, eta + 1 versions old. A restarted rollout role
re-issues the numbers below its high-water mark that never reached the stream
(`reissue_plan`) and re-bases its gate from durable counts (`resume_gate`).

A group's number also fixes its sampling seeds (`sample_seed`), and a batch is in
(group, sample) order, as in the synchronous loop: at eta = 0 both do the same work
and train the same batches, bit for bit on a CPU.

**Dynamic sampling with refill** (`trainer.dynamic_sampling`, DAPO): a group whose
rewards are all equal carries no gradient, so batch k is instead the B *informative*
groups that follow batch k − 1 in issue order, together with the uninformative ones
between them, which are dropped (and counted: the cost of refilling). The buffer keeps
a cursor, the first issue number no batch has taken, and the trainer records it with
every version. The gate stays exact: the rollout role gives back the slot of each group
it learns was uninformative (`informative`), so a group admitted while
accepted + in flight < (i + η + 1)B has fewer than (i + η + 1)B informative groups
before it, which puts it in a batch ≤ i + η.
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


def sample_index_of(sample_id: str) -> int:
    """Which of its group's responses a `sample_id` (`{group_key}-{k:03d}`) names: k."""
    head, _, number = sample_id.rpartition("-")
    if not head.startswith("group-") or not number.isdigit():
        raise ValueError(f"{sample_id!r} is not a Sluice sample id ('group-NNNNNNNNN-KKK')")
    return int(number)


def sample_seed(seed: int, group_index: int, sample: int) -> int:
    """The sampling seed of response `sample` of prompt group `group_index` in run `seed`.

    The synchronous loop and the rollout role draw group n's responses with the same
    seeds, so at eta = 0 they sample the same tokens: the rollout sends
    `sample_seed(seed, n, 0)` with n = G, and a server gives sample j that seed + j.
    Distinct for every (group, sample) while G <= 1009.
    """
    return seed * 1_000_003 + group_index * 1009 + sample


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


def informative(rewards: list[float]) -> bool:
    """Whether a group's rewards differ (all equal: zero advantage, no gradient)."""
    return len(rewards) > 0 and max(rewards) != min(rewards)


def in_sample_order(table: pa.Table, rows: list[int]) -> list[int]:
    """One group's `rows` of `table` ordered by sample index (as they are when the
    table has no `sample_id`), so a batch is in (group, sample) order whatever order a
    writer put the responses in: the synchronous loop trains them in that order."""
    if "sample_id" not in table.column_names:
        return rows
    ids = table.column("sample_id").take(rows).to_pylist()
    return [row for _, row in sorted(zip(map(sample_index_of, ids), rows, strict=True))]


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

    def __init__(self, prompts_per_batch: int, refill: bool = False) -> None:
        self.prompts_per_batch = prompts_per_batch
        self.refill = refill
        """Dynamic sampling: a batch is the next B informative groups (module docstring)."""
        self.cursor = 0
        """Refill: the first issue number no batch has taken (the trainer sets it on resume)."""
        self.lost: set[int] = set()
        """Refill: issue numbers that will never arrive (a quarantined shard)."""
        self.last_drawn = self.last_dropped = 0
        """Refill: groups the last batch took from the stream, and of those dropped."""
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
        first = self.cursor if self.refill else step * self.prompts_per_batch
        for index, rows in by_index.items():
            if index < first:
                warnings.append(f"{group_key(index)} in {ref.name} was trained before; skipped")
            elif index in self._groups:
                warnings.append(
                    f"{group_key(index)} in {ref.name} duplicates one from "
                    f"{self._shard_of[index]}; skipped"
                )
            else:
                self._groups[index] = table.take(in_sample_order(table, rows))
                self._shard_of[index] = ref.name
                kept.add(index)
        if kept:
            self._open[ref.name] = kept
            self._refs[ref.name] = ref
        else:
            self._done.append(ref)
        return warnings

    def missing(self, step: int) -> list[int]:
        """The issue numbers batch `step` still waits for (refill: the next one it needs,
        while it has fewer than B informative groups)."""
        if self.refill:
            taken, complete = self._refill_plan()
            return [] if complete else [self.cursor + len(taken)]
        return [i for i in self.indices(step) if i not in self._groups]

    def drawn(self) -> int:
        """Refill: issue numbers the batch being built has taken so far (lost included)."""
        return len(self._refill_plan()[0])

    def _refill_plan(self) -> tuple[list[int], bool]:
        """The issue numbers from the cursor the next batch takes, and whether they hold
        B informative groups (lost numbers are passed over)."""
        taken: list[int] = []
        found = 0
        index = self.cursor
        while found < self.prompts_per_batch:
            if index not in self.lost:
                table = self._groups.get(index)
                if table is None:
                    return taken, False
                found += informative(table.column("reward").to_pylist())
            taken.append(index)
            index += 1
        return taken, True

    def take(self, step: int) -> tuple[pa.Table | None, list[ShardT]]:
        """Batch `step` (the groups present, in issue order, each group's responses in
        sample order) and the shards it completes.

        Refill: the informative groups of the numbers from the cursor up to the B-th
        informative one; the uninformative ones among them are dropped (`last_dropped`)
        and their shards handed back as done once whole."""
        numbers = self._refill_plan()[0] if self.refill else list(self.indices(step))
        if self.refill:
            self.cursor = numbers[-1] + 1 if numbers else self.cursor
            self.lost -= set(numbers)
            self.last_drawn, self.last_dropped = len(numbers), 0
        tables = []
        for index in numbers:
            table = self._groups.pop(index, None)
            if table is None:
                continue
            if self.refill and not informative(table.column("reward").to_pylist()):
                self.last_dropped += 1
            else:
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
