"""The trajectory row: one sampled response as every stream stores it (docs/design.md §3).

`TrajectoryRow` has one typed field per stream column, in the order of the Arrow
schema (`sluice.infra.streams.schema.TRAJECTORY_SCHEMA`, whose columns a unit test
holds equal to these fields, names and nullability), then the extra columns the rollout
role writes beside them: the prompt row's own fields, and the episode columns of a
multi-turn sample. The column names code reads from tables are the constants below.

`version_start` and `version_end` are not constructor arguments: the row derives them
from `token_versions` with `version_bounds` (which the episode's turns and the stream
writer's row defaults use too; only the writer's numpy column path computes the same
min/max over whole columns at once), so no row can hold a span its tokens disagree
with. A response without tokens has no span of its own; its builder names the version
that served it (`version_if_empty`).

Why a frozen dataclass and not a TypedDict: a TypedDict is a plain dict at run time,
so nothing would stop a builder from spelling a literal of its own (with a version span
of its own) or a caller from adding a column to a row after the fact; a frozen
dataclass gives the one constructor that derives what can be derived, and rows that
cannot change once built. The row is also a read-only `Mapping` of the columns it
writes, so the stream writer (`table_from_rows`), the verifier's view of a row
(`sluice.engines.rl.samples.row_from_columns`) and the rollout role's counters take it
as they take a row dict built by hand; `as_columns` is that mapping as a plain dict.

Pure: the standard library only, so the storage layer may import it.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any, Protocol

SAMPLE_ID = "sample_id"
GROUP_ID = "group_id"
PROMPT_ID = "prompt_id"
PROMPT_TOKEN_IDS = "prompt_token_ids"
RESPONSE_TOKEN_IDS = "response_token_ids"
BEHAVIOUR_LOGPROBS = "behaviour_logprobs"
TOKEN_VERSIONS = "token_versions"
VERSION_START = "version_start"
VERSION_END = "version_end"
FINISH_REASON = "finish_reason"
REWARD = "reward"
TASK = "task"
WORKER = "worker"
CREATED_AT = "created_at"
LOSS_MASK = "loss_mask"
POLICY_INCARNATION = "policy_incarnation"
PROMPT = "prompt"
ANSWER = "answer"
ROW_JSON = "row_json"
TURNS = "turns"
TOOL_CALLS = "tool_calls"
TOOL_ERRORS = "tool_errors"
TOOL_TIMEOUTS = "tool_timeouts"
SHAPING_REWARD = "shaping_reward"

PROMPT_COLUMNS = (PROMPT, ANSWER, ROW_JSON)
"""Extra columns of every generated row: the prompt row the verifier scores against."""
EPISODE_COLUMNS = (TURNS, TOOL_CALLS, TOOL_ERRORS, TOOL_TIMEOUTS, SHAPING_REWARD)
"""Extra columns of a multi-turn episode's row; a single-turn row writes none of them."""


def version_bounds(token_versions: Sequence[int]) -> tuple[int, int] | None:
    """`(version_start, version_end)` of one response: the oldest and the newest policy
    version among its tokens (design §1); None for a response without tokens."""
    if len(token_versions) == 0:
        return None
    return min(token_versions), max(token_versions)


class SampledResponse(Protocol):
    """One sampled response, what a row is built from: as the in-process engine returns it
    (`sluice.engines.inference.types.GenerationOutput`), as the client decodes it from a
    server (`sluice.infra.serving.protocol.GenerateResponse`, which reads SGLang's
    `output_ids` into `output_token_ids`), or a multi-turn `Episode`."""

    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def behaviour_logprobs(self) -> list[float]: ...
    @property
    def token_versions(self) -> list[int]: ...
    @property
    def finish_reason(self) -> str: ...


def _now_utc() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True, kw_only=True)
class TrajectoryRow(Mapping[str, Any]):
    """One sampled response, as a stream row (fields in column order; see the module)."""

    sample_id: str
    """`{group_id}-{k:03d}`: response k of its prompt group."""
    group_id: str
    """The prompt group (`sluice.engines.rl.groups.group_key` of its issue number)."""
    prompt_id: str
    """The dataset's id of the prompt."""
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    """Generated tokens, and in an episode the tool observations between its turns."""
    behaviour_logprobs: list[float]
    """log π_behav of each response token (0 for an observation token)."""
    token_versions: list[int]
    """Policy version that generated each response token."""
    version_start: int = field(init=False)
    """Oldest version among `token_versions` (derived, never given)."""
    version_end: int = field(init=False)
    """Newest version among `token_versions` (derived, never given)."""
    finish_reason: str
    """`stop`, `length` or `abort`."""
    reward: float | None = None
    """Null until the reward role has scored the response."""
    task: str
    worker: str
    """The writer that generated the row."""
    created_at: datetime.datetime = field(default_factory=_now_utc)
    loss_mask: list[int] | None = None
    """Per response token, 1 = trained, 0 = an observation; None: every token trained."""
    policy_incarnation: int | None = None
    """The trainer incarnation r whose versions generated every token (`token_versions`
    are steps k of it: a group never spans two incarnations). None: written before
    incarnations (read as any)."""
    prompt: str
    answer: str
    """The reference answer, as the dataset row holds it."""
    row_json: str
    """The dataset row's other fields (`sluice.engines.rl.samples.row_json`)."""
    turns: int | None = None
    """Generate calls of the episode; this and the episode columns below are None (and
    not written) for a single-turn response."""
    tool_calls: int | None = None
    tool_errors: int | None = None
    tool_timeouts: int | None = None
    shaping_reward: float | None = None
    """Per-turn shaping the episode earned, added to the verifier's reward on scoring."""
    version_if_empty: InitVar[int | None] = None
    """The version that served a response without tokens (its span then)."""

    def __post_init__(self, version_if_empty: int | None) -> None:
        bounds = version_bounds(self.token_versions)
        if bounds is None:
            if version_if_empty is None:
                raise ValueError(
                    f"sample {self.sample_id!r} has no token_versions: give "
                    "version_if_empty, the policy version that served it"
                )
            bounds = (version_if_empty, version_if_empty)
        # Frozen: the derived fields are set once, here, and never again.
        object.__setattr__(self, VERSION_START, bounds[0])
        object.__setattr__(self, VERSION_END, bounds[1])
        episode = [getattr(self, name) is None for name in EPISODE_COLUMNS]
        if any(episode) and not all(episode):
            raise ValueError(
                f"sample {self.sample_id!r}: an episode gives every one of "
                f"{', '.join(EPISODE_COLUMNS)}, a single-turn response none"
            )

    @property
    def is_episode(self) -> bool:
        """Whether the row is a multi-turn episode (it writes the episode columns)."""
        return self.turns is not None

    def _columns(self) -> tuple[str, ...]:
        return _EPISODE_ROW_COLUMNS if self.is_episode else _SINGLE_TURN_ROW_COLUMNS

    def __getitem__(self, name: str) -> Any:
        if name not in self._columns():
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns())

    def __len__(self) -> int:
        return len(self._columns())

    def as_columns(self) -> dict[str, Any]:
        """The row as the stream writer takes it: column name -> value, in column order."""
        return {name: getattr(self, name) for name in self._columns()}


_EPISODE_ROW_COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TrajectoryRow))
_SINGLE_TURN_ROW_COLUMNS: tuple[str, ...] = tuple(
    name for name in _EPISODE_ROW_COLUMNS if name not in EPISODE_COLUMNS
)
