"""Trajectory streams over the real S3 protocol (s3fs -> moto's S3 server on loopback).

Runs the invariant scenarios of ``tests/unit/test_streams.py`` unchanged, plus the failures
only object storage has: a missing bucket and an endpoint nobody listens on.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from sluice.infra.streams.errors import StreamStorageError
from sluice.infra.streams.reader import StreamReader
from sluice.infra.streams.writer import StreamWriter
from tests.integration.conftest import S3Endpoint
from tests.unit.test_streams import (
    RUN,
    STREAM,
    make_table,
    scenario_a_shard_deleted_after_listing_is_lost_not_fatal,
    scenario_corrupt_and_foreign_shards_are_quarantined,
    scenario_exactly_once_under_crashes,
    scenario_oldest_first,
    scenario_pipeline_stage_output_is_not_duplicated_by_retries,
    scenario_read_next_takes_whole_shards_up_to_max_groups,
    scenario_round_trip,
)

pytestmark = pytest.mark.integration

S3Root = tuple[str, dict[str, Any]]


def test_round_trip_keeps_every_column_and_acks_durably_on_s3(s3_root: S3Root) -> None:
    scenario_round_trip(*s3_root)


def test_poll_offers_shards_oldest_first_on_s3(s3_root: S3Root) -> None:
    scenario_oldest_first(*s3_root)


def test_read_next_takes_whole_shards_up_to_max_groups_on_s3(s3_root: S3Root) -> None:
    scenario_read_next_takes_whole_shards_up_to_max_groups(*s3_root)


def test_corrupt_and_foreign_shards_are_quarantined_on_s3(s3_root: S3Root) -> None:
    scenario_corrupt_and_foreign_shards_are_quarantined(*s3_root)


def test_a_shard_deleted_after_listing_is_lost_not_fatal_on_s3(s3_root: S3Root) -> None:
    scenario_a_shard_deleted_after_listing_is_lost_not_fatal(*s3_root)


@pytest.mark.parametrize("seed", [0, 1])
def test_every_committed_shard_is_consumed_exactly_once_on_s3(s3_root: S3Root, seed: int) -> None:
    scenario_exactly_once_under_crashes(*s3_root, seed=seed, steps=50)


def test_retried_stage_output_is_not_duplicated_on_s3(s3_root: S3Root) -> None:
    scenario_pipeline_stage_output_is_not_duplicated_by_retries(*s3_root, seed=0, num_shards=10)


def test_new_shards_are_seen_by_a_reader_that_already_listed(s3_root: S3Root) -> None:
    # s3fs caches listings by default; a reader that did would never see new commits.
    root, options = s3_root
    writer = StreamWriter(root, RUN, STREAM, "gen-0", storage_options=options)
    reader = StreamReader(root, RUN, STREAM, "trainer", storage_options=options)
    assert reader.poll() == []
    first = writer.write(make_table(random.Random(0), "late"))
    assert reader.poll() == [first]


def test_missing_bucket_gives_one_clear_error(moto_s3: S3Endpoint) -> None:
    with pytest.raises(
        StreamStorageError, match="bucket 'no-such-bucket' of .*s3://no-such-bucket/x"
    ):
        StreamWriter(
            "s3://no-such-bucket/x", RUN, STREAM, "gen-0", storage_options=moto_s3.storage_options()
        )


def test_unreachable_endpoint_gives_one_clear_error_naming_the_url(moto_s3: S3Endpoint) -> None:
    # Port 9 (discard) on loopback: connection refused at once; one botocore attempt.
    options = moto_s3.storage_options(config_kwargs={"retries": {"max_attempts": 1}})
    options["client_kwargs"] = {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"}
    with pytest.raises(StreamStorageError, match="s3://sluice-integration/x.*Could not connect"):
        StreamReader("s3://sluice-integration/x", RUN, STREAM, "trainer", storage_options=options)
