"""Staleness gate: the admission rule by hand, and randomised runs with crashes and resumes."""

import random
import threading

import pytest

from sluice.engines.rl.staleness import StalenessGate


def test_admission_follows_floor_n_over_b_by_hand():
    gate = StalenessGate(prompts_per_batch=2, max_staleness=1)
    # version 0: floor(n / 2) <= 0 + 1 admits n = 0, 1, 2, 3
    assert gate.capacity(0) == 4
    assert [gate.try_start(0) for _ in range(5)] == [0, 1, 2, 3, None]
    gate.finish(0)  # accepted: keeps its slot
    gate.abandon(1)  # rejected: frees its slot
    assert gate.capacity(0) == 1
    assert gate.try_start(0) == 4
    assert gate.try_start(0) is None
    # version 1 allows n <= 5: accepted 1 + in flight 3 = 4 used
    assert gate.capacity(1) == 2


def test_zero_staleness_is_synchronous():
    gate = StalenessGate(prompts_per_batch=3, max_staleness=0)
    tickets = [gate.try_start(0) for _ in range(4)]
    assert tickets == [0, 1, 2, None]
    for t in tickets[:3]:
        gate.finish(t)
    assert gate.try_start(0) is None
    assert gate.capacity(1) == 3


def test_finishing_an_unknown_ticket_is_a_clear_error():
    gate = StalenessGate(2, 1)
    t = gate.try_start(0)
    gate.finish(t)
    with pytest.raises(ValueError, match=f"cannot finish group ticket {t}: it is not in flight"):
        gate.finish(t)
    with pytest.raises(ValueError, match="cannot abandon group ticket 99"):
        gate.abandon(99)
    with pytest.raises(ValueError, match="prompts_per_batch must be >= 1"):
        StalenessGate(0, 1)
    with pytest.raises(ValueError, match="groups_consumed"):
        StalenessGate.resume(2, 1, committed_version=1, groups_in_stream=3, groups_consumed=4)


def test_resume_does_not_burst_past_the_bound():
    # B = 4, eta = 2, version 3 committed, 14 groups written, 12 trained (3 batches):
    # n = 3 * 4 + 2 pending = 14, so capacity = (3 + 2 + 1) * 4 - 14 = 10, not 24.
    gate = StalenessGate.resume(4, 2, committed_version=3, groups_in_stream=14, groups_consumed=12)
    assert gate.capacity(3) == 10
    assert StalenessGate(4, 2).capacity(3) == 24


def test_overdue_lists_groups_started_more_than_eta_versions_ago():
    gate = StalenessGate(prompts_per_batch=1, max_staleness=1)
    old = gate.try_start(0)
    newer = gate.try_start(1)
    assert gate.overdue(1) == []
    assert gate.overdue(2) == [old]
    assert gate.overdue(3) == [old, newer]


def _simulate(seed: int, in_order: bool) -> None:
    """Random producers, scorers, a trainer and crashes; check the bound at every admission.

    The simulator keeps its own ground truth: the stream (every accepted group, in
    acceptance order), the trainer's consumed count and version, and what is in flight.
    """
    rng = random.Random(seed)
    batch = rng.randint(1, 5)
    eta = rng.randint(0, 3)
    gate = StalenessGate(batch, eta)
    version = 0
    stream: list[int] = []  # start version of each accepted group, in stream order
    consumed = 0
    running: list[tuple[int, int]] = []  # (ticket, start version), in start order
    admitted = 0
    for _ in range(400):
        event = rng.random()
        if event < 0.45:  # a rollout worker asks to start groups
            for _ in range(rng.randint(1, 4)):
                ticket = gate.try_start(version)
                true_n = len(stream) + len(running)
                if ticket is None:
                    # Refusal only when the rule really forbids this n.
                    assert true_n // batch > version + eta
                    break
                assert true_n // batch <= version + eta
                running.append((ticket, version))
                admitted += 1
        elif event < 0.75 and running:  # a group completes or is rejected
            idx = 0 if in_order else rng.randrange(len(running))
            ticket, started = running.pop(idx)
            if rng.random() < 0.2:
                gate.abandon(ticket)
            else:
                gate.finish(ticket)
                stream.append(started)
        elif event < 0.95:  # the trainer takes the oldest B groups and commits a version
            if len(stream) - consumed >= batch:
                for started in stream[consumed : consumed + batch]:
                    if in_order:
                        assert version - started <= eta
                consumed += batch
                version += 1
        else:  # the rollout process crashes: in-flight groups are lost
            running.clear()
            gate = StalenessGate.resume(
                batch,
                eta,
                committed_version=version,
                groups_in_stream=len(stream),
                groups_consumed=consumed,
            )
    assert admitted > 0 and version > 0


@pytest.mark.parametrize("seed", range(30))
def test_no_group_is_ever_admitted_past_the_bound(seed):
    _simulate(seed, in_order=False)


@pytest.mark.parametrize("seed", range(10))
def test_in_order_completion_trains_every_group_within_eta_versions(seed):
    _simulate(seed, in_order=True)


def test_concurrent_admissions_never_exceed_capacity():
    gate = StalenessGate(prompts_per_batch=4, max_staleness=2)
    tickets: list[int] = []
    lock = threading.Lock()

    def worker():
        for _ in range(50):
            t = gate.try_start(0)
            if t is not None:
                with lock:
                    tickets.append(t)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(tickets) == list(range(12))
