"""Dynamic sampling with refill: every batch holds B informative groups, the groups
whose rewards are all equal are dropped and counted, nothing is lost or taken twice,
and the staleness bound holds for every trained sample, also across a restart."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from sluice.engines.rl.groups import GroupBuffer, group_index_of, group_key, informative
from sluice.engines.rl.staleness import StalenessGate
from sluice.infra.config.run import load_config
from sluice.infra.streams.reader import StreamReader
from sluice.infra.streams.schema import table_from_rows
from sluice.infra.streams.writer import StreamWriter
from sluice.tasks.rollout.refill import UninformativeGroups
from tests.unit.test_group_batches import ref, scenario_rows


def scored(index: int, rewards: tuple[float, ...]) -> pa.Table:
    return pa.table({"group_id": [group_key(index)] * len(rewards), "reward": list(rewards)})


MIXED, EQUAL = (0.0, 1.0), (1.0, 1.0)


def numbers(table: pa.Table | None) -> list[int]:
    assert table is not None
    return sorted({group_index_of(g) for g in table.column("group_id").to_pylist()})


def test_informative_means_the_rewards_differ():
    assert informative([0.0, 1.0]) and informative([0.5, 0.5, 0.2])
    assert not informative([1.0, 1.0]) and not informative([0.0]) and not informative([])


def test_a_batch_is_the_next_b_informative_groups_and_drops_the_rest():
    buffer = GroupBuffer(prompts_per_batch=2, refill=True)
    for i, rewards in enumerate([EQUAL, MIXED, EQUAL, EQUAL, MIXED, MIXED]):
        buffer.add(ref(f"s{i}"), scored(i, rewards), step=0)
    assert buffer.missing(0) == []
    table, done = buffer.take(0)
    # 1 and 4 are informative; 0, 2 and 3 between them are dropped, their shards done.
    assert numbers(table) == [1, 4]
    assert (buffer.last_drawn, buffer.last_dropped, buffer.cursor) == (5, 3, 5)
    assert sorted(r.name for r in done) == ["s0", "s1", "s2", "s3", "s4"]
    assert buffer.missing(1) == [6]  # 5 is informative; batch 1 waits for one more
    buffer.add(ref("s6"), scored(6, MIXED), step=1)
    assert numbers(buffer.take(1)[0]) == [5, 6]


def test_a_batch_waits_for_the_next_number_in_order_and_passes_over_a_lost_one():
    buffer = GroupBuffer(prompts_per_batch=2, refill=True)
    buffer.add(ref("s0"), scored(0, MIXED), step=0)
    buffer.add(ref("s2"), scored(2, MIXED), step=0)
    assert buffer.missing(0) == [1]  # 2 is there, but 1 comes first
    buffer.lost.add(1)
    assert buffer.missing(0) == []
    table, _ = buffer.take(0)
    assert numbers(table) == [0, 2] and buffer.cursor == 3 and not buffer.lost


def test_after_a_restart_groups_below_the_recorded_cursor_were_taken_before():
    buffer = GroupBuffer(prompts_per_batch=1, refill=True)
    buffer.cursor = 3  # what the committed version recorded
    warnings = buffer.add(ref("old"), scored(2, MIXED), step=1)
    assert warnings and "trained before" in warnings[0]
    buffer.add(ref("new"), scored(3, MIXED), step=1)
    table, done = buffer.take(1)
    assert numbers(table) == [3] and sorted(r.name for r in done) == ["new", "old"]


def test_released_slots_let_the_gate_start_new_groups():
    gate = StalenessGate(prompts_per_batch=2, max_staleness=0)
    tickets = [gate.try_start(0) for _ in range(2)]
    assert gate.try_start(0) is None
    for ticket in tickets:
        gate.finish(ticket)
    gate.release(1)  # one of them was uninformative
    assert gate.try_start(0) is not None and gate.try_start(0) is None
    with pytest.raises(ValueError):
        gate.release(-1)


def test_the_rollout_side_reads_uninformative_groups_from_the_scored_stream_once(tmp_path):
    root = f"file://{tmp_path}"
    writer = StreamWriter(root, "run", "scored", writer_id="reward")

    def write(index, rewards):
        rows = scenario_rows(index)
        for row, reward in zip(rows, rewards, strict=True):
            row["reward"] = reward
        writer.write(table_from_rows(rows), shard_key=group_key(index))

    write(0, EQUAL)
    write(1, MIXED)
    watch = UninformativeGroups(StreamReader(root, "run", "scored", consumer="rollout-refill"))
    assert watch.poll() == 1 and watch.numbers == {0}
    write(2, (0.0, 0.0))
    assert watch.poll() == 1 and watch.poll() == 0 and watch.numbers == {0, 2}
    # A restarted role reads them all again, so its gate is re-based the same way.
    again = UninformativeGroups(StreamReader(root, "run", "scored", consumer="rollout-refill"))
    assert again.poll() == 2


def test_dynamic_sampling_is_refused_by_the_colocated_baseline_in_one_line():
    from sluice.flows.train_sync import train_sync

    config = load_config(None, ["trainer.dynamic_sampling=true"])
    with pytest.raises(ValueError, match="dynamic_sampling refills batches"):
        train_sync.fn(config)


# ------------------------------------------------------------------ invariants


def simulate(eta: int, seed: int, p_informative: float, steps: int = 25, B: int = 4) -> dict:
    """Gate + rollout + reward + trainer with long-tailed generation and scoring times;
    half-way the rollout and trainer restart from durable state (the recorded cursor,
    the stream's groups, the scored rewards). Returns what the invariants need."""
    rng = random.Random(seed)
    informative_of: dict[int, bool] = {}
    started_at: dict[int, int] = {}
    written: list[int] = []
    scored_at: list[tuple[float, int]] = []  # (when the reward role publishes it, index)
    known: set[int] = set()  # uninformative groups the rollout learned of
    gate = StalenessGate(B, eta)
    buffer = GroupBuffer(B, refill=True)
    running: list[tuple[float, int, int]] = []
    next_index = version = 0
    now = 0.0
    batches: list[list[int]] = []
    dropped: list[int] = []
    recorded_cursor = 0
    restarted = False
    while version < steps:
        if not restarted and version == steps // 2:  # both roles die and come back
            restarted = True
            running.clear()  # in flight: never reached the stream, issued again
            buffer = GroupBuffer(B, refill=True)
            buffer.cursor = recorded_cursor
            scored_now = {i for t, i in scored_at if t <= now}
            known = {i for i in scored_now if not informative_of[i]}
            gate = StalenessGate(B, eta, accepted=len(written))
            gate.release(len(known))
            next_index = max(written) + 1
            reissue = sorted(set(range(next_index)) - set(written))
            for t, i in scored_at:
                if t <= now and i >= buffer.cursor:
                    buffer.add(ref(f"s{i}"), table_of(i, informative_of), step=version)
        else:
            reissue = []
        while (ticket := gate.try_start(version)) is not None:
            index = reissue.pop(0) if reissue else next_index
            next_index = max(next_index, index + 1)
            started_at[index] = version
            informative_of.setdefault(index, rng.random() < p_informative)
            running.append((now + rng.lognormvariate(0, 1.0), index, ticket))
        running.sort()
        if running:
            now, index, ticket = running.pop(0)
            gate.finish(ticket)
            written.append(index)
            scored_at.append((now + rng.expovariate(2.0), index))
        else:  # the gate is full: time moves on to the next group the reward role scores
            now = min(t for t, _ in scored_at if t > now)
        # The reward role publishes what is due; the rollout reads it; so does the trainer.
        for t, i in sorted(scored_at):
            if t <= now and i not in known and not informative_of[i]:
                known.add(i)
                gate.release(1)
        for t, i in scored_at:
            if t <= now and i >= buffer.cursor:
                buffer.add(ref(f"s{i}"), table_of(i, informative_of), step=version)
        while not buffer.missing(version) and version < steps:
            table, _ = buffer.take(version)
            batch = numbers(table)
            dropped.extend(
                i for i in range(buffer.cursor - buffer.last_drawn, buffer.cursor) if i not in batch
            )
            batches.append([(i, version - started_at[i]) for i in batch])
            version += 1
            recorded_cursor = buffer.cursor
    return {
        "batches": batches,
        "dropped": dropped,
        "cursor": recorded_cursor,
        "inf": informative_of,
    }


def table_of(index: int, informative_of: dict[int, bool]) -> pa.Table:
    return scored(index, MIXED if informative_of[index] else EQUAL)


@pytest.mark.parametrize("eta", [0, 1, 3])
@pytest.mark.parametrize("p_informative", [0.3, 0.7])
def test_every_batch_is_full_fresh_enough_and_nothing_is_lost_or_taken_twice(eta, p_informative):
    for seed in range(8):
        run = simulate(eta, seed, p_informative)
        B = 4
        assert all(len(batch) == B for batch in run["batches"])  # refilled, never shrunk
        assert max(lag for batch in run["batches"] for _, lag in batch) <= eta
        trained = [i for batch in run["batches"] for i, _ in batch]
        taken = sorted(trained + run["dropped"])
        # Every number below the cursor was trained or dropped, exactly once.
        assert taken == list(range(run["cursor"])), (seed, eta)
        assert all(run["inf"][i] for i in trained)
        assert not any(run["inf"][i] for i in run["dropped"])
