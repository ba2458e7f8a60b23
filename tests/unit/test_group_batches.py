"""The trainer's batches follow issue numbers, so no sample is trained more than eta versions late.

`GroupBuffer` files scored groups by the number the rollout role issued them under;
batch k is numbers kB..kB+B-1 whatever order they finished in. These tests check the
buffer's bookkeeping (shards acked whole, restarts, duplicates), the lost-group check
against real file streams, and, in a simulation of gate + rollout + trainer with
random finishing times, that every sample's lag stays within eta, where taking groups
in finishing order does not.
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pytest

from sluice.engines.rl.groups import (
    GroupBuffer,
    group_index_of,
    group_key,
    sample_index_of,
    sample_seed,
)
from sluice.engines.rl.staleness import StalenessGate
from sluice.infra.streams.errors import CorruptShardError
from sluice.infra.streams.names import ShardRef, shard_key_tag
from sluice.infra.streams.reader import StreamReader
from sluice.infra.streams.schema import table_from_rows
from sluice.infra.streams.writer import StreamWriter
from sluice.tasks.train.role import lost_groups


def ref(name: str, groups: int = 1) -> ShardRef:
    return ShardRef(
        name=name,
        url=f"memory://x/{name}",
        commit_time_ns=0,
        writer_id="w",
        num_groups=groups,
        num_rows=groups,
    )


def groups_table(*indices: int, rows_per_group: int = 2) -> pa.Table:
    return pa.table({"group_id": [group_key(i) for i in indices for _ in range(rows_per_group)]})


def batch_indices(table: pa.Table | None) -> list[int]:
    assert table is not None
    return [group_index_of(g) for g in table.column("group_id").to_pylist()[::2]]


def test_a_batch_is_its_issue_numbers_in_order_whatever_order_they_arrive() -> None:
    buffer = GroupBuffer(prompts_per_batch=4)
    for i in (5, 1, 0, 7, 3):
        assert buffer.add(ref(f"s{i}"), groups_table(i), step=0) == []
    assert buffer.missing(0) == [2]
    buffer.add(ref("s2"), groups_table(2), step=0)
    assert buffer.missing(0) == []
    table, done = buffer.take(0)
    assert batch_indices(table) == [0, 1, 2, 3]
    assert sorted(r.name for r in done) == ["s0", "s1", "s2", "s3"]
    assert buffer.missing(1) == [4, 6]
    assert len(buffer) == 2  # 5 and 7 wait for batch 1


def test_a_shard_spanning_two_batches_is_handed_back_once_both_are_trained() -> None:
    buffer = GroupBuffer(prompts_per_batch=2)
    buffer.add(ref("a", groups=1), groups_table(0), step=0)
    buffer.add(ref("b", groups=2), groups_table(1, 2), step=0)
    buffer.add(ref("c", groups=1), groups_table(3), step=0)
    table, done = buffer.take(0)
    assert batch_indices(table) == [0, 1]
    assert [r.name for r in done] == ["a"]  # b still holds group 2
    table, done = buffer.take(1)
    assert batch_indices(table) == [2, 3]
    assert sorted(r.name for r in done) == ["b", "c"]


def test_after_a_restart_groups_below_the_step_are_dropped_and_their_shard_acked() -> None:
    buffer = GroupBuffer(prompts_per_batch=2)
    warnings = buffer.add(ref("old"), groups_table(1), step=1)
    assert warnings and "trained before" in warnings[0]
    mixed = buffer.add(ref("mixed", groups=2), groups_table(1, 2), step=1)
    assert len(mixed) == 1
    buffer.add(ref("new"), groups_table(3), step=1)
    table, done = buffer.take(1)
    assert batch_indices(table) == [2, 3]
    assert sorted(r.name for r in done) == ["mixed", "new", "old"]


def test_a_second_copy_of_a_group_is_dropped() -> None:
    buffer = GroupBuffer(prompts_per_batch=2)
    buffer.add(ref("first"), groups_table(0), step=0)
    warnings = buffer.add(ref("copy"), groups_table(0), step=0)
    assert warnings and "duplicates one from first" in warnings[0]
    buffer.add(ref("one"), groups_table(1), step=0)
    table, done = buffer.take(0)
    assert batch_indices(table) == [0, 1]
    assert sorted(r.name for r in done) == ["copy", "first", "one"]


def test_a_batch_with_groups_missing_gives_what_is_there_and_none_when_empty() -> None:
    buffer = GroupBuffer(prompts_per_batch=3)
    buffer.add(ref("s1"), groups_table(1), step=0)
    table, _ = buffer.take(0)
    assert batch_indices(table) == [1]
    assert buffer.take(1) == (None, [])


def test_a_batch_is_in_group_then_sample_order_whatever_order_the_rows_were_written() -> None:
    # The synchronous loop trains (group, sample) order; a writer's order must not matter.
    rng = random.Random(3)
    buffer = GroupBuffer(prompts_per_batch=3)

    def shuffled(group: int) -> list[tuple[int, int]]:
        samples = list(range(12))  # 10 and 11 sort after 9 as numbers, as ids too ("-010")
        rng.shuffle(samples)
        return [(group, k) for k in samples]

    for name, rows in (("a", shuffled(2) + shuffled(0)), ("b", shuffled(1))):
        table = pa.table(
            {
                "sample_id": [f"{group_key(g)}-{k:03d}" for g, k in rows],
                "group_id": [group_key(g) for g, _ in rows],
            }
        )
        buffer.add(ref(name, groups=2 if name == "a" else 1), table, step=0)
    table, _ = buffer.take(0)
    assert table is not None
    assert table.column("sample_id").to_pylist() == [
        f"{group_key(g)}-{k:03d}" for g in range(3) for k in range(12)
    ]


def test_group_n_samples_with_the_sync_loops_seeds_sample_j_at_seed_plus_j() -> None:
    # The rollout sends sample_seed(seed, n, 0) with n = G; a server gives sample j seed + j.
    assert sample_seed(7, 3, 1) == 7 * 1_000_003 + 3 * 1009 + 1  # the seeds runs were made with
    seeds = [sample_seed(5, n, 0) + j for n in range(300) for j in range(64)]
    assert seeds == [sample_seed(5, n, j) for n in range(300) for j in range(64)]
    assert len(set(seeds)) == len(seeds)
    assert sample_index_of(f"{group_key(12)}-007") == 7
    with pytest.raises(ValueError, match="not a Sluice sample id"):
        sample_index_of("sample-7")


def test_a_foreign_group_id_is_one_clear_error() -> None:
    buffer = GroupBuffer(prompts_per_batch=2)
    with pytest.raises(ValueError, match="not a Sluice group id"):
        buffer.add(ref("x"), pa.table({"group_id": ["prompt-17"]}), step=0)


def scenario_rows(index: int) -> list[dict[str, object]]:
    return [
        {
            "sample_id": f"{group_key(index)}-{k}",
            "group_id": group_key(index),
            "prompt_id": f"p{index}",
            "prompt_token_ids": [1, 2],
            "response_token_ids": [3, 4],
            "behaviour_logprobs": [-0.1, -0.2],
            "token_versions": [0, 0],
            "finish_reason": "stop",
            "task": "t",
            "worker": "w",
        }
        for k in range(2)
    ]


def test_a_group_is_lost_only_when_a_shard_of_it_was_quarantined(tmp_path: Path) -> None:
    root = f"file://{tmp_path}"
    rollouts = StreamWriter(root, "run", "rollouts", writer_id="rollout")
    scored = StreamWriter(root, "run", "scored", writer_id="reward")
    names = {}
    for i in range(3):
        rows = scenario_rows(i)
        names[i] = rollouts.write(table_from_rows(rows), shard_key=group_key(i)).name
        for row in rows:
            row["reward"] = 1.0
        if i != 1:  # group 1 is not scored yet
            scored.write(table_from_rows(rows), shard_key=names[i])
    audit = StreamReader(root, "run", "scored", consumer="audit")
    (scored_name,) = [r.name for r in audit.committed() if r.tag == shard_key_tag(names[0])]
    # group 0's scored shard and group 2's rollout shard go corrupt on disk
    (tmp_path / "run" / "scored" / scored_name).write_bytes(b"not arrow")
    (tmp_path / "run" / "rollouts" / names[2]).write_bytes(b"garbage")

    rollout_reader = StreamReader(root, "run", "rollouts", consumer="audit")
    scored_reader = StreamReader(root, "run", "scored", consumer="trainer")
    assert lost_groups(rollout_reader, scored_reader, [0]) == []  # corrupt, not yet found out
    with pytest.raises(CorruptShardError):
        scored_reader.read(next(r for r in scored_reader.poll() if r.name == scored_name))
    with pytest.raises(CorruptShardError):
        StreamReader(root, "run", "rollouts", consumer="reward").read(
            next(r for r in rollout_reader.poll() if r.name == names[2])
        )
    assert lost_groups(rollout_reader, scored_reader, [0]) == [0]
    assert lost_groups(rollout_reader, scored_reader, [1]) == []  # still being scored
    assert lost_groups(rollout_reader, scored_reader, [2]) == [2]
    assert lost_groups(rollout_reader, scored_reader, [3]) == []  # never issued yet


# ------------------------------------------------------------------ the staleness bound


def simulate(eta: int, by_issue_number: bool, seed: int, steps: int = 30, B: int = 4) -> int:
    """Largest lag (trainer version - version a group started at) over a simulated run.

    Rollout admits groups through the gate at the version it serves; each group takes
    a long-tailed random time; the trainer takes batch k either as issue numbers
    kB..kB+B-1 (GroupBuffer) or as the first B groups to finish.
    """
    rng = random.Random(seed)
    gate = StalenessGate(B, eta)
    buffer = GroupBuffer(B)
    arrived: list[tuple[int, int]] = []  # (index, version_start) in finishing order
    started_at: dict[int, int] = {}
    running: list[tuple[float, int, int]] = []  # (finish time, index, ticket)
    next_index, version, now, worst = 0, 0, 0.0, 0
    while version < steps:
        while (ticket := gate.try_start(version)) is not None:
            started_at[next_index] = version
            running.append((now + rng.lognormvariate(0, 1.2), next_index, ticket))
            next_index += 1
        running.sort()
        finish, index, ticket = running.pop(0)
        now = finish
        gate.finish(ticket)
        arrived.append((index, started_at[index]))
        buffer.add(ref(f"s{index}"), groups_table(index, rows_per_group=1), step=version)
        while True:
            if by_issue_number:
                if buffer.missing(version):
                    break
                table, _ = buffer.take(version)
                taken = batch_indices_1(table)
            else:
                if len(arrived) < B:
                    break
                taken = [i for i, _ in arrived[:B]]
                del arrived[:B]
            worst = max(worst, max(version - started_at[i] for i in taken))
            version += 1
            if version >= steps:
                break
    return worst


def batch_indices_1(table: pa.Table | None) -> list[int]:
    assert table is not None
    return [group_index_of(g) for g in table.column("group_id").to_pylist()]


@pytest.mark.parametrize("eta", [0, 1, 4])
def test_batches_by_issue_number_keep_every_sample_within_eta(eta: int) -> None:
    worst = max(simulate(eta, by_issue_number=True, seed=s) for s in range(20))
    assert worst <= eta


def test_batches_in_finishing_order_break_the_bound_in_the_same_simulation() -> None:
    worst = max(simulate(1, by_issue_number=False, seed=s) for s in range(20))
    assert worst > 1
