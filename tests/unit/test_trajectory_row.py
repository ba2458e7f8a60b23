"""The typed trajectory row (engines/trajectory.py): the version span it derives, an
empty response, the episode columns, its agreement with the Arrow schema, and the table
the rollout role's rows become."""

from __future__ import annotations

import dataclasses
import datetime
import typing
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pytest

from sluice.engines import trajectory
from sluice.engines.env.episodes import Episode, TurnRecord
from sluice.engines.rl.samples import group_rows, version_span
from sluice.engines.trajectory import (
    EPISODE_COLUMNS,
    PROMPT_COLUMNS,
    TrajectoryRow,
    version_bounds,
)
from sluice.infra.streams.schema import TRAJECTORY_SCHEMA, table_from_rows

WHEN = datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
PROMPT_ROW = {"prompt_id": 17, "prompt": "1+2=", "answer": "3", "task": "sum", "num_terms": 2}


def make_row(token_versions: list[int], **fields: Any) -> TrajectoryRow:
    n = len(token_versions)
    return TrajectoryRow(
        sample_id="group-000000001-000",
        group_id="group-000000001",
        prompt_id="p",
        prompt_token_ids=[1, 2],
        response_token_ids=[7] * n,
        behaviour_logprobs=[-0.5] * n,
        token_versions=token_versions,
        finish_reason="stop",
        task="sum",
        worker="rollout-0",
        created_at=WHEN,
        prompt="1+2=",
        answer="3",
        row_json="{}",
        **fields,
    )


@dataclass(frozen=True)
class Response:
    output_token_ids: list[int]
    behaviour_logprobs: list[float]
    token_versions: list[int]
    finish_reason: str


def two_episodes() -> list[Episode]:
    # Episode 0: 2 tokens at v3, a 1-token observation, 1 token at v4 (one call, ok).
    # Episode 1: one turn of 1 token at v4, no call.
    return [
        Episode(
            [5, 6, 9, 7], [-0.1, -0.2, 0.0, -0.4], [3, 3, 3, 4], [1, 1, 0, 1], "stop",
            [TurnRecord(2, 3, 3, "1+1", "ok", 1), TurnRecord(1, 4, 4)],
        ),
        Episode([8], [-0.5], [4], [1], "length", [TurnRecord(1, 4, 4)]),
    ]  # fmt: skip


def test_the_version_span_is_derived_once_from_the_token_versions() -> None:
    # token_versions [3, 3, 4]: version_start = min = 3, version_end = max = 4, span 1.
    row = make_row([3, 3, 4])
    assert (row.version_start, row.version_end) == (3, 4)
    assert version_bounds([3, 3, 4]) == (3, 4) and version_span([3, 3, 4]) == 1
    with pytest.raises(TypeError, match="version_start"):
        make_row([3, 3, 4], version_start=0)  # never given: derived only
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.version_end = 9  # type: ignore[misc]


def test_an_empty_response_spans_the_version_that_served_it() -> None:
    assert version_bounds([]) is None and version_span([]) == 0
    row = make_row([], version_if_empty=5)
    assert (row.version_start, row.version_end) == (5, 5)
    assert row.response_token_ids == [] and row[trajectory.VERSION_END] == 5
    with pytest.raises(ValueError, match="no token_versions"):
        make_row([])
    # Tokens decide when there are any; the serving version is for an empty response only.
    assert make_row([2], version_if_empty=5).version_start == 2


def test_an_episode_row_carries_its_episode_columns_and_a_single_turn_row_none() -> None:
    episodes = two_episodes()
    rows = group_rows(13, PROMPT_ROW, [1, 2], episodes, "rollout-9", shaping_rewards=[0.5, 0.0])
    first = rows[0].as_columns()
    assert first["loss_mask"] == [1, 1, 0, 1]
    assert (first["turns"], first["tool_calls"], first["tool_errors"]) == (2, 1, 0)
    assert (first["tool_timeouts"], first["shaping_reward"]) == (0, 0.5)
    assert (rows[0].version_start, rows[0].version_end) == (3, 4)
    assert rows[1].turns == 1 and rows[1].tool_calls == 0 and rows[1].is_episode
    single = group_rows(12, PROMPT_ROW, [1, 2], [Response([5], [-0.1], [3], "stop")], "w")[0]
    assert not single.is_episode and single.loss_mask is None
    assert not set(EPISODE_COLUMNS) & set(single.as_columns())
    assert single.get("turns", 0) == 0 and "loss_mask" in single
    with pytest.raises(ValueError, match="shaping_rewards"):
        group_rows(13, PROMPT_ROW, [1, 2], episodes, "rollout-9")
    with pytest.raises(ValueError, match="an episode gives every one"):
        make_row([3], turns=1)


