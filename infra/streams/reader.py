"""``StreamReader``: one consumer's exactly-once, oldest-first view of a stream.

``poll`` offers committed shards that the consumer's ledger does not hold (invariant 2);
shard names start with the commit time, so sorted names are commit order (invariant 3).
The clock is the committing writer's wall clock, so writers on different machines are
ordered only as well as their clocks agree; exactly-once does not depend on it (late
shards with older names are still offered, first in line). A shard that cannot be parsed,
lacks the core columns, has a wrong schema version or belongs to another stream is moved
to ``{prefix}/_quarantine/`` with a logged reason (invariant 4): ``read`` raises
``CorruptShardError`` and the caller moves on to the next shard. A shard listed and
then deleted outside Sluice before it was read is skipped the same way, with a reason
file in quarantine standing in for it.

A consumer that crashes between ``read`` and ``ack`` is offered the shard again after
restart; see ``sluice.infra.streams.ledger`` for how acks are kept.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from sluice.infra.streams.errors import CorruptShardError, StreamConfigError, StreamStorageError
from sluice.infra.streams.ledger import AckRecord, Ledger
from sluice.infra.streams.names import (
    LEDGER_DIR,
    QUARANTINE_DIR,
    ShardRef,
    check_name,
    is_shard_name,
    names_of,
    tag_of,
)
from sluice.infra.streams.prefix import StreamPrefix
from sluice.infra.streams.schema import trajectory_schema, upgrade_table, validate_table

logger = logging.getLogger(__name__)

REASON_SUFFIX = ".reason.txt"
"""Beside each quarantined shard (or alone, for a shard deleted outside Sluice): why."""


@dataclass
class ReadBatch:
    """Whole shards read together by ``StreamReader.read_next``."""

    table: pa.Table
    """All rows of the shards in ``refs``, in commit order (empty when none was ready)."""
    refs: list[ShardRef]
    """The shards read; ack them once their effect is durable."""
    quarantined: list[CorruptShardError] = field(default_factory=list)
    """Shards met on the way that were corrupt and have been moved out of the stream."""

    @property
    def num_groups(self) -> int:
        """Prompt groups in the batch."""
        return sum(ref.num_groups for ref in self.refs)


class StreamReader:
    """One consumer's exactly-once view of a stream.

    ``poll`` offers committed shards that are neither acked nor already read by this
    reader, oldest first; ``read`` returns a shard's table; ``ack`` records durably that the
    consumer is done with shards. After a crash, a new reader with the same ``consumer``
    name offers every shard that was read but not acked, and never one that was acked.
    One live reader per (stream, consumer); different consumers each see every shard.
    """

    def __init__(
        self,
        url: str,
        run: str,
        stream: str,
        consumer: str,
        storage_options: Mapping[str, Any] | None = None,
        compact_after_entries: int = 64,
    ) -> None:
        """Open the stream and load the consumer's ledger once.

        ``compact_after_entries``: ledger files allowed before they are merged into one
        (each ack is one small file; fewer files make the next restart cheaper).
        """
        if compact_after_entries < 2:
            raise StreamConfigError(
                f"compact_after_entries must be >= 2, got {compact_after_entries}"
            )
        self.consumer = check_name("consumer", consumer)
        self.stream = stream
        self.compact_after_entries = compact_after_entries
        self._storage = StreamPrefix(url, run, stream, storage_options)
        self._storage.probe(create=False)
        self._quarantine_dir = f"{self._storage.prefix}/{QUARANTINE_DIR}"
        self._ledger = Ledger(
            self._storage, f"{self._storage.prefix}/{LEDGER_DIR}/{consumer}", consumer
        )
        self._in_flight: dict[str, ShardRef] = {}
        self._bad: set[str] = set()
        self._warned_names: set[str] = set()
        # Shard names are immutable: parse each once, not on every poll. A long run's
        # stream holds thousands of shards and a poller lists it every few tens of ms.
        self._parsed: dict[str, ShardRef] = {}
        self._ledger.load()

    @property
    def prefix_url(self) -> str:
        """URL of the stream prefix."""
        return self._storage.prefix_url

    # ---------------------------------------------------------------- listing

    def committed(self) -> list[ShardRef]:
        """Every shard committed to the stream and still in it, oldest first (fresh listing)."""
        refs = []
        for name in self._storage.list_names(self._storage.prefix):
            ref = self._parsed.get(name)
            if ref is None:
                if not is_shard_name(name):
                    self._warn_foreign_name(name)
                    continue
                ref = ShardRef.from_url(self._storage.url_of(f"{self._storage.prefix}/{name}"))
                self._parsed[name] = ref
            refs.append(ref)
        refs.sort()
        return refs

    def poll(self) -> list[ShardRef]:
        """Committed shards not yet acked and not read by this reader, oldest first."""
        # Membership tests, not a set union: poll stays O(listing) however long the ledger.
        return [
            ref
            for ref in self.committed()
            if ref.name not in self._ledger.acked
            and ref.name not in self._in_flight
            and ref.name not in self._bad
        ]

    def _warn_foreign_name(self, name: str) -> None:
        if name.startswith((".", "_")) or name in self._warned_names:
            return
        self._warned_names.add(name)
        logger.warning(
            "ignoring %s in stream %s: not a Sluice shard name", name, self._storage.prefix_url
        )

    # ---------------------------------------------------------------- reading

    def read(self, ref: ShardRef) -> pa.Table:
        """The shard's rows, validated; the shard is then pending until acked or released.

        Raises ``CorruptShardError`` (shard moved to ``_quarantine/``, or gone: continue
        with the next one) or ``StreamStorageError`` (storage trouble: nothing moved,
        retry later).
        """
        path = f"{self._storage.prefix}/{ref.name}"
        try:
            buffer = self._storage.read_buffer(path)
        except FileNotFoundError as error:
            quarantined = f"{self._quarantine_dir}/{ref.name}"
            if self._storage.exists(quarantined):
                self._bad.add(ref.name)
                raise CorruptShardError(
                    ref, "already quarantined", self._storage.url_of(quarantined)
                ) from error
            raise self._vanished(ref) from error
        try:
            table = pa.ipc.open_file(buffer).read_all()
            table.validate(full=True)
            validate_table(table, stream=self.stream)
            table = upgrade_table(table)
        except Exception as error:  # noqa: BLE001 - any failure to decode bytes in hand is content
            reason = f"{type(error).__name__}: {error}"
            raise self._quarantine(ref, reason) from error
        if ref.name not in self._ledger.acked:
            self._in_flight[ref.name] = ref
        return table

    def _quarantine(self, ref: ShardRef, reason: str) -> CorruptShardError:
        source = f"{self._storage.prefix}/{ref.name}"
        destination = f"{self._quarantine_dir}/{ref.name}"
        self._bad.add(ref.name)
        try:
            self._storage.move(source, destination)
        except (StreamStorageError, FileNotFoundError) as error:
            logger.error(
                "corrupt shard %s (%s) could not be quarantined: %s", ref.url, reason, error
            )
            return CorruptShardError(ref, reason, None)
        with contextlib.suppress(StreamStorageError):
            self._storage.put_atomic(f"{destination}{REASON_SUFFIX}", reason.encode())
        quarantine_url = self._storage.url_of(destination)
        logger.error(
            "quarantined corrupt shard %s of stream %s: %s -> %s",
            ref.name,
            self._storage.prefix_url,
            reason,
            quarantine_url,
        )
        return CorruptShardError(ref, reason, quarantine_url)

    def _vanished(self, ref: ShardRef) -> CorruptShardError:
        """A shard listed, then gone before it was read: deleted outside Sluice.

        Treated like a corrupt one (its groups are lost, the stream goes on), with a
        reason file in quarantine standing in for it, so every consumer and the trainer
        waiting on its groups learn the same (`quarantined_tags`).
        """
        reason = "listed, then deleted outside Sluice before it was read"
        self._bad.add(ref.name)
        note = f"{self._quarantine_dir}/{ref.name}{REASON_SUFFIX}"
        with contextlib.suppress(StreamStorageError):
            self._storage.put_atomic(note, reason.encode())
        logger.error("shard %s of stream %s: %s", ref.name, self._storage.prefix_url, reason)
        return CorruptShardError(ref, reason, None)

    def read_next(self, max_groups: int | None = None, max_shards: int | None = None) -> ReadBatch:
        """Read the oldest unread shards, whole, as one table.

        Stops before a shard would take the batch past ``max_groups`` (but always reads at
        least one shard when any is ready) or past ``max_shards``. Corrupt shards on the way
        are quarantined and reported in ``quarantined``; the batch goes on without them.
        """
        if max_groups is not None and max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        if max_shards is not None and max_shards < 1:
            raise ValueError(f"max_shards must be >= 1, got {max_shards}")
        tables: list[pa.Table] = []
        refs: list[ShardRef] = []
        quarantined: list[CorruptShardError] = []
        groups = 0
        for ref in self.poll():
            if max_shards is not None and len(refs) >= max_shards:
                break
            if max_groups is not None and refs and groups + ref.num_groups > max_groups:
                break
            try:
                tables.append(self.read(ref))
            except CorruptShardError as error:
                quarantined.append(error)
                continue
            refs.append(ref)
            groups += ref.num_groups
        if tables:
            table = pa.concat_tables(tables, promote_options="permissive")
        else:
            table = trajectory_schema(self.stream).empty_table()
        return ReadBatch(table=table, refs=refs, quarantined=quarantined)

    def quarantined_tags(self) -> set[str]:
        """Name tags of the shards moved to quarantine or found deleted (one listing;
        compare `shard_key_tag`)."""
        names = (
            name.removesuffix(REASON_SUFFIX)
            for name in self._storage.list_names(self._quarantine_dir)
        )
        tags = (tag_of(name) for name in names)
        return {tag for tag in tags if tag is not None}

    def pending(self) -> list[ShardRef]:
        """Shards read by this reader and not yet acked, oldest first."""
        return sorted(self._in_flight.values())

    def release(self, refs: Iterable[ShardRef | str]) -> None:
        """Give read-but-unacked shards back, so the next ``poll`` offers them again."""
        for name in names_of(refs):
            self._in_flight.pop(name, None)

    # ---------------------------------------------------------------- ledger

    def acked(self) -> set[str]:
        """Names of every shard this consumer has acked (in memory, no storage call)."""
        return set(self._ledger.acked)

    def is_acked(self, ref: ShardRef | str) -> bool:
        """Whether this consumer has acked the shard."""
        return (ref.name if isinstance(ref, ShardRef) else ref) in self._ledger.acked

    def records(self) -> list[AckRecord]:
        """The ledger, oldest ack first: which shards were acked together, with their meta."""
        return list(self._ledger.records)

    def ack(self, refs: Iterable[ShardRef | str], meta: Mapping[str, Any] | None = None) -> None:
        """Record durably that this consumer is done with ``refs``.

        One atomic ledger write for all of them; shards already acked are skipped, and a
        call with nothing new writes nothing. ``meta`` must be JSON-serialisable
        (``ValueError`` otherwise, before anything is written).
        """
        names = list(dict.fromkeys(names_of(refs)))
        for name in names:
            if not is_shard_name(name):
                raise ValueError(f"cannot ack {name!r}: not a Sluice shard name")
        new = self._ledger.append(names, meta)
        if not new:
            return
        for name in new:
            self._in_flight.pop(name, None)
        if len(self._ledger.files) > self.compact_after_entries:
            self.compact_ledger()

    def compact_ledger(self) -> None:
        """Merge this consumer's ledger files into one.

        The merged file is committed before the old ones are deleted, so a crash in between
        leaves duplicated records (deduplicated by id on load), never a lost ack.
        """
        superseded = self._ledger.compact()
        if superseded:
            self._delete_ledger_files(superseded)

    def _delete_ledger_files(self, paths: list[str]) -> None:
        # Superseded by a committed compact file; tests override this to crash half-way.
        self._ledger.delete(paths)
