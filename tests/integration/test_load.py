"""The data plane and the registry under concurrent load, at a size CI affords (the
benchmark, tests/benchmarks/bench_load.py, runs the same code with 8 writers and
thousands of shards): nothing lost, nothing acked twice, the alias never goes back and
never names an incomplete checkpoint."""

from __future__ import annotations

import pytest

from tests.benchmarks.bench_load import registry_load, stream_load

pytestmark = pytest.mark.integration


def test_four_writers_and_two_consumers_lose_and_duplicate_nothing(s3_root) -> None:
    root, options = s3_root
    load = stream_load(root, options, writers=4, shards_each=40)
    assert load.shards == 160
    assert (load.lost, load.duplicated) == (0, 0)


def test_alias_polls_during_commits_never_go_back_or_see_a_partial_checkpoint(s3_root) -> None:
    root, options = s3_root
    load = registry_load(root, options, versions=6, pollers=3)
    assert load.polls > load.versions
    assert (load.regressions, load.incomplete, load.missed_last) == (0, 0, 0)
