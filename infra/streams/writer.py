"""``StreamWriter``: commits immutable trajectory shards, each visible all at once or not at all.

Invariant 1 (atomic visibility) is ``sluice.infra.storage.put_atomic``: on local disks a shard
is written to a hidden temp file in the stream directory, fsynced and renamed into place;
on object stores the whole shard goes up as a single PUT. A writer that dies mid-commit
leaves at most a temp file, which no reader lists and the next writer sweeps.

A write with ``shard_key`` is idempotent: a consumer whose output is itself a shard passes
the input shard's name, so output re-processed after a crash replaces nothing and
duplicates nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sluice.infra.streams.errors import StreamConfigError
from sluice.infra.streams.names import (
    ShardRef,
    check_name,
    sequence_tag,
    shard_key_tag,
    shard_name,
    tag_of,
)
from sluice.infra.streams.prefix import StreamPrefix
from sluice.infra.streams.schema import conform_table

logger = logging.getLogger(__name__)


class StreamWriter:
    """Commits immutable trajectory shards to one stream.

    Several writers may share a stream; each needs its own ``writer_id``. A writer object is
    not thread-safe.
    """

    def __init__(
        self,
        url: str,
        run: str,
        stream: str,
        writer_id: str,
        storage_options: Mapping[str, Any] | None = None,
        compression: str | None = None,
    ) -> None:
        """Open (and on local disks create) ``{url}/{run}/{stream}/`` for writing.

        ``compression`` is None (readers get zero-copy views) or ``"zstd"`` (smaller shards,
        one decode per read). Raises ``StreamConfigError`` for a bad URL or name and
        ``StreamStorageError`` when the storage cannot be reached.
        """
        if compression not in (None, "zstd"):
            raise StreamConfigError(f"compression must be None or 'zstd', got {compression!r}")
        self.writer_id = check_name("writer_id", writer_id)
        self.compression = compression
        self._storage = StreamPrefix(url, run, stream, storage_options)
        self.stream = stream
        self._storage.probe(create=True)
        self._sequence = 0
        self._last_commit_ns = 0
        # tag -> committed name for keyed shards; listed once, lazily, then kept current.
        self._keyed: dict[str, str] | None = None
        self._storage.sweep_stale_temps()

    @property
    def prefix_url(self) -> str:
        """URL of the stream prefix."""
        return self._storage.prefix_url

    def write(self, table: pa.Table, *, shard_key: str | None = None) -> ShardRef:
        """Commit ``table`` as one shard and return its ref.

        The table is validated and conformed first (``SchemaError``, nothing written). With
        ``shard_key`` the commit is idempotent: if a shard with that key already exists in
        the stream (committed by any writer, e.g. this consumer before a crash), its ref is
        returned and nothing is written. Keys are meant for sequential retries of one
        logical shard, not for racing writers.
        """
        conformed = conform_table(table, stream=self.stream, writer_id=self.writer_id)
        if shard_key is not None:
            if not isinstance(shard_key, str) or not shard_key:
                raise StreamConfigError(f"shard_key must be a non-empty string, got {shard_key!r}")
            tag = shard_key_tag(shard_key)
            existing = self._keyed_names().get(tag)
            if existing is not None:
                logger.info("shard with key %r already committed as %s", shard_key, existing)
                return ShardRef.from_url(self._storage.url_of(f"{self._storage.prefix}/{existing}"))
        else:
            tag = sequence_tag(self._sequence)
        data = _serialize(conformed, self.compression)
        # The time is taken after encoding, just before the commit, so names track commits.
        commit_ns = max(time.time_ns(), self._last_commit_ns + 1)
        num_groups = _count_groups(conformed)
        name = shard_name(commit_ns, self.writer_id, tag, num_groups, conformed.num_rows)
        path = f"{self._storage.prefix}/{name}"
        self._commit_bytes(path, data)
        self._last_commit_ns = commit_ns
        if shard_key is None:
            self._sequence += 1
        elif self._keyed is not None:
            self._keyed[tag] = name
        return ShardRef(
            name=name,
            url=self._storage.url_of(path),
            commit_time_ns=commit_ns,
            writer_id=self.writer_id,
            num_groups=num_groups,
            num_rows=conformed.num_rows,
            size_bytes=len(data),
        )

    def _commit_bytes(self, path: str, data: bytes) -> None:
        # The single step that makes a shard visible; tests override it to inject crashes.
        self._storage.put_atomic(path, data)

    def _keyed_names(self) -> dict[str, str]:
        if self._keyed is None:
            self._keyed = {}
            for name in self._storage.list_names(self._storage.prefix):
                tag = tag_of(name)
                if tag is not None and tag.startswith("k"):
                    self._keyed[tag] = name
        return self._keyed


def _serialize(table: pa.Table, compression: str | None) -> bytes:
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_file(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _count_groups(table: pa.Table) -> int:
    return int(pc.count_distinct(table.column("group_id")).as_py())
