"""The durability cadence: which published versions become durable, skip, or wait."""

from __future__ import annotations

import random

from sluice.tasks.run.cadence import Cadence


def cadence(every_versions=4, every_s=None, max_lag_s=100.0) -> Cadence:
    return Cadence(every_versions, every_s, max_lag_s, last_durable_version=0, last_durable_at=0.0)


def run(c: Cadence, versions, writing=lambda v: False, must=lambda v: False, dt=1.0):
    out = []
    for v in versions:
        decision = c.decide(v, v * dt, must=must(v), writing=writing(v))
        c.published(v, v * dt, decision)
        out.append(decision)
    return out


def test_every_nth_version_is_durable_and_the_rest_servable():
    assert run(cadence(4), range(1, 9)) == ["servable"] * 3 + ["durable"] + ["servable"] * 3 + [
        "durable"
    ]


def test_every_version_durable_waits_for_the_one_before():
    assert run(cadence(1), [1, 2, 3], writing=lambda v: v > 1) == ["durable", "wait", "wait"]


def test_a_due_version_skips_while_storage_is_busy_and_the_next_one_retries():
    # v4 is due while v... is still being written: skipped; v5 finds storage free.
    assert run(cadence(4), [1, 2, 3, 4, 5], writing=lambda v: v == 4) == [
        "servable",
        "servable",
        "servable",
        "skip",
        "durable",
    ]


def test_a_version_that_must_be_durable_waits_rather_than_skips():
    decisions = run(cadence(4), [1, 2, 3], writing=lambda v: True, must=lambda v: v == 3)
    assert decisions == ["servable", "servable", "wait"]


def test_a_cadence_in_seconds_makes_a_version_durable_when_time_is_up():
    # A version every 10 s, durable every 25 s at most: v3 (30 s) is due by time.
    c = cadence(every_versions=100, every_s=25.0)
    assert run(c, [1, 2, 3, 4], dt=10.0) == ["servable", "servable", "durable", "servable"]


def test_training_waits_once_durability_trails_by_max_lag():
    # Storage never frees up: versions skip until the first one after the newest
    # durable (v1, published at 1 s) is max_lag_s = 5 s old (v6), which waits.
    c = cadence(every_versions=2, max_lag_s=5.0)
    c.last_durable_version = 0
    decisions = run(c, range(1, 8), writing=lambda v: True)
    assert decisions == ["servable", "skip", "skip", "skip", "skip", "wait", "servable"]
    assert c.skipped == 4 and c.last_durable_version == 6


def test_no_two_durable_versions_are_more_than_n_apart_unless_storage_was_busy():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 6)
        c = cadence(n, max_lag_s=1e9)
        busy = {v for v in range(1, 60) if rng.random() < 0.3}
        decisions = run(c, range(1, 60), writing=busy.__contains__)
        made = zip(range(1, 60), decisions, strict=True)
        durable = [0] + [v for v, d in made if d in ("durable", "wait")]
        for a, b in zip(durable, durable[1:], strict=False):
            # Every version in between that was due found storage busy.
            assert all(v in busy for v in range(a + n, b)), (n, a, b)
