"""A consumer's durable ledger: which shards it is done with (invariant 2, exactly once).

The ledger of consumer ``c`` lives in ``{prefix}/_ledger/{c}/`` as small JSON files, one
per ``ack``, each committed with one atomic put. It is loaded once when a reader opens and
kept in memory. Compaction merges the files into one: the merged file is committed before
the old ones are deleted, so a crash in between leaves duplicated records (deduplicated by
id on load), never a lost ack.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.infra.streams.errors import StreamError, StreamStorageError
from sluice.infra.streams.prefix import StreamPrefix

logger = logging.getLogger(__name__)

_LEDGER_FORMAT = 1


@dataclass(frozen=True)
class AckRecord:
    """One ``ack`` call as stored in a consumer's ledger."""

    record_id: str
    """Unique id; compaction may briefly leave two copies of a record, this dedupes them."""
    shards: tuple[str, ...]
    """Shard names acknowledged together, in the order given."""
    meta: dict[str, Any]
    """Caller metadata stored with the ack (e.g. policy version, trainer step)."""
    acked_at_ns: int
    """Wall-clock time of the ack, ns since the epoch."""


class Ledger:
    """The ledger files of one consumer and the acks they hold, loaded once."""

    def __init__(self, storage: StreamPrefix, directory: str, consumer: str) -> None:
        self._storage = storage
        self.directory = directory
        self.consumer = consumer
        self.acked: set[str] = set()
        """Every shard name acked so far."""
        self.records: list[AckRecord] = []
        """Acks in the order they were made."""
        self.files: list[str] = []
        """Ledger files that hold ``records``."""

    def load(self) -> None:
        """Read every ledger file; StreamError naming the file when one is unreadable."""
        names = sorted(
            name for name in self._storage.list_names(self.directory) if name.endswith(".json")
        )
        paths = [f"{self.directory}/{name}" for name in names]
        contents = self._storage.cat_many(paths)
        seen: set[str] = set()
        records: list[AckRecord] = []
        for path in paths:
            try:
                file_records = _decode(contents[path])
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                # Guessing here would re-deliver or drop shards: stop with the file's name.
                raise StreamError(
                    f"ledger file {self._storage.url_of(path)} of consumer {self.consumer!r} "
                    f"is unreadable ({error}); fix or remove it before resuming"
                ) from error
            for record in file_records:
                if record.record_id not in seen:
                    seen.add(record.record_id)
                    records.append(record)
        records.sort(key=lambda record: (record.acked_at_ns, record.record_id))
        self.records = records
        self.acked = {name for record in records for name in record.shards}
        self.files = paths

    def append(self, names: Sequence[str], meta: Mapping[str, Any] | None) -> list[str]:
        """Commit one record of the names not acked yet; return them (nothing new: no write).

        ``meta`` must be JSON-serialisable (``ValueError`` otherwise, before any write).
        """
        new = [name for name in dict.fromkeys(names) if name not in self.acked]
        if not new:
            return []
        record = AckRecord(
            record_id=uuid.uuid4().hex,
            shards=tuple(new),
            meta=dict(meta or {}),
            acked_at_ns=time.time_ns(),
        )
        payload = _encode([record], what=f"ack meta {meta!r}")
        path = f"{self.directory}/{record.acked_at_ns:020d}-{record.record_id[:12]}.json"
        self._storage.put_atomic(path, payload)
        self.acked.update(new)
        self.records.append(record)
        self.files.append(path)
        return new

    def compact(self) -> list[str]:
        """Commit every record as one file; return the files it supersedes (to delete)."""
        if len(self.files) < 2:
            return []
        path = f"{self.directory}/{time.time_ns():020d}-{uuid.uuid4().hex[:12]}-compact.json"
        self._storage.put_atomic(path, _encode(self.records, what="ledger"))
        old, self.files = self.files, [path]
        return old

    def delete(self, paths: list[str]) -> None:
        """Delete superseded ledger files; one left behind is only a duplicate, so warn."""
        for stale in paths:
            try:
                self._storage.remove(stale)
            except (StreamStorageError, FileNotFoundError) as error:
                logger.warning("ledger compaction left %s behind: %s", stale, error)


def _decode(data: bytes) -> list[AckRecord]:
    decoded = json.loads(data)
    if decoded.get("format") != _LEDGER_FORMAT:
        raise ValueError(f"unknown ledger format {decoded.get('format')!r}")
    return [
        AckRecord(
            record_id=str(item["record_id"]),
            shards=tuple(str(name) for name in item["shards"]),
            meta=dict(item["meta"]),
            acked_at_ns=int(item["acked_at_ns"]),
        )
        for item in decoded["records"]
    ]


def _encode(records: Sequence[AckRecord], *, what: str) -> bytes:
    try:
        return json.dumps(
            {"format": _LEDGER_FORMAT, "records": [dataclasses.asdict(r) for r in records]},
            allow_nan=False,
        ).encode()
    except (TypeError, ValueError) as error:
        raise ValueError(f"{what} is not JSON-serialisable: {error}") from error
