"""Trajectory streams: immutable Arrow IPC shards on fsspec storage (DESIGN.md section 3).

Every arrow between Sluice tasks (rollout -> reward -> train) is a *stream*: the prefix
``{root}/{run}/{stream}/`` holding immutable Arrow IPC files ("shards"), each with one or
more whole prompt groups. Writers commit shards; each consumer keeps its own durable ledger
of the shards it has finished with. The four invariants of the contract map to code here:

1. Atomic visibility. On local disks a shard is written to a hidden temp file in the stream
   directory, fsynced and renamed into place; on object stores the whole shard goes up as a
   single PUT (``fs.pipe_file``). Streaming writes through ``fs.open(..., "wb")`` are never
   used: an exception inside such a block still completes a partial S3 object.
2. Exactly-once consumption. ``StreamReader.poll`` offers committed shards that the
   consumer's ledger does not hold; ``ack`` appends one small JSON entry (single PUT or
   rename) to ``{prefix}/_ledger/{consumer}/``. The ledger is loaded once per reader and kept
   in memory. A consumer that crashes between ``read`` and ``ack`` is offered the shard again
   after restart; a consumer whose output is itself a shard passes ``shard_key`` so that the
   re-processed output replaces nothing and duplicates nothing.
3. Oldest first. Shard names start with the zero-padded commit time in nanoseconds, so a
   listing sorted by name is commit order. Departure from a single-log design: the clock is
   the committing writer's wall clock, so writers on different machines are ordered only as
   well as their clocks agree; exactly-once does not depend on it (late shards with older
   names are still offered, first in line).
4. Self-describing. The Arrow schema carries ``sluice.schema_version`` and ``sluice.stream``
   in its metadata; a shard that cannot be parsed, lacks the core columns, has a wrong
   version or belongs to another stream is moved to ``{prefix}/_quarantine/`` with a logged
   reason, ``read`` raises ``CorruptShardError`` and the caller moves on to the next shard.

A shard name also carries its group and row counts
(``{commit_ns:020d}-{writer_id}-{tag}-g{groups}-r{rows}.arrow``), so a trainer can tell from
one listing whether a batch is ready without opening a single shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

logger = logging.getLogger(__name__)

SCHEMA_VERSION = "1"
"""Version of the trajectory row layout; bump it when a core column changes meaning or type."""
SCHEMA_VERSION_KEY = b"sluice.schema_version"
STREAM_KEY = b"sluice.stream"
WRITER_KEY = b"sluice.writer_id"

SHARD_SUFFIX = ".arrow"
QUARANTINE_DIR = "_quarantine"
LEDGER_DIR = "_ledger"
# Temp files start with a dot so no listing filter, human or code, mistakes them for shards.
TEMP_PREFIX = ".tmp-"
STALE_TEMP_AGE_S = 3600.0

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("behaviour_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("token_versions", pa.list_(pa.int32()), nullable=False),
        pa.field("version_start", pa.int32(), nullable=False),
        pa.field("version_end", pa.int32(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        # Null until the reward task has scored the response.
        pa.field("reward", pa.float32(), nullable=True),
        pa.field("task", pa.string(), nullable=False),
        pa.field("worker", pa.string(), nullable=False),
        pa.field("created_at", pa.timestamp("ms", tz="UTC"), nullable=False),
    ],
    metadata={SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode()},
)
"""Core columns of a trajectory row (one sampled response). Extra columns pass through."""

CORE_COLUMNS: tuple[str, ...] = tuple(TRAJECTORY_SCHEMA.names)
# Per-token columns of one response: equal length in every row, or the trainer misaligns them.
PER_TOKEN_COLUMNS: tuple[str, ...] = ("response_token_ids", "behaviour_logprobs", "token_versions")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Greedy writer id: the tag, group and row fields are always the last three.
_SHARD_RE = re.compile(
    r"^(?P<ns>\d{20})-(?P<writer>[A-Za-z0-9][A-Za-z0-9._-]*)-(?P<tag>s\d{8,}|k[0-9a-f]{20})"
    r"-g(?P<groups>\d+)-r(?P<rows>\d+)\.arrow$"
)
_LEDGER_FORMAT = 1


# --------------------------------------------------------------------------- errors


class StreamError(Exception):
    """Base class of every error raised by Sluice streams."""


class StreamConfigError(StreamError, ValueError):
    """A stream URL, name or option that cannot work (unknown protocol, bad run name, ...)."""


class StreamStorageError(StreamError, OSError):
    """The storage behind a stream could not be reached or refused an operation."""


class SchemaError(StreamError, ValueError):
    """A table that does not satisfy the trajectory schema; nothing was written."""


class CorruptShardError(StreamError):
    """A committed shard that cannot be used; it has been moved out of the stream.

    The stream goes on: callers log it and continue with the next shard.
    """

    def __init__(self, ref: ShardRef, reason: str, quarantine_url: str | None) -> None:
        where = f"moved to {quarantine_url}" if quarantine_url else "could not be moved"
        super().__init__(f"corrupt shard {ref.url}: {reason} ({where})")
        self.ref = ref
        """The shard that was quarantined."""
        self.reason = reason
        """Why it could not be used."""
        self.quarantine_url = quarantine_url
        """Where it now lives, or None when the move itself failed."""


# --------------------------------------------------------------------------- schema


def trajectory_schema(stream: str, extra_fields: Iterable[pa.Field] = ()) -> pa.Schema:
    """The trajectory schema stamped with its version and the stream name, plus extras."""
    metadata = {SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode(), STREAM_KEY: stream.encode()}
    return pa.schema([*TRAJECTORY_SCHEMA, *extra_fields], metadata=metadata)


def _schema_problems(schema: pa.Schema) -> list[str]:
    problems = []
    for core in TRAJECTORY_SCHEMA:
        index = schema.get_field_index(core.name)
        if index < 0:
            problems.append(f"missing core column {core.name!r} ({core.type})")
        elif not schema.field(index).type.equals(core.type):
            problems.append(
                f"column {core.name!r} has type {schema.field(index).type}, expected {core.type}"
            )
    return problems


def _row_problems(table: pa.Table) -> list[str]:
    problems = []
    for core in TRAJECTORY_SCHEMA:
        if not core.nullable and table.column(core.name).null_count:
            problems.append(f"column {core.name!r} has {table.column(core.name).null_count} nulls")
    if problems:
        return problems
    lengths = [pc.list_value_length(table.column(name)) for name in PER_TOKEN_COLUMNS]
    for name, length in zip(PER_TOKEN_COLUMNS[1:], lengths[1:], strict=True):
        mismatch = pc.not_equal(lengths[0], length)
        if pc.any(mismatch).as_py():
            row = int(pc.index(mismatch, True).as_py())
            problems.append(
                f"row {row}: {name!r} has {length[row].as_py()} entries but "
                f"'response_token_ids' has {lengths[0][row].as_py()}"
            )
    backwards = pc.greater(table.column("version_start"), table.column("version_end"))
    if pc.any(backwards).as_py():
        row = int(pc.index(backwards, True).as_py())
        problems.append(f"row {row}: version_start > version_end")
    return problems


def validate_table(table: pa.Table, *, stream: str | None = None) -> None:
    """Raise ``SchemaError`` unless ``table`` holds valid trajectory rows.

    Checks the core columns and their exact types (extras are allowed), nulls in
    non-nullable core columns, equal per-token lengths and version order. With ``stream``
    the schema metadata must also carry this Sluice's schema version and that stream name.
    """
    if not isinstance(table, pa.Table):
        raise SchemaError(f"expected a pyarrow.Table, got {type(table).__name__}")
    problems = []
    if stream is not None:
        metadata = table.schema.metadata or {}
        version = metadata.get(SCHEMA_VERSION_KEY)
        if version is None:
            problems.append("schema metadata has no sluice.schema_version (not a Sluice shard)")
        elif version.decode(errors="replace") != SCHEMA_VERSION:
            problems.append(
                f"schema version {version.decode(errors='replace')!r}, "
                f"this Sluice reads {SCHEMA_VERSION!r}"
            )
        shard_stream = metadata.get(STREAM_KEY, b"").decode(errors="replace")
        if version is not None and shard_stream != stream:
            problems.append(f"shard belongs to stream {shard_stream!r}, not {stream!r}")
    problems += _schema_problems(table.schema)
    if not problems:
        problems += _row_problems(table)
    if problems:
        raise SchemaError("; ".join(problems))


def conform_table(table: pa.Table, *, stream: str, writer_id: str | None = None) -> pa.Table:
    """Return ``table`` ready to commit: core columns cast to their schema types and
    moved first, extras kept in order, one record batch, metadata stamped.

    Casts are safe casts (int64 token ids that fit int32 pass, overflow fails); any
    problem raises ``SchemaError`` naming the column.
    """
    if not isinstance(table, pa.Table):
        raise SchemaError(f"expected a pyarrow.Table, got {type(table).__name__}")
    if table.num_rows == 0:
        raise SchemaError("refusing to commit an empty shard (0 rows)")
    present = table.column_names
    missing = [name for name in CORE_COLUMNS if name not in present]
    if missing:
        raise SchemaError(f"table is missing core columns {missing}")
    duplicated = {name for name in present if present.count(name) > 1}
    if duplicated:
        raise SchemaError(f"table has duplicated columns {sorted(duplicated)}")
    columns: list[pa.ChunkedArray] = []
    fields: list[pa.Field] = []
    for core in TRAJECTORY_SCHEMA:
        column = table.column(core.name)
        if not column.type.equals(core.type):
            try:
                column = column.cast(core.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as error:
                raise SchemaError(
                    f"column {core.name!r} has type {table.column(core.name).type} and cannot "
                    f"be cast to {core.type}: {error}"
                ) from error
        columns.append(column)
        fields.append(core)
    for extra in table.schema:
        if extra.name not in CORE_COLUMNS:
            columns.append(table.column(extra.name))
            fields.append(extra)
    metadata = {
        key: value
        for key, value in (table.schema.metadata or {}).items()
        if not key.startswith(b"sluice.")
    }
    metadata[SCHEMA_VERSION_KEY] = SCHEMA_VERSION.encode()
    metadata[STREAM_KEY] = stream.encode()
    if writer_id is not None:
        metadata[WRITER_KEY] = writer_id.encode()
    conformed = pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=metadata))
    # One record batch per shard: readers then get single-chunk columns and zero-copy views.
    conformed = conformed.combine_chunks()
    problems = _row_problems(conformed)
    if problems:
        raise SchemaError("; ".join(problems))
    return conformed


class FlatList(NamedTuple):
    """A list column as one flat values array plus offsets: row i is values[offsets[i]:offsets[i+1]].

    ``offsets[0]`` need not be 0 (a sliced column keeps indexing into the full values).
    Arrays returned by ``flat_list_column`` are read-only views over Arrow buffers.
    """

    values: np.ndarray
    """All list elements of all rows, concatenated."""
    offsets: np.ndarray
    """int32 positions into ``values``, one more than the number of rows."""


def flat_list_column(table: pa.Table, column: str = "response_token_ids") -> FlatList:
    """Flat values and offsets of a list column, without copying when it is one chunk.

    Shards committed by ``StreamWriter`` are a single record batch, so for an uncompressed
    shard the arrays are views into the shard's bytes (memory-mapped on local disks).
    """
    if column not in table.column_names:
        raise ValueError(f"table has no column {column!r}")
    chunked = table.column(column)
    if not pa.types.is_list(chunked.type):
        raise ValueError(f"column {column!r} has type {chunked.type}, expected a list<...>")
    # Several chunks cannot share one offsets array: concatenating copies, once.
    array = chunked.chunk(0) if chunked.num_chunks == 1 else chunked.combine_chunks()
    if array.values.null_count:
        raise ValueError(f"column {column!r} has null list elements; no flat numpy view exists")
    return FlatList(
        values=array.values.to_numpy(zero_copy_only=True),
        offsets=array.offsets.to_numpy(zero_copy_only=True),
    )


_DERIVABLE = {"reward", "created_at", "version_start", "version_end"}


def _now_ms_utc() -> np.datetime64:
    return np.datetime64(time.time_ns() // 1_000_000, "ms")


def _versions_from_tokens(token_versions: pa.Array) -> tuple[pa.Array, pa.Array]:
    flat = flat_list_column(pa.table({"token_versions": token_versions}), "token_versions")
    lengths = np.diff(flat.offsets)
    if (lengths == 0).any():
        row = int(np.argmax(lengths == 0))
        raise SchemaError(
            f"row {row} has no token_versions: give version_start/version_end explicitly"
        )
    starts = flat.offsets[:-1] - flat.offsets[0]
    values = flat.values[flat.offsets[0] : flat.offsets[-1]]
    return (
        pa.array(np.minimum.reduceat(values, starts), type=pa.int32()),
        pa.array(np.maximum.reduceat(values, starts), type=pa.int32()),
    )


def _core_array(name: str, values: Any) -> pa.Array:
    target = TRAJECTORY_SCHEMA.field(name).type
    if isinstance(values, FlatList):
        try:
            return pa.ListArray.from_arrays(
                pa.array(values.offsets, type=pa.int32()),
                pa.array(values.values, type=target.value_type),
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as error:
            raise SchemaError(f"column {name!r}: bad values/offsets: {error}") from error
    try:
        return pa.array(values, type=target)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as error:
        raise SchemaError(f"column {name!r} cannot be stored as {target}: {error}") from error


def table_from_arrays(columns: Mapping[str, Any], *, stream: str | None = None) -> pa.Table:
    """Build a trajectory table from columns: numpy arrays, Python sequences, or for list
    columns either a sequence of per-row arrays or a ``FlatList(values, offsets)``.

    ``reward`` defaults to null, ``created_at`` to now, ``version_start``/``version_end``
    to the min/max of ``token_versions``. Other columns are extras and pass through.
    """
    missing = [name for name in CORE_COLUMNS if name not in columns and name not in _DERIVABLE]
    if missing:
        raise SchemaError(f"missing core columns {missing}")
    arrays: dict[str, pa.Array] = {}
    for name in CORE_COLUMNS:
        if name in columns:
            arrays[name] = _core_array(name, columns[name])
    lengths = {name: len(array) for name, array in arrays.items()}
    num_rows = lengths["sample_id"]
    wrong = {name: n for name, n in lengths.items() if n != num_rows}
    if wrong:
        raise SchemaError(f"columns have {wrong} rows but 'sample_id' has {num_rows}")
    if "reward" not in arrays:
        arrays["reward"] = pa.nulls(num_rows, type=pa.float32())
    if "created_at" not in arrays:
        arrays["created_at"] = pa.array(
            np.full(num_rows, _now_ms_utc()), type=pa.timestamp("ms", tz="UTC")
        )
    if "version_start" not in arrays or "version_end" not in arrays:
        start, end = _versions_from_tokens(arrays["token_versions"])
        arrays.setdefault("version_start", start)
        arrays.setdefault("version_end", end)
    fields = list(TRAJECTORY_SCHEMA)
    ordered = [arrays[name] for name in CORE_COLUMNS]
    for name, values in columns.items():
        if name in CORE_COLUMNS:
            continue
        try:
            extra = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as error:
            raise SchemaError(
                f"extra column {name!r} cannot be stored in Arrow: {error}"
            ) from error
        if len(extra) != num_rows:
            raise SchemaError(f"extra column {name!r} has {len(extra)} rows, expected {num_rows}")
        ordered.append(extra)
        fields.append(pa.field(name, extra.type))
    metadata = {SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode()}
    if stream is not None:
        metadata[STREAM_KEY] = stream.encode()
    table = pa.Table.from_arrays(ordered, schema=pa.schema(fields, metadata=metadata))
    problems = _row_problems(table)
    if problems:
        raise SchemaError("; ".join(problems))
    return table


def table_from_rows(rows: Sequence[Mapping[str, Any]], *, stream: str | None = None) -> pa.Table:
    """Build a trajectory table from row dicts (one per sampled response).

    Defaults as in ``table_from_arrays``. A row that lacks a required core column raises
    ``SchemaError`` naming the row and column; a row that lacks an extra column gets null.
    """
    if not rows:
        raise SchemaError("table_from_rows needs at least one row")
    names: dict[str, None] = dict.fromkeys(CORE_COLUMNS)
    filled: list[Mapping[str, Any]] = []
    now = datetime.datetime.now(datetime.UTC)
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise SchemaError(f"row {index} is a {type(row).__name__}, expected a mapping")
        for name in CORE_COLUMNS:
            if name not in row and name not in _DERIVABLE:
                raise SchemaError(
                    f"row {index} (sample_id={row.get('sample_id')!r}) is missing core "
                    f"column {name!r}"
                )
        complete = dict(row)
        complete.setdefault("reward", None)
        complete.setdefault("created_at", now)
        if "version_start" not in row or "version_end" not in row:
            versions = list(row["token_versions"])
            if not versions:
                raise SchemaError(
                    f"row {index} (sample_id={row.get('sample_id')!r}) has no token_versions: "
                    "give version_start/version_end explicitly"
                )
            complete.setdefault("version_start", min(versions))
            complete.setdefault("version_end", max(versions))
        names.update(dict.fromkeys(row))
        filled.append(complete)
    columns = {name: [row.get(name) for row in filled] for name in names}
    return table_from_arrays(columns, stream=stream)


# --------------------------------------------------------------------------- shard refs


@dataclass(frozen=True, order=True)
class ShardRef:
    """A committed shard: small, serialisable, what tasks pass around instead of data.

    Refs sort by ``name``, which is commit order.
    """

    name: str
    """File name inside the stream prefix; unique, sorts in commit order."""
    url: str = field(compare=True)
    """Full fsspec URL of the shard."""
    commit_time_ns: int = field(compare=False)
    """Writer wall-clock time of the commit, ns since the epoch."""
    writer_id: str = field(compare=False)
    """Id of the writer that committed it."""
    num_groups: int = field(compare=False)
    """Distinct prompt groups in the shard."""
    num_rows: int = field(compare=False)
    """Rows (sampled responses) in the shard."""
    size_bytes: int | None = field(default=None, compare=False)
    """Encoded size, when known (the writer knows it; a listing does not fetch it)."""

    @classmethod
    def from_url(cls, url: str) -> ShardRef:
        """Parse a shard URL; raises ``StreamConfigError`` when the name is not a shard name."""
        name = url.rstrip("/").rsplit("/", 1)[-1]
        match = _SHARD_RE.match(name)
        if match is None:
            raise StreamConfigError(f"{url!r} is not a Sluice shard name")
        return cls(
            name=name,
            url=url,
            commit_time_ns=int(match["ns"]),
            writer_id=match["writer"],
            num_groups=int(match["groups"]),
            num_rows=int(match["rows"]),
        )

    @property
    def tag(self) -> str:
        """The name's tag: ``shard_key_tag(key)`` for a keyed write, a sequence otherwise."""
        match = _SHARD_RE.match(self.name)
        if match is None:  # only from_url builds refs from listings, and it checks the name
            raise StreamConfigError(f"{self.name!r} is not a Sluice shard name")
        return match["tag"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, for Prefect results and MLflow tags."""
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- storage


def _check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise StreamConfigError(
            f"{kind} {value!r} must be 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


class _Storage:
    """One stream prefix on one fsspec filesystem, with atomic puts and clear errors."""

    def __init__(
        self, url: str, run: str, stream: str, storage_options: Mapping[str, Any] | None
    ) -> None:
        if not isinstance(url, str) or not url:
            raise StreamConfigError(f"stream storage URL must be a non-empty string, got {url!r}")
        self.url = url
        self.run = _check_name("run", run)
        self.stream = _check_name("stream", stream)
        options = dict(storage_options or {})
        protocol = fsspec.utils.get_protocol(url)
        if protocol in ("s3", "s3a"):
            # A cached listing would hide newly committed shards from poll().
            options.setdefault("use_listings_cache", False)
        try:
            self.fs, root = url_to_fs(url, **options)
        except Exception as error:
            raise StreamConfigError(f"cannot open stream storage {url!r}: {error}") from error
        self.is_local = isinstance(self.fs, LocalFileSystem)
        root = root.rstrip("/")
        self.root = root
        self.prefix = f"{root}/{run}/{stream}" if root else f"{run}/{stream}"
        self.prefix_url = self.fs.unstrip_protocol(self.prefix)

    def url_of(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    @contextlib.contextmanager
    def guard(self, action: str, path: str) -> Iterator[None]:
        """Turn storage failures into one ``StreamStorageError`` naming the URL."""
        try:
            yield
        except (StreamError, FileNotFoundError):
            raise
        except Exception as error:
            raise StreamStorageError(
                f"cannot {action} {self.url_of(path)} (stream storage {self.url!r}): "
                f"{type(error).__name__}: {error}"
            ) from error

    def probe(self, create: bool) -> None:
        """Fail fast, naming the URL, when the storage is unreachable or the bucket missing."""
        if self.is_local:
            if create:
                with self.guard("create directory", self.prefix):
                    self.fs.makedirs(self.prefix, exist_ok=True)
            return
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol
        if "memory" in protocols:
            return  # in-process: nothing to reach
        bucket = self.root.split("/", 1)[0]
        if not bucket:
            raise StreamConfigError(f"stream storage URL {self.url!r} names no bucket")
        try:
            with self.guard("reach", bucket):
                self.fs.info(bucket)
        except FileNotFoundError as error:
            raise StreamStorageError(
                f"bucket {bucket!r} of stream storage {self.url!r} does not exist"
            ) from error

    def list_names(self, directory: str) -> list[str]:
        """Fresh listing of base names in ``directory``; a missing directory is empty."""
        with self.guard("list", directory):
            if isinstance(self.fs, LocalFileSystem):  # no per-entry stat: ~5x faster
                try:
                    return os.listdir(directory)
                except FileNotFoundError:
                    return []
            self.fs.invalidate_cache(directory)
            try:
                paths = self.fs.ls(directory, detail=False)
            except FileNotFoundError:
                return []
        return [str(path).rstrip("/").rsplit("/", 1)[-1] for path in paths]

    def put_atomic(self, path: str, data: bytes) -> None:
        """Make ``data`` visible at ``path`` all at once, or not at all."""
        try:
            if self.is_local:
                self._put_local(path, data)
                return
            with self.guard("write", path):
                # One PUT (or one multipart upload, completed only at the end) per object.
                self.fs.pipe_file(path, data)
        except FileNotFoundError as error:
            raise StreamStorageError(
                f"cannot write {self.url_of(path)} (stream storage {self.url!r}): {error}"
            ) from error

    def _put_local(self, path: str, data: bytes) -> None:
        directory = os.path.dirname(path)
        temp = os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}.part")
        with self.guard("write", path):
            os.makedirs(directory, exist_ok=True)
            try:
                with open(temp, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    # Durable before visible: a power cut must not expose an empty shard.
                    os.fsync(handle.fileno())
                os.replace(temp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                raise
            _fsync_directory(directory)

    def read_buffer(self, path: str) -> pa.Buffer:
        """The bytes at ``path`` as an Arrow buffer (memory-mapped on local disks)."""
        with self.guard("read", path):
            if self.is_local:
                if os.path.getsize(path) == 0:
                    return pa.py_buffer(b"")
                with pa.memory_map(path, "r") as mapped:
                    return mapped.read_buffer()
            return pa.py_buffer(self.fs.cat_file(path))

    def exists(self, path: str) -> bool:
        with self.guard("check", path):
            self.fs.invalidate_cache(path)
            return bool(self.fs.exists(path))

    def move(self, source: str, destination: str) -> None:
        with self.guard("move", source):
            if self.is_local:
                os.makedirs(os.path.dirname(destination), exist_ok=True)
                os.replace(source, destination)
            else:
                self.fs.mv(source, destination)

    def remove(self, path: str) -> None:
        with self.guard("remove", path):
            self.fs.rm_file(path)

    def cat_many(self, paths: list[str]) -> dict[str, bytes]:
        if not paths:
            return {}
        with self.guard("read", paths[0]):
            found = self.fs.cat(paths)
        return {str(path): data for path, data in found.items()}


def _fsync_directory(directory: str) -> None:
    # The rename itself must survive a power cut; not every platform can open a directory.
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _serialize(table: pa.Table, compression: str | None) -> bytes:
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_file(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _count_groups(table: pa.Table) -> int:
    return int(pc.count_distinct(table.column("group_id")).as_py())


def shard_key_tag(shard_key: str) -> str:
    """The tag a shard written with ``shard_key`` carries in its name (``ShardRef.tag``)."""
    return "k" + hashlib.sha256(shard_key.encode()).hexdigest()[:20]


def _tag_of(name: str) -> str | None:
    match = _SHARD_RE.match(name)
    return match["tag"] if match else None


# --------------------------------------------------------------------------- writer


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
        self.writer_id = _check_name("writer_id", writer_id)
        self.compression = compression
        self._storage = _Storage(url, run, stream, storage_options)
        self.stream = stream
        self._storage.probe(create=True)
        self._sequence = 0
        self._last_commit_ns = 0
        # tag -> committed name for keyed shards; listed once, lazily, then kept current.
        self._keyed: dict[str, str] | None = None
        if self._storage.is_local:
            self._sweep_stale_temps()

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
            tag = f"s{self._sequence:08d}"
        data = _serialize(conformed, self.compression)
        # The time is taken after encoding, just before the commit, so names track commits.
        commit_ns = max(time.time_ns(), self._last_commit_ns + 1)
        num_groups = _count_groups(conformed)
        name = (
            f"{commit_ns:020d}-{self.writer_id}-{tag}-g{num_groups}-r{conformed.num_rows}"
            f"{SHARD_SUFFIX}"
        )
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
                tag = _tag_of(name)
                if tag is not None and tag.startswith("k"):
                    self._keyed[tag] = name
        return self._keyed

    def _sweep_stale_temps(self) -> None:
        # Temp files are left only by writers that died mid-commit; none is ever renamed later.
        cutoff = time.time() - STALE_TEMP_AGE_S
        try:
            entries = list(os.scandir(self._storage.prefix))
        except OSError:
            return
        for entry in entries:
            if entry.name.startswith(TEMP_PREFIX):
                with contextlib.suppress(OSError):
                    if entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)


# --------------------------------------------------------------------------- reader


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
        self.consumer = _check_name("consumer", consumer)
        self.stream = stream
        self.compact_after_entries = compact_after_entries
        self._storage = _Storage(url, run, stream, storage_options)
        self._storage.probe(create=False)
        self._ledger_dir = f"{self._storage.prefix}/{LEDGER_DIR}/{consumer}"
        self._quarantine_dir = f"{self._storage.prefix}/{QUARANTINE_DIR}"
        self._acked: set[str] = set()
        self._records: list[AckRecord] = []
        self._ledger_files: list[str] = []
        self._in_flight: dict[str, ShardRef] = {}
        self._bad: set[str] = set()
        self._warned_names: set[str] = set()
        # Shard names are immutable: parse each once, not on every poll. A long run's
        # stream holds thousands of shards and a poller lists it every few tens of ms.
        self._parsed: dict[str, ShardRef] = {}
        self._load_ledger()

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
                if _SHARD_RE.match(name) is None:
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
            if ref.name not in self._acked
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

        Raises ``CorruptShardError`` (shard moved to ``_quarantine/``, continue with the next
        one) or ``StreamStorageError`` (storage trouble: nothing moved, retry later).
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
            raise StreamStorageError(
                f"shard {ref.url} is listed but cannot be found (deleted outside Sluice?)"
            ) from error
        try:
            table = pa.ipc.open_file(buffer).read_all()
            table.validate(full=True)
            validate_table(table, stream=self.stream)
        except Exception as error:  # noqa: BLE001 - any failure to decode bytes in hand is content
            reason = f"{type(error).__name__}: {error}"
            raise self._quarantine(ref, reason) from error
        if ref.name not in self._acked:
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
            self._storage.put_atomic(f"{destination}.reason.txt", reason.encode())
        quarantine_url = self._storage.url_of(destination)
        logger.error(
            "quarantined corrupt shard %s of stream %s: %s -> %s",
            ref.name,
            self._storage.prefix_url,
            reason,
            quarantine_url,
        )
        return CorruptShardError(ref, reason, quarantine_url)

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
        """Name tags of the shards moved to quarantine (one listing; compare `shard_key_tag`)."""
        tags = (_tag_of(name) for name in self._storage.list_names(self._quarantine_dir))
        return {tag for tag in tags if tag is not None}

    def pending(self) -> list[ShardRef]:
        """Shards read by this reader and not yet acked, oldest first."""
        return sorted(self._in_flight.values())

    def release(self, refs: Iterable[ShardRef | str]) -> None:
        """Give read-but-unacked shards back, so the next ``poll`` offers them again."""
        for name in _names_of(refs):
            self._in_flight.pop(name, None)

    # ---------------------------------------------------------------- ledger

    def acked(self) -> set[str]:
        """Names of every shard this consumer has acked (in memory, no storage call)."""
        return set(self._acked)

    def is_acked(self, ref: ShardRef | str) -> bool:
        """Whether this consumer has acked the shard."""
        return (ref.name if isinstance(ref, ShardRef) else ref) in self._acked

    def records(self) -> list[AckRecord]:
        """The ledger, oldest ack first: which shards were acked together, with their meta."""
        return list(self._records)

    def ack(self, refs: Iterable[ShardRef | str], meta: Mapping[str, Any] | None = None) -> None:
        """Record durably that this consumer is done with ``refs``.

        One atomic ledger write for all of them; shards already acked are skipped, and a
        call with nothing new writes nothing. ``meta`` must be JSON-serialisable
        (``ValueError`` otherwise, before anything is written).
        """
        names = list(dict.fromkeys(_names_of(refs)))
        for name in names:
            if _SHARD_RE.match(name) is None:
                raise ValueError(f"cannot ack {name!r}: not a Sluice shard name")
        new = [name for name in names if name not in self._acked]
        if not new:
            return
        record = AckRecord(
            record_id=uuid.uuid4().hex,
            shards=tuple(new),
            meta=dict(meta or {}),
            acked_at_ns=time.time_ns(),
        )
        payload = _encode_ledger([record], what=f"ack meta {meta!r}")
        path = f"{self._ledger_dir}/{record.acked_at_ns:020d}-{record.record_id[:12]}.json"
        self._storage.put_atomic(path, payload)
        self._acked.update(new)
        self._records.append(record)
        self._ledger_files.append(path)
        for name in new:
            self._in_flight.pop(name, None)
        if len(self._ledger_files) > self.compact_after_entries:
            self.compact_ledger()

    def compact_ledger(self) -> None:
        """Merge this consumer's ledger files into one.

        The merged file is committed before the old ones are deleted, so a crash in between
        leaves duplicated records (deduplicated by id on load), never a lost ack.
        """
        if len(self._ledger_files) < 2:
            return
        now = time.time_ns()
        path = f"{self._ledger_dir}/{now:020d}-{uuid.uuid4().hex[:12]}-compact.json"
        self._storage.put_atomic(path, _encode_ledger(self._records, what="ledger"))
        old, self._ledger_files = self._ledger_files, [path]
        self._delete_ledger_files(old)

    def _delete_ledger_files(self, paths: list[str]) -> None:
        # Superseded by a committed compact file; tests override this to crash half-way.
        for stale in paths:
            try:
                self._storage.remove(stale)
            except (StreamStorageError, FileNotFoundError) as error:
                logger.warning("ledger compaction left %s behind: %s", stale, error)

    def _load_ledger(self) -> None:
        names = sorted(
            name for name in self._storage.list_names(self._ledger_dir) if name.endswith(".json")
        )
        paths = [f"{self._ledger_dir}/{name}" for name in names]
        contents = self._storage.cat_many(paths)
        seen: set[str] = set()
        records: list[AckRecord] = []
        for path in paths:
            data = contents.get(path)
            if data is None:
                data = contents.get(self._storage.url_of(path), b"")
            try:
                decoded = json.loads(data)
                if decoded.get("format") != _LEDGER_FORMAT:
                    raise ValueError(f"unknown ledger format {decoded.get('format')!r}")
                file_records = [
                    AckRecord(
                        record_id=str(item["record_id"]),
                        shards=tuple(str(name) for name in item["shards"]),
                        meta=dict(item["meta"]),
                        acked_at_ns=int(item["acked_at_ns"]),
                    )
                    for item in decoded["records"]
                ]
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
        self._records = records
        self._acked = {name for record in records for name in record.shards}
        self._ledger_files = paths


def _names_of(refs: Iterable[ShardRef | str]) -> Iterator[str]:
    if isinstance(refs, (ShardRef, str)):
        raise TypeError("pass a list of ShardRef or shard names, not a single one")
    for ref in refs:
        yield ref.name if isinstance(ref, ShardRef) else str(ref).rstrip("/").rsplit("/", 1)[-1]


def _encode_ledger(records: Sequence[AckRecord], *, what: str) -> bytes:
    try:
        return json.dumps(
            {"format": _LEDGER_FORMAT, "records": [dataclasses.asdict(r) for r in records]},
            allow_nan=False,
        ).encode()
    except (TypeError, ValueError) as error:
        raise ValueError(f"{what} is not JSON-serialisable: {error}") from error
