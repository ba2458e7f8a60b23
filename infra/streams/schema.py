"""The trajectory row layout of every stream, and the helpers that build and check tables.

Row = one sampled response (docs/design.md §3), typed in Python as
``sluice.engines.trajectory.TrajectoryRow`` (a unit test holds its fields and this
schema's columns equal, names and nullability). The Arrow schema carries
``sluice.schema_version`` and ``sluice.stream`` in its metadata (invariant 4,
self-describing): ``validate_table`` checks a shard read back, ``conform_table`` readies a
table to commit, and ``table_from_rows`` / ``table_from_arrays`` build one from Python
rows or numpy columns. Extra task columns (reference answer, tests) pass through.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sluice.engines.trajectory import (
    BEHAVIOUR_LOGPROBS,
    CREATED_AT,
    LOSS_MASK,
    POLICY_INCARNATION,
    RESPONSE_TOKEN_IDS,
    REWARD,
    TOKEN_VERSIONS,
    VERSION_END,
    VERSION_START,
    version_bounds,
)
from sluice.infra.streams.errors import SchemaError

SCHEMA_VERSION = "3"
"""Version of the trajectory row layout; bump it when a core column is added or changes
meaning or type. 1: single-turn responses. 2: adds ``loss_mask`` (multi-turn episodes,
whose tool observations sit among the response tokens but are never trained). 3: adds
``policy_incarnation`` (the trainer incarnation whose versions generated the row)."""
READABLE_VERSIONS = ("1", "2", "3")
"""Layouts a reader accepts; an older shard is read as the current layout
(``upgrade_table``), so shards written before an upgrade are still consumed."""
ADDED_IN: dict[str, str] = {LOSS_MASK: "2", POLICY_INCARNATION: "3"}
"""Core columns that a layout before the named version does not have."""
SCHEMA_VERSION_KEY = b"sluice.schema_version"
STREAM_KEY = b"sluice.stream"
WRITER_KEY = b"sluice.writer_id"

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
        # Per response token, 1 = trained, 0 = not (a tool's observation tokens). Null:
        # every token is trained (single-turn responses store nothing).
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=True),
        # The trainer incarnation whose versions generated the tokens (design §2). Null:
        # written before incarnations.
        pa.field("policy_incarnation", pa.int32(), nullable=True),
    ],
    metadata={SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode()},
)
"""Core columns of a trajectory row (one sampled response). Extra columns pass through."""

CORE_COLUMNS: tuple[str, ...] = tuple(TRAJECTORY_SCHEMA.names)
# Per-token columns of one response: equal length in every row, or the trainer misaligns them.
PER_TOKEN_COLUMNS: tuple[str, ...] = (
    RESPONSE_TOKEN_IDS,
    BEHAVIOUR_LOGPROBS,
    TOKEN_VERSIONS,
    LOSS_MASK,
)


def _core_fields(version: str) -> list[pa.Field]:
    """The core columns of layout `version` (every readable one is an ordered prefix-set)."""
    return [f for f in TRAJECTORY_SCHEMA if int(ADDED_IN.get(f.name, "1")) <= int(version)]


def trajectory_schema(stream: str, extra_fields: Iterable[pa.Field] = ()) -> pa.Schema:
    """The trajectory schema stamped with its version and the stream name, plus extras."""
    metadata = {SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode(), STREAM_KEY: stream.encode()}
    return pa.schema([*TRAJECTORY_SCHEMA, *extra_fields], metadata=metadata)


def _schema_problems(schema: pa.Schema, version: str = SCHEMA_VERSION) -> list[str]:
    problems = []
    for core in _core_fields(version):
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
    present = [core for core in TRAJECTORY_SCHEMA if core.name in table.column_names]
    for core in present:
        if not core.nullable and table.column(core.name).null_count:
            problems.append(f"column {core.name!r} has {table.column(core.name).null_count} nulls")
    if problems:
        return problems
    per_token = [name for name in PER_TOKEN_COLUMNS if name in table.column_names]
    lengths = [pc.list_value_length(table.column(name)) for name in per_token]
    for name, length in zip(per_token[1:], lengths[1:], strict=True):
        # A null loss_mask has no length: nothing to compare (every token is trained).
        mismatch = pc.fill_null(pc.not_equal(lengths[0], length), False)
        if pc.any(mismatch).as_py():
            row = int(pc.index(mismatch, True).as_py())
            problems.append(
                f"row {row}: {name!r} has {length[row].as_py()} entries but "
                f"'response_token_ids' has {lengths[0][row].as_py()}"
            )
    if LOSS_MASK in table.column_names:
        flags = pc.list_flatten(table.column(LOSS_MASK))
        if len(flags) and pc.max(flags).as_py() > 1:
            problems.append(f"column {LOSS_MASK!r} holds values other than 0 and 1")
    backwards = pc.greater(table.column(VERSION_START), table.column(VERSION_END))
    if pc.any(backwards).as_py():
        row = int(pc.index(backwards, True).as_py())
        problems.append(f"row {row}: version_start > version_end")
    return problems


def validate_table(table: pa.Table, *, stream: str | None = None) -> None:
    """Raise ``SchemaError`` unless ``table`` holds valid trajectory rows.

    Checks the core columns of the table's layout and their exact types (extras are
    allowed), nulls in non-nullable core columns, equal per-token lengths and version
    order. With ``stream`` the schema metadata must also carry a schema version this
    Sluice reads (``READABLE_VERSIONS``) and that stream name.
    """
    if not isinstance(table, pa.Table):
        raise SchemaError(f"expected a pyarrow.Table, got {type(table).__name__}")
    problems = []
    metadata = table.schema.metadata or {}
    raw_version = metadata.get(SCHEMA_VERSION_KEY)
    version = SCHEMA_VERSION if raw_version is None else raw_version.decode(errors="replace")
    if stream is not None:
        if raw_version is None:
            problems.append("schema metadata has no sluice.schema_version (not a Sluice shard)")
        elif version not in READABLE_VERSIONS:
            problems.append(
                f"schema version {version!r}, this Sluice reads {', '.join(READABLE_VERSIONS)}"
            )
        shard_stream = metadata.get(STREAM_KEY, b"").decode(errors="replace")
        if raw_version is not None and shard_stream != stream:
            problems.append(f"shard belongs to stream {shard_stream!r}, not {stream!r}")
    if version not in READABLE_VERSIONS:
        version = SCHEMA_VERSION
    problems += _schema_problems(table.schema, version)
    if not problems:
        problems += _row_problems(table)
    if problems:
        raise SchemaError("; ".join(problems))


def upgrade_table(table: pa.Table) -> pa.Table:
    """A validated table of an older layout as the current one: core columns it lacks
    are added as nulls, which mean what the older layout meant (``loss_mask`` null:
    every token trained). The current layout comes back unchanged."""
    for core in TRAJECTORY_SCHEMA:
        if core.name not in table.column_names:
            table = table.add_column(
                TRAJECTORY_SCHEMA.get_field_index(core.name),
                core,
                pa.nulls(table.num_rows, type=core.type),
            )
    metadata = dict(table.schema.metadata or {})
    if metadata.get(SCHEMA_VERSION_KEY) not in (None, SCHEMA_VERSION.encode()):
        metadata[SCHEMA_VERSION_KEY] = SCHEMA_VERSION.encode()
        table = table.replace_schema_metadata(metadata)
    return table


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
    table = upgrade_table(table)  # a table read from an older shard, passed on
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


_DERIVABLE = {REWARD, CREATED_AT, VERSION_START, VERSION_END, LOSS_MASK, POLICY_INCARNATION}


def _now_ms_utc() -> np.datetime64:
    return np.datetime64(time.time_ns() // 1_000_000, "ms")


def _versions_from_tokens(token_versions: pa.Array) -> tuple[pa.Array, pa.Array]:
    """`version_bounds` of every row at once, over the flat values (no Python per row)."""
    flat = flat_list_column(pa.table({TOKEN_VERSIONS: token_versions}), TOKEN_VERSIONS)
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
    if REWARD not in arrays:
        arrays[REWARD] = pa.nulls(num_rows, type=pa.float32())
    for optional in (LOSS_MASK, POLICY_INCARNATION):
        if optional not in arrays:
            arrays[optional] = pa.nulls(num_rows, type=TRAJECTORY_SCHEMA.field(optional).type)
    if CREATED_AT not in arrays:
        arrays[CREATED_AT] = pa.array(
            np.full(num_rows, _now_ms_utc()), type=pa.timestamp("ms", tz="UTC")
        )
    if VERSION_START not in arrays or VERSION_END not in arrays:
        start, end = _versions_from_tokens(arrays[TOKEN_VERSIONS])
        arrays.setdefault(VERSION_START, start)
        arrays.setdefault(VERSION_END, end)
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
        complete.setdefault(REWARD, None)
        complete.setdefault(LOSS_MASK, None)
        complete.setdefault(POLICY_INCARNATION, None)
        complete.setdefault(CREATED_AT, now)
        if VERSION_START not in row or VERSION_END not in row:
            bounds = version_bounds(list(row[TOKEN_VERSIONS]))
            if bounds is None:
                raise SchemaError(
                    f"row {index} (sample_id={row.get('sample_id')!r}) has no token_versions: "
                    "give version_start/version_end explicitly"
                )
            complete.setdefault(VERSION_START, bounds[0])
            complete.setdefault(VERSION_END, bounds[1])
        names.update(dict.fromkeys(row))
        filled.append(complete)
    columns = {name: [row.get(name) for row in filled] for name in names}
    return table_from_arrays(columns, stream=stream)
