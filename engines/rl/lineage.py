"""Which samples hold tokens of lost policy versions (docs/design.md §2, after a crash).

A trainer that restarts goes on from the newest durable version (r, k0); the versions
its predecessor served after k0 are lost, and so is every group holding a token of one:
it is dropped (counted), and its issue number issued again, as a new attempt. Lost
versions are always a suffix of one incarnation's steps (everything incarnation r
served after the step the next trainer started from), so the registry's lost versions
reduce to `lost_after` = {r: k0}, and a sample is lost iff its incarnation has an entry
and its newest token (`version_end`) is past it. A sample never spans two incarnations
(the rollout drops a group whose incarnation changed before it finished), so its
incarnation and token versions name every (r, k) it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import pyarrow as pa

from sluice.engines.rl.groups import group_index_of
from sluice.engines.trajectory import GROUP_ID, POLICY_INCARNATION, VERSION_END

LostAfter = Mapping[int, int]
"""{incarnation r: the step k0 after which every version of r was lost}."""

ATTEMPT_SEPARATOR = ".attempt-"


def lost_after(lost: Iterable[tuple[int, int]]) -> dict[int, int]:
    """`LostAfter` of the lost versions `lost`, given as (r, k) pairs."""
    out: dict[int, int] = {}
    for incarnation, step in lost:
        out[incarnation] = min(out.get(incarnation, step), step)
    return {r: k - 1 for r, k in out.items()}


def lost_rows(table: pa.Table, lost: LostAfter) -> np.ndarray:
    """Per row of `table`, whether it holds a token of a lost version. Rows written
    before incarnations (a null ``policy_incarnation``) predate every loss."""
    if not lost or POLICY_INCARNATION not in table.column_names:
        return np.zeros(table.num_rows, dtype=bool)
    incarnation = table.column(POLICY_INCARNATION).to_numpy(zero_copy_only=False)
    end = table.column(VERSION_END).to_numpy(zero_copy_only=False).astype(np.int64)
    out = np.zeros(table.num_rows, dtype=bool)
    for r, k0 in lost.items():
        out |= (incarnation == r) & (end > k0)
    return out


def lost_groups(table: pa.Table, lost: LostAfter) -> set[int]:
    """Issue numbers of the groups in `table` holding a token of a lost version."""
    rows = lost_rows(table, lost)
    if not rows.any():
        return set()
    ids = table.column(GROUP_ID).to_pylist()
    return {group_index_of(ids[i]) for i in np.flatnonzero(rows)}


def attempt_key(group_key: str, attempt: int) -> str:
    """The shard key of `attempt` of a group (0: the group's own key, as before attempts):
    a re-issued group is a new shard, never a write the stream takes for a retry."""
    return group_key if attempt == 0 else f"{group_key}{ATTEMPT_SEPARATOR}{attempt}"
