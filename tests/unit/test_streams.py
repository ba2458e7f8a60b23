"""Trajectory streams: schema, atomic commits, quarantine and exactly-once consumption.

The ``scenario_*`` functions take a storage root and options so that
``tests/integration/test_streams_s3.py`` runs the same invariants against the S3 protocol;
here they run on ``memory://`` and ``file://``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
import time
import uuid
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from fsspec.core import url_to_fs

from sluice.infra.storage import TEMP_PREFIX
from sluice.infra.streams.errors import (
    CorruptShardError,
    SchemaError,
    StreamConfigError,
    StreamError,
    StreamStorageError,
)
from sluice.infra.streams.names import ShardRef
from sluice.infra.streams.reader import StreamReader
from sluice.infra.streams.schema import (
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    STREAM_KEY,
    FlatList,
    flat_list_column,
    table_from_arrays,
    table_from_rows,
    validate_table,
)
from sluice.infra.streams.writer import StreamWriter

RUN = "run-1"
STREAM = "rollouts"
Options = dict[str, Any] | None


# --------------------------------------------------------------------------- helpers


def make_rows(rng: random.Random, group_id: str, group_size: int = 4) -> list[dict[str, Any]]:
    """One prompt group: ``group_size`` responses of random length, with extra task fields."""
    prompt = [rng.randrange(100) for _ in range(rng.randint(1, 6))]
    rows = []
    for index in range(group_size):
        length = rng.randint(1, 12)
        first_version = rng.randint(0, 3)
        versions = sorted(first_version + rng.randint(0, 1) for _ in range(length))
        rows.append(
            {
                "sample_id": f"{group_id}/{index}",
                "group_id": group_id,
                "prompt_id": f"p-{group_id}",
                "prompt_token_ids": prompt,
                "response_token_ids": [rng.randrange(100) for _ in range(length)],
                "behaviour_logprobs": [-rng.random() for _ in range(length)],
                "token_versions": versions,
                "finish_reason": rng.choice(["stop", "length"]),
                "task": "arith",
                "worker": "gen-0",
                "answer": str(rng.randrange(1000)),
            }
        )
    return rows


def make_table(rng: random.Random, tag: str, num_groups: int = 1) -> pa.Table:
    rows = []
    for group in range(num_groups):
        rows += make_rows(rng, f"{tag}-g{group}")
    return table_from_rows(rows)


def shard_path(root: str, options: Options, name: str, stream: str = STREAM) -> tuple[Any, str]:
    fs, base = url_to_fs(root, **(options or {}))
    return fs, f"{base.rstrip('/')}/{RUN}/{stream}/{name}"


def put_raw(root: str, options: Options, name: str, data: bytes) -> None:
    """Commit bytes under a shard name behind Sluice's back (a foreign or broken producer)."""
    fs, path = shard_path(root, options, name)
    pipe(fs, path, data)


def pipe(fs: Any, path: str, data: bytes) -> None:
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, data)


def arrow_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def stamped(table: pa.Table, version: str = "1", stream: str = STREAM) -> pa.Table:
    return table.replace_schema_metadata(
        {SCHEMA_VERSION_KEY: version.encode(), STREAM_KEY: stream.encode()}
    )


class SimulatedCrash(Exception):
    """A process dying at the injected point."""


