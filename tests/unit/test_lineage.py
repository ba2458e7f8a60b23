"""Samples holding tokens of lost versions (engines/rl/lineage.py), worked by hand."""

from __future__ import annotations

import pyarrow as pa

from sluice.engines.rl.lineage import attempt_key, lost_after, lost_groups, lost_rows


def table(rows):
    """rows: (group index, incarnation or None, version_end)."""
    return pa.table(
        {
            "group_id": [f"group-{g:09d}" for g, _, _ in rows],
            "policy_incarnation": pa.array([r for _, r, _ in rows], pa.int32()),
            "version_end": pa.array([k for _, _, k in rows], pa.int32()),
        }
    )


def test_lost_versions_reduce_to_the_step_each_incarnation_was_lost_after():
    # Incarnation 1 served up to 124 but only 120 was durable; incarnation 2 served
    # 121..123 and none became durable before the next restart went back to (1, 120).
    lost = [(1, 121), (1, 122), (1, 124), (1, 123), (2, 121), (2, 122), (2, 123)]
    assert lost_after(lost) == {1: 120, 2: 120}
    assert lost_after([]) == {}


def test_a_sample_is_lost_when_its_newest_token_is_past_its_incarnations_durable_step():
    t = table(
        [
            (7, 1, 120),  # incarnation 1 up to its durable step: kept
            (8, 1, 121),  # one token of a lost version: lost
            (8, 1, 119),  # the rest of group 8 is lost with it
            (9, 2, 125),  # incarnation 2 lost nothing
            (10, None, 300),  # written before incarnations: nothing was lost then
            (11, 0, 0),  # version 0
        ]
    )
    assert lost_rows(t, {1: 120}).tolist() == [False, True, False, False, False, False]
    assert lost_groups(t, {1: 120}) == {8}
    assert lost_groups(t, {}) == set()


def test_a_reissued_group_writes_under_a_key_of_its_own():
    assert attempt_key("group-000000003", 0) == "group-000000003"
    assert attempt_key("group-000000003", 2) == "group-000000003.attempt-2"