def test_the_row_fields_and_the_arrow_schema_columns_agree() -> None:
    python_type = {
        "string": str,
        "int32": int,
        "float": float,
        "timestamp[ms, tz=UTC]": datetime.datetime,
        "list<item: int32>": list[int],
        "list<item: float>": list[float],
        "list<item: uint8>": list[int],
    }
    hints = typing.get_type_hints(TrajectoryRow)
    fields = [f.name for f in dataclasses.fields(TrajectoryRow)]
    extras = [*PROMPT_COLUMNS, *EPISODE_COLUMNS]
    assert fields == [*TRAJECTORY_SCHEMA.names, *extras]  # same columns, same order
    for column in TRAJECTORY_SCHEMA:
        hint, args = hints[column.name], typing.get_args(hints[column.name])
        nullable = type(None) in args  # `X | None`
        assert nullable == column.nullable, column.name
        bare = next(a for a in args if a is not type(None)) if nullable else hint
        assert bare == python_type[str(column.type)], column.name
    assert not set(extras) & set(TRAJECTORY_SCHEMA.names)
    # Every column-name constant names a field (and is spelled as its field is).
    constants = {v for k, v in vars(trajectory).items() if k.isupper() and isinstance(v, str)}
    assert constants == set(fields)


def test_the_rows_of_a_group_make_the_table_the_row_dicts_made_before() -> None:
    # The rows the rollout role wrote as dicts, spelled out: the shards must not change.
    results = [Response([5, 6], [-0.1, -0.2], [3, 4], "stop"), Response([7], [-0.3], [3], "length")]
    rows = group_rows(12, PROMPT_ROW, [1, 2], results, "rollout-9")
    episode_rows = group_rows(
        13, PROMPT_ROW, [1, 2], two_episodes(), "rollout-9", shaping_rewards=[0.5, 0.0]
    )
    prompt = {"prompt": "1+2=", "answer": "3", "row_json": '{"num_terms": 2}'}
    by_hand = [
        {
            "sample_id": f"group-000000012-{k:03d}", "group_id": "group-000000012",
            "prompt_id": "17", "prompt_token_ids": [1, 2], "response_token_ids": r.output_token_ids,
            "behaviour_logprobs": r.behaviour_logprobs, "token_versions": r.token_versions,
            "finish_reason": r.finish_reason, "reward": None, "task": "sum",
            "worker": "rollout-9", **prompt,
        }
        for k, r in enumerate(results)
    ]  # fmt: skip
    episode_by_hand = [
        {
            "sample_id": f"group-000000013-{k:03d}", "group_id": "group-000000013",
            "prompt_id": "17", "prompt_token_ids": [1, 2],
            "response_token_ids": e.response_token_ids,
            "behaviour_logprobs": e.behaviour_logprobs, "token_versions": e.token_versions,
            "finish_reason": e.finish_reason, "reward": None, "task": "sum",
            "worker": "rollout-9", **prompt, "loss_mask": e.loss_mask, "turns": len(e.turns),
            "tool_calls": e.tool_calls, "tool_errors": e.tool_errors,
            "tool_timeouts": e.tool_timeouts, "shaping_reward": shaping,
        }
        for k, (e, shaping) in enumerate(zip(two_episodes(), [0.5, 0.0], strict=True))
    ]  # fmt: skip
    for typed, plain in ((rows, by_hand), (episode_rows, episode_by_hand)):
        table = table_from_rows(typed, stream="rollouts")
        expected = table_from_rows(plain, stream="rollouts")
        assert table.schema.equals(expected.schema, check_metadata=True)
        assert table.drop_columns(["created_at"]).equals(expected.drop_columns(["created_at"]))
        assert table.column("created_at").type == pa.timestamp("ms", tz="UTC")
        assert table.column("created_at").null_count == 0
        assert table_from_rows([r.as_columns() for r in typed]).equals(table)