class CrashingWriter(StreamWriter):
    """Dies between encoding a shard and committing it, with probability ``crash_p``.

    On a local disk the dying commit leaves a half-written temp file behind, exactly what a
    killed process leaves; on object stores the single PUT simply never happens.
    """

    def __init__(self, *args: Any, rng: random.Random, crash_p: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rng = rng
        self.crash_p = crash_p

    def _commit_bytes(self, path: str, data: bytes) -> None:
        if self.rng.random() < self.crash_p:
            if self._storage.is_local:
                temp = os.path.join(os.path.dirname(path), f"{TEMP_PREFIX}{uuid.uuid4().hex}.part")
                with open(temp, "wb") as handle:
                    handle.write(data[: len(data) // 2])
            raise SimulatedCrash(path)
        super()._commit_bytes(path, data)


class CrashingCompactionReader(StreamReader):
    """Dies after committing a compacted ledger file but before deleting all superseded ones."""

    def __init__(self, *args: Any, rng: random.Random, crash_p: float, **kwargs: Any) -> None:
        self.rng = rng
        self.crash_p = crash_p
        super().__init__(*args, **kwargs)

    def _delete_ledger_files(self, paths: list[str]) -> None:
        if self.rng.random() < self.crash_p:
            super()._delete_ledger_files(paths[: len(paths) // 2])
            raise SimulatedCrash("compaction")
        super()._delete_ledger_files(paths)


# --------------------------------------------------------------------------- scenarios


def scenario_round_trip(root: str, options: Options) -> None:
    rng = random.Random(0)
    table = make_table(rng, "rt", num_groups=3)
    table = table.append_column("tests", pa.array([["assert f(1) == 2"]] * table.num_rows))
    for compression in (None, "zstd"):
        stream = f"rt-{compression or 'plain'}"
        writer = StreamWriter(
            root, RUN, stream, "gen-0", storage_options=options, compression=compression
        )
        ref = writer.write(table)
        assert (ref.num_groups, ref.num_rows) == (3, 12)
        reader = StreamReader(root, RUN, stream, "trainer", storage_options=options)
        assert reader.poll() == [ref]
        got = reader.read(ref)
        assert got.equals(table)  # every core and extra column, bit for bit
        assert got.column_names[-2:] == ["answer", "tests"]
        assert got.schema.metadata[SCHEMA_VERSION_KEY] == SCHEMA_VERSION.encode()
        assert got.schema.metadata[STREAM_KEY] == stream.encode()
        flat = flat_list_column(got, "response_token_ids")
        rows = got.column("response_token_ids").to_pylist()
        for index, tokens in enumerate(rows):
            assert flat.values[flat.offsets[index] : flat.offsets[index + 1]].tolist() == tokens
        assert reader.poll() == []  # read, pending: not offered twice to the same reader
        reader.ack([ref], meta={"policy_version": 2})
        restarted = StreamReader(root, RUN, stream, "trainer", storage_options=options)
        assert restarted.poll() == []
        assert restarted.acked() == {ref.name}
        assert restarted.records()[0].meta == {"policy_version": 2}
        other = StreamReader(root, RUN, stream, "evaluator", storage_options=options)
        assert other.poll() == [ref]  # each consumer has its own ledger


def scenario_oldest_first(root: str, options: Options) -> None:
    rng = random.Random(1)
    writers = [StreamWriter(root, RUN, STREAM, f"gen-{i}", storage_options=options) for i in (0, 1)]
    commit_order = []
    for index, writer_index in enumerate([1, 0, 0, 1, 1, 0, 1]):
        commit_order.append(writers[writer_index].write(make_table(rng, f"o{index}")).name)
    reader = StreamReader(root, RUN, STREAM, "trainer", storage_options=options)
    assert [ref.name for ref in reader.poll()] == commit_order
    batch = reader.read_next(max_shards=3)
    assert [ref.name for ref in batch.refs] == commit_order[:3]
    assert batch.table.column("group_id").to_pylist()[::4] == ["o0-g0", "o1-g0", "o2-g0"]
    assert [ref.name for ref in reader.poll()] == commit_order[3:]


def scenario_read_next_takes_whole_shards_up_to_max_groups(root: str, options: Options) -> None:
    rng = random.Random(2)
    writer = StreamWriter(root, RUN, STREAM, "gen-0", storage_options=options)
    refs = [
        writer.write(make_table(rng, f"s{i}", num_groups=n)) for i, n in enumerate([2, 3, 1, 5])
    ]
    reader = StreamReader(root, RUN, STREAM, "trainer", storage_options=options)
    # Budget 4: shard of 2 fits, the next (3) would make 5 > 4, so the batch stops at one shard.
    first = reader.read_next(max_groups=4)
    assert first.refs == [refs[0]] and first.num_groups == 2 and first.table.num_rows == 8
    # Budget 4 again: 3 + 1 = 4 fits exactly; 5 would not.
    second = reader.read_next(max_groups=4)
    assert second.refs == refs[1:3] and second.num_groups == 4
    # A shard larger than the budget is still read alone, or the stream would stall.
    third = reader.read_next(max_groups=4)
    assert third.refs == [refs[3]] and third.num_groups == 5
    empty = reader.read_next(max_groups=4)
    assert empty.refs == [] and empty.table.num_rows == 0


def scenario_corrupt_and_foreign_shards_are_quarantined(root: str, options: Options) -> None:
    rng = random.Random(3)
    writer = StreamWriter(root, RUN, STREAM, "gen-0", storage_options=options)
    first = writer.write(make_table(rng, "good1"))
    good_table = make_table(rng, "bad")
    encoded = arrow_bytes(stamped(good_table))
    wrong_types = good_table.set_column(
        4, "response_token_ids", good_table.column(4).cast(pa.list_(pa.int64()))
    )
    broken = {
        "garbage": b"this is not arrow at all",
        "empty": b"",
        "truncated": encoded[: len(encoded) // 2],
        "foreign-schema": arrow_bytes(pa.table({"x": [1, 2, 3]})),
        "wrong-version": arrow_bytes(stamped(good_table, version="9")),
        "other-stream": arrow_bytes(stamped(good_table, stream="scored")),
        "wrong-types": arrow_bytes(stamped(wrong_types)),
    }
    names = {}
    for offset, kind in enumerate(broken, start=1):
        name = f"{first.commit_time_ns + offset:020d}-{kind}-s00000000-g1-r4.arrow"
        put_raw(root, options, name, broken[kind])
        names[kind] = name
    put_raw(root, options, "notes.txt", b"not a shard name: ignored")
    last = writer.write(make_table(rng, "good2"))

    reader = StreamReader(root, RUN, STREAM, "trainer", storage_options=options)
    offered = reader.poll()
    assert [ref.name for ref in offered] == [first.name, *names.values(), last.name]
    good, corrupt = [], {}
    for ref in offered:
        try:
            good.append(reader.read(ref))
        except CorruptShardError as error:
            corrupt[error.ref.name] = error
    assert [table.column("group_id")[0].as_py() for table in good] == ["good1-g0", "good2-g0"]
    assert set(corrupt) == set(names.values())
    assert "schema version '9'" in corrupt[names["wrong-version"]].reason
    assert "stream 'scored'" in corrupt[names["other-stream"]].reason
    assert "response_token_ids" in corrupt[names["wrong-types"]].reason
    for error in corrupt.values():
        assert error.quarantine_url is not None and "/_quarantine/" in error.quarantine_url
        fs, path = url_to_fs(error.quarantine_url, **(options or {}))
        assert fs.exists(path) and fs.exists(f"{path}.reason.txt")
    # Quarantined shards left the stream for every consumer; the stream goes on.
    assert [ref.name for ref in reader.committed()] == [first.name, last.name]
    other = StreamReader(root, RUN, STREAM, "evaluator", storage_options=options)
    assert [ref.name for ref in other.poll()] == [first.name, last.name]
    reader.ack(reader.pending())
    after = writer.write(make_table(rng, "good3"))
    assert reader.poll() == [after]
    assert reader.read(after).num_rows == 4


def scenario_a_shard_deleted_after_listing_is_lost_not_fatal(root: str, options: Options) -> None:
    """A shard listed, then deleted behind Sluice's back, is skipped like a corrupt one:
    the batch goes on without it, and a note in quarantine tells every consumer (and the
    trainer waiting on its groups) that it is gone."""
    rng = random.Random(7)
    writer = StreamWriter(root, RUN, STREAM, "gen-0", storage_options=options)
    kept, gone, last = (writer.write(make_table(rng, key)) for key in ("a", "b", "c"))
    reader = StreamReader(root, RUN, STREAM, "trainer", storage_options=options)
    assert reader.poll() == [kept, gone, last]
    fs, path = shard_path(root, options, gone.name)
    fs.rm_file(path)

    assert reader.read(kept).num_rows == 4
    with pytest.raises(CorruptShardError) as lost:
        reader.read(gone)
    assert "deleted outside Sluice" in lost.value.reason
    assert lost.value.quarantine_url is None  # nothing left to move
    assert reader.read(last).num_rows == 4  # the stream goes on
    assert reader.quarantined_tags() == {gone.tag}
    reader.ack(reader.pending())
    assert reader.pending() == [] and reader.poll() == []
    other = StreamReader(root, RUN, STREAM, "evaluator", storage_options=options)
    assert other.poll() == [kept, last] and other.quarantined_tags() == {gone.tag}


def scenario_exactly_once_under_crashes(
    root: str, options: Options, seed: int, steps: int = 60
) -> None:
    """Writers die before commits, consumers die between read and ack and mid-compaction;
    at the end every committed shard has been acked exactly once, in commit order, and
    every read returned exactly the rows that were written."""
    rng = random.Random(seed)
    stream = f"eo-{seed}"

    def new_writer(writer_id: str) -> CrashingWriter:
        return CrashingWriter(
            root, RUN, stream, writer_id, storage_options=options, rng=rng, crash_p=0.2
        )

    def new_reader() -> CrashingCompactionReader:
        return CrashingCompactionReader(
            root,
            RUN,
            stream,
            "trainer",
            storage_options=options,
            compact_after_entries=3,
            rng=rng,
            crash_p=0.3,
        )

    writers = {writer_id: new_writer(writer_id) for writer_id in ("gen-0", "gen-1", "gen-2")}
    reader = new_reader()
    commit_order: list[str] = []
    written: dict[str, list[str]] = {}
    crashes = {"writer": 0, "reader": 0}

    def consume(reader: StreamReader) -> None:
        batch = reader.read_next(max_groups=rng.randint(1, 4))
        assert batch.quarantined == []
        sample_ids = batch.table.column("sample_id").to_pylist()
        assert sample_ids == [sid for ref in batch.refs for sid in written[ref.name]]
        if batch.refs:
            reader.ack(batch.refs, meta={"batch_groups": batch.num_groups})

    for step in range(steps):
        action = rng.random()
        if action < 0.5:
            writer_id = rng.choice(sorted(writers))
            table = make_table(rng, f"{stream}-{step}", num_groups=rng.randint(1, 2))
            try:
                ref = writers[writer_id].write(table)
            except SimulatedCrash:
                crashes["writer"] += 1
                writers[writer_id] = new_writer(writer_id)  # restarted process, same id
                continue
            commit_order.append(ref.name)
            written[ref.name] = table.column("sample_id").to_pylist()
        elif action < 0.85:
            if rng.random() < 0.25:
                reader.read_next(max_groups=rng.randint(1, 4))  # read, then die before ack
                crashes["reader"] += 1
                reader = new_reader()
                continue
            try:
                consume(reader)
            except SimulatedCrash:
                crashes["reader"] += 1
                reader = new_reader()
        else:
            crashes["reader"] += 1
            reader = new_reader()

    reader = StreamReader(root, RUN, stream, "trainer", storage_options=options)
    for _ in range(len(commit_order) + 1):  # bounded: a bug must fail, not hang
        if not reader.poll():
            break
        consume(reader)
    final = StreamReader(root, RUN, stream, "trainer", storage_options=options)
    acked_in_order = [name for record in final.records() for name in record.shards]
    assert acked_in_order == commit_order  # none lost, none twice, oldest first
    assert [ref.name for ref in final.committed()] == commit_order  # no partial shard visible
    assert final.poll() == []
    assert crashes["writer"] > 0 and crashes["reader"] > 0  # the faults were really exercised


def scenario_pipeline_stage_output_is_not_duplicated_by_retries(
    root: str, options: Options, seed: int, num_shards: int = 12
) -> None:
    """A scoring stage reads ``rollouts``, writes ``scored`` with ``shard_key`` = input shard,
    and dies at random between its write and its ack: ``scored`` still ends with exactly
    one shard per rollout shard, in the same order."""
    rng = random.Random(seed)
    source = StreamWriter(root, RUN, "rollouts", "gen-0", storage_options=options)
    inputs = [source.write(make_table(rng, f"pipe{i}")).name for i in range(num_shards)]

    def open_stage() -> tuple[StreamReader, StreamWriter]:
        return (
            StreamReader(root, RUN, "rollouts", "scorer", storage_options=options),
            StreamWriter(root, RUN, "scored", "scorer-0", storage_options=options),
        )

    reader, writer = open_stage()
    crashes = 0
    for _ in range(10 * num_shards):  # bounded: a bug must fail, not hang
        offered = reader.poll()
        if not offered:
            break
        ref = offered[0]
        table = reader.read(ref)
        rewards = pa.array([float(len(t)) for t in table.column("response_token_ids").to_pylist()])
        scored = table.set_column(
            table.schema.get_field_index("reward"), "reward", rewards.cast(pa.float32())
        ).append_column("source_shard", pa.array([ref.name] * table.num_rows))
        if rng.random() < 0.2:
            crashes += 1
            reader, writer = open_stage()  # died before writing its output
            continue
        writer.write(scored, shard_key=ref.name)
        if rng.random() < 0.4:
            crashes += 1
            reader, writer = open_stage()  # died after writing, before acking
            continue
        reader.ack([ref])
    assert reader.poll() == []
    assert crashes > 0
    consumer = StreamReader(root, RUN, "scored", "trainer", storage_options=options)
    outputs = consumer.poll()
    sources = [consumer.read(out).column("source_shard")[0].as_py() for out in outputs]
    assert sources == inputs


# --------------------------------------------------------------------------- backends


@pytest.fixture(params=["memory", "file"])
def stream_root(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, Options]:
    if request.param == "memory":
        return f"memory://sluice-{uuid.uuid4().hex[:10]}", None
    return f"file://{tmp_path}", None


def test_round_trip_keeps_every_column_and_acks_durably(stream_root: tuple[str, Options]) -> None:
    scenario_round_trip(*stream_root)


def test_poll_offers_shards_oldest_first_across_writers(stream_root: tuple[str, Options]) -> None:
    scenario_oldest_first(*stream_root)


def test_read_next_takes_whole_shards_up_to_max_groups(stream_root: tuple[str, Options]) -> None:
    scenario_read_next_takes_whole_shards_up_to_max_groups(*stream_root)


def test_corrupt_and_foreign_shards_are_quarantined_and_stream_goes_on(
    stream_root: tuple[str, Options], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="sluice.infra.streams"):
        scenario_corrupt_and_foreign_shards_are_quarantined(*stream_root)
    assert sum("quarantined corrupt shard" in r.getMessage() for r in caplog.records) == 7


def test_a_shard_deleted_after_listing_is_lost_not_fatal(
    stream_root: tuple[str, Options], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="sluice.infra.streams"):
        scenario_a_shard_deleted_after_listing_is_lost_not_fatal(*stream_root)
    assert sum("deleted outside Sluice" in r.getMessage() for r in caplog.records) == 1


def test_a_corrupt_shard_that_cannot_be_moved_is_still_skipped(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    root = f"file://{tmp_path}"
    writer = StreamWriter(root, RUN, STREAM, "gen-0")
    good = writer.write(make_table(random.Random(8), "good"))
    name = f"{good.commit_time_ns + 1:020d}-garbage-s00000000-g1-r4.arrow"
    put_raw(root, None, name, b"not arrow")
    (tmp_path / RUN / STREAM / "_quarantine").write_text("a file where the folder goes")
    reader = StreamReader(root, RUN, STREAM, "trainer")
    with caplog.at_level(logging.ERROR, logger="sluice.infra.streams"):
        batch = reader.read_next()
    assert batch.refs == [good]
    (corrupt,) = batch.quarantined
    assert corrupt.ref.name == name and corrupt.quarantine_url is None
    assert "could not be quarantined" in caplog.text
    reader.ack(batch.refs)
    assert reader.poll() == []  # not offered again: the stream goes on
    assert (tmp_path / RUN / STREAM / name).exists()  # left where it was, not lost


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_committed_shard_is_consumed_exactly_once_despite_crashes(
    stream_root: tuple[str, Options], seed: int
) -> None:
    scenario_exactly_once_under_crashes(*stream_root, seed=seed)


@pytest.mark.parametrize("seed", [0])
def test_retried_stage_output_is_not_duplicated(
    stream_root: tuple[str, Options], seed: int
) -> None:
    scenario_pipeline_stage_output_is_not_duplicated_by_retries(*stream_root, seed=seed)


# --------------------------------------------------------------------------- writer details


def test_keyed_write_returns_the_existing_shard_after_restart(
    stream_root: tuple[str, Options],
) -> None:
    root, options = stream_root
    table = make_table(random.Random(4), "k")
    first = StreamWriter(root, RUN, STREAM, "scorer-0", storage_options=options).write(
        table, shard_key="rollouts/123"
    )
    again = StreamWriter(root, RUN, STREAM, "scorer-1", storage_options=options).write(
        table, shard_key="rollouts/123"
    )
    assert again == first
    reader = StreamReader(root, RUN, STREAM, "trainer", storage_options=options)
    assert reader.poll() == [first]


def test_half_written_temp_file_is_never_seen_and_stale_ones_are_swept(tmp_path: Any) -> None:
    root = f"file://{tmp_path}"
    writer = CrashingWriter(root, RUN, STREAM, "gen-0", rng=random.Random(0), crash_p=1.0)
    with pytest.raises(SimulatedCrash):
        writer.write(make_table(random.Random(5), "t"))
    stream_dir = tmp_path / RUN / STREAM
    (temp,) = [p for p in stream_dir.iterdir() if p.name.startswith(TEMP_PREFIX)]
    reader = StreamReader(root, RUN, STREAM, "trainer")
    assert reader.poll() == []
    old = time.time() - 7200
    os.utime(temp, (old, old))
    StreamWriter(root, RUN, STREAM, "gen-0")  # a restarted writer cleans up after the dead one
    assert not temp.exists()


def test_failed_local_commit_leaves_neither_shard_nor_temp(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = StreamWriter(f"file://{tmp_path}", RUN, STREAM, "gen-0")

    def rename_fails(source: str, destination: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", rename_fails)
    with pytest.raises(StreamStorageError, match=f"file://{tmp_path}.*No space left"):
        writer.write(make_table(random.Random(12), "f"))
    monkeypatch.undo()
    assert list((tmp_path / RUN / STREAM).iterdir()) == []
    ref = writer.write(make_table(random.Random(12), "f"))  # the writer is still usable
    assert [r.name for r in StreamReader(f"file://{tmp_path}", RUN, STREAM, "t").poll()] == [
        ref.name
    ]


def test_write_rejects_bad_tables_and_writes_nothing(stream_root: tuple[str, Options]) -> None:
    root, options = stream_root
    writer = StreamWriter(root, RUN, STREAM, "gen-0", storage_options=options)
    table = make_table(random.Random(6), "v")
    with pytest.raises(SchemaError, match="'finish_reason'"):
        writer.write(table.drop_columns(["finish_reason"]))
    with pytest.raises(SchemaError, match="empty shard"):
        writer.write(table.slice(0, 0))
    too_big = table.set_column(
        7, "version_start", pa.array([2**40] * table.num_rows, type=pa.int64())
    )
    with pytest.raises(SchemaError, match="'version_start'.*cannot be cast"):
        writer.write(too_big)
    short = table.set_column(
        5, "behaviour_logprobs", pa.array([[-0.5]] * table.num_rows, type=pa.list_(pa.float32()))
    )
    with pytest.raises(SchemaError, match="'behaviour_logprobs' has 1 entries"):
        writer.write(short)
    with pytest.raises(SchemaError, match="expected a pyarrow.Table"):
        writer.write({"sample_id": ["x"]})  # type: ignore[arg-type]
    assert StreamReader(root, RUN, STREAM, "trainer", storage_options=options).committed() == []
    # Castable types are accepted: int64 token ids that fit int32 are stored as int32.
    wide = table.set_column(4, "response_token_ids", table.column(4).cast(pa.list_(pa.int64())))
    ref = writer.write(wide)
    got = StreamReader(root, RUN, STREAM, "trainer", storage_options=options).read(ref)
    assert got.schema.field("response_token_ids").type == pa.list_(pa.int32())
    assert got.column("response_token_ids").to_pylist() == table.column(4).to_pylist()


def test_bad_url_and_names_give_one_clear_error() -> None:
    with pytest.raises(StreamConfigError, match="s4://bucket/x"):
        StreamWriter("s4://bucket/x", RUN, STREAM, "gen-0")
    with pytest.raises(StreamConfigError, match="run '../etc'"):
        StreamReader("memory://x", "../etc", STREAM, "trainer")
    with pytest.raises(StreamConfigError, match="consumer '_ledger'"):
        StreamReader("memory://x", RUN, STREAM, "_ledger")
    with pytest.raises(StreamConfigError, match="compression"):
        StreamWriter("memory://x", RUN, STREAM, "gen-0", compression="gzip")


# --------------------------------------------------------------------------- ledger details


def test_ack_is_idempotent_and_rejects_unserialisable_meta(
    stream_root: tuple[str, Options],
) -> None:
    root, options = stream_root
    ref = StreamWriter(root, RUN, STREAM, "gen-0", storage_options=options).write(
        make_table(random.Random(7), "a")
    )
    reader = StreamReader(root, RUN, STREAM, "trainer", storage_options=options)
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        reader.ack([ref], meta={"when": datetime.datetime.now()})
    assert not reader.is_acked(ref)
    assert StreamReader(root, RUN, STREAM, "trainer", storage_options=options).acked() == set()
    reader.ack([ref, ref.name])
    reader.ack([ref])
    restarted = StreamReader(root, RUN, STREAM, "trainer", storage_options=options)
    assert [record.shards for record in restarted.records()] == [(ref.name,)]


def test_compaction_keeps_every_ack_even_when_interrupted(
    stream_root: tuple[str, Options],
) -> None:
    root, options = stream_root
    rng = random.Random(8)
    writer = StreamWriter(root, RUN, STREAM, "gen-0", storage_options=options)
    names = [writer.write(make_table(rng, f"c{i}")).name for i in range(7)]
    reader = CrashingCompactionReader(
        root,
        RUN,
        STREAM,
        "trainer",
        storage_options=options,
        rng=rng,
        crash_p=1.0,
        compact_after_entries=5,
    )
    for name in names[:5]:
        reader.ack([name])
    with pytest.raises(SimulatedCrash):
        reader.ack([names[5]])  # 6 files > 5: compacts, then dies deleting the old files
    restarted = StreamReader(
        root, RUN, STREAM, "trainer", storage_options=options, compact_after_entries=5
    )
    assert [r.shards[0] for r in restarted.records()] == names[:6]  # duplicates merged by id
    restarted.ack([names[6]])
    restarted.compact_ledger()
    fs, ledger = shard_path(root, options, "_ledger/trainer")
    assert len(fs.ls(ledger)) == 1
    final = StreamReader(root, RUN, STREAM, "trainer", storage_options=options)
    assert [r.shards[0] for r in final.records()] == names
    assert [ref.name for ref in final.poll()] == []


def test_unreadable_ledger_stops_the_reader_naming_the_file(
    stream_root: tuple[str, Options],
) -> None:
    root, options = stream_root
    fs, path = shard_path(root, options, "_ledger/trainer/00000000000000000001-x.json")
    pipe(fs, path, b"{not json")
    with pytest.raises(StreamError, match="00000000000000000001-x.json.*unreadable"):
        StreamReader(root, RUN, STREAM, "trainer", storage_options=options)


def test_release_offers_pending_shards_again(stream_root: tuple[str, Options]) -> None:
    root, options = stream_root
    ref = StreamWriter(root, RUN, STREAM, "gen-0", storage_options=options).write(
        make_table(random.Random(9), "r")
    )
    reader = StreamReader(root, RUN, STREAM, "trainer", storage_options=options)
    reader.read(ref)
    assert reader.poll() == [] and reader.pending() == [ref]
    reader.release([ref])
    assert reader.poll() == [ref] and reader.pending() == []


# --------------------------------------------------------------------------- schema helpers


def base_columns() -> dict[str, Any]:
    return {
        "sample_id": ["a", "b", "c"],
        "group_id": ["g", "g", "g"],
        "prompt_id": ["p", "p", "p"],
        "prompt_token_ids": [[1], [1], [1]],
        "finish_reason": ["stop"] * 3,
        "task": ["t"] * 3,
        "worker": ["w"] * 3,
    }


def test_table_from_arrays_accepts_flat_lists_and_derives_versions() -> None:
    # Rows: [7, 8, 9], [10], [11, 12]  ->  offsets [0, 3, 4, 6].
    # token_versions rows [3, 4, 4], [2], [5, 7]: version_start = min = [3, 2, 5],
    # version_end = max = [4, 2, 7].
    columns = base_columns() | {
        "response_token_ids": FlatList(np.arange(7, 13), np.array([0, 3, 4, 6])),
        "behaviour_logprobs": FlatList(
            np.array([-0.5, -1.0, -0.25, -2.0, -0.125, -4.0]), np.array([0, 3, 4, 6])
        ),
        "token_versions": [np.array([3, 4, 4]), np.array([2]), np.array([5, 7])],
        "answer": np.array([1.5, 2.5, 3.5]),
    }
    table = table_from_arrays(columns, stream=STREAM)
    validate_table(table, stream=STREAM)
    assert table.column("response_token_ids").to_pylist() == [[7, 8, 9], [10], [11, 12]]
    assert table.column("version_start").to_pylist() == [3, 2, 5]
    assert table.column("version_end").to_pylist() == [4, 2, 7]
    assert table.column("reward").null_count == 3
    assert table.column("answer").to_pylist() == [1.5, 2.5, 3.5]


def test_table_from_rows_names_the_row_and_column_that_is_missing() -> None:
    rows = make_rows(random.Random(10), "g")
    del rows[2]["prompt_id"]
    with pytest.raises(SchemaError, match="row 2 \\(sample_id='g/2'\\).*'prompt_id'"):
        table_from_rows(rows)
    rows = make_rows(random.Random(10), "g")
    rows[1]["token_versions"] = []
    rows[1]["response_token_ids"] = rows[1]["behaviour_logprobs"] = []
    with pytest.raises(SchemaError, match="row 1.*no token_versions"):
        table_from_rows(rows)
    rows[1] |= {"version_start": 3, "version_end": 3}  # explicit versions make it valid
    assert table_from_rows(rows).column("version_start")[1].as_py() == 3


def test_flat_list_column_is_a_view_over_the_arrow_buffers(tmp_path: Any) -> None:
    writer = StreamWriter(f"file://{tmp_path}", RUN, STREAM, "gen-0")
    ref = writer.write(make_table(random.Random(11), "z", num_groups=2))
    table = StreamReader(f"file://{tmp_path}", RUN, STREAM, "trainer").read(ref)
    array = table.column("response_token_ids").chunk(0)
    flat = flat_list_column(table)
    values_buffer = array.values.buffers()[1]
    assert flat.values.ctypes.data == values_buffer.address + array.values.offset * 4
    assert flat.offsets.ctypes.data == array.buffers()[1].address + array.offset * 4
    assert not flat.values.flags.writeable
    assert len(flat.offsets) == table.num_rows + 1
    assert flat.values.dtype == np.int32 and flat.offsets.dtype == np.int32


def test_shard_ref_round_trips_through_its_url() -> None:
    url = "s3://bucket/run/rollouts/01700000000000000000-gen-0-s00000003-g2-r16.arrow"
    ref = ShardRef.from_url(url)
    assert (ref.writer_id, ref.num_groups, ref.num_rows) == ("gen-0", 2, 16)
    assert ref.commit_time_ns == 1_700_000_000_000_000_000
    assert json.loads(json.dumps(ref.to_dict()))["url"] == url
    with pytest.raises(StreamConfigError, match="not a Sluice shard name"):
        ShardRef.from_url("s3://bucket/run/rollouts/notes.txt")


# --------------------------------------------------------------------------- layouts


def test_an_episode_shard_with_its_loss_mask_reads_back_exactly(tmp_path: Any) -> None:
    rows = make_rows(random.Random(11), "ep-g0", group_size=3)
    for row in rows:  # a tool's observation in the middle of each response
        n = len(row["response_token_ids"])
        row["loss_mask"] = [0 if n // 3 <= t < 2 * n // 3 else 1 for t in range(n)]
    rows[0]["loss_mask"] = None  # a plain response beside them: every token trained
    table = table_from_rows(rows)
    root = f"file://{tmp_path}"
    ref = StreamWriter(root, RUN, STREAM, "gen-0").write(table)
    got = StreamReader(root, RUN, STREAM, "trainer").read(ref)
    assert got.equals(table)
    assert got.column("loss_mask").to_pylist() == [row["loss_mask"] for row in rows]


def test_a_shard_of_the_first_layout_is_still_read_with_every_token_trained(tmp_path: Any) -> None:
    table = make_table(random.Random(12), "old", num_groups=2)
    old = stamped(table.drop_columns(["loss_mask"]), version="1")
    root = f"file://{tmp_path}"
    writer = StreamWriter(root, RUN, STREAM, "gen-0")
    first = writer.write(make_table(random.Random(13), "new"))
    name = f"{first.commit_time_ns + 1:020d}-gen-old-s00000000-g2-r8.arrow"
    put_raw(root, None, name, arrow_bytes(old))
    reader = StreamReader(root, RUN, STREAM, "trainer")
    (_, old_ref) = reader.poll()
    got = reader.read(old_ref)
    assert got.column("loss_mask").null_count == got.num_rows
    assert got.drop_columns(["loss_mask"]).equals(table.drop_columns(["loss_mask"]))
    assert got.schema.metadata[SCHEMA_VERSION_KEY] == SCHEMA_VERSION.encode()
    # Passed on by a stage (the reward role), it commits as the current layout.
    again = StreamWriter(root, RUN, "scored", "reward").write(got)
    assert StreamReader(root, RUN, "scored", "t").read(again).column("loss_mask").null_count == 8


@pytest.mark.parametrize(
    ("mask", "problem"),
    [([1, 0], "'loss_mask' has 2 entries"), (None, "values other than 0 and 1")],
)
def test_a_loss_mask_of_the_wrong_length_or_values_is_refused(mask: Any, problem: str) -> None:
    row = make_rows(random.Random(14), "bad-g0", group_size=1)[0]
    row["response_token_ids"] = row["response_token_ids"][:3] + [7] * max(
        0, 3 - len(row["response_token_ids"])
    )
    row["behaviour_logprobs"] = [-0.1] * 3
    row["token_versions"] = [0] * 3
    row["loss_mask"] = mask if mask is not None else [1, 2, 1]
    with pytest.raises(SchemaError, match=problem):
        table_from_rows([row])
