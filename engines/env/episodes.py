"""A multi-turn episode: the policy writes, calls a tool, reads its output, writes on.

One episode is one sample of a GRPO group. Turn by turn::

    prompt ─► generate (stops at the call's closing token, EOS or the budget)
              ├─ ended on ``call_close``: the call (text after the last ``call_open``)
              │    runs; its output, wrapped in ``observation_template``, is encoded
              │    and appended as observation tokens; the next turn generates after it
              └─ otherwise: the episode ends (EOS: the final answer; budget: truncated)

Everything stays in token ids: each turn is an ordinary generate call on the prompt
plus every token so far (generated and observed), so an SGLang server serves it
unchanged and no text is ever re-tokenized. The sample's response is the concatenation
of every turn's generated tokens and every observation; per response token it records
the behaviour log-prob and policy version of a generated token (an episode that spans
a weight update keeps each token's own version), and ``loss_mask`` 0 for observation
tokens, whose log-prob is 0 and version that of the token before them: they are
context for the trainer, never trained.

Limits: at most ``max_turns`` generate calls, at most ``max_total_tokens`` response
tokens (generated + observed). A call made on the last allowed turn, or an observation
that would not fit the budget, ends the episode with ``length``. A turn aborted by a
weight update ends it with ``abort`` (the rollout role re-issues the whole group).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sluice.engines.trajectory import SampledResponse, version_bounds

ToolOutcome = Literal["ok", "error", "timeout"]


@dataclass(frozen=True)
class EpisodeSpec:
    """How episodes run (bound from the ``episode`` config section and the tokenizer)."""

    call_open: str
    """Text that opens a tool call (``[`` for the built-in task)."""
    call_close: str
    """Text that closes a call; it must be one token (``close_token_id``), so generation
    stops on it the way it stops on EOS."""
    close_token_id: int
    """The token of ``call_close``."""
    observation_template: str = "> {output}\n"
    """How a tool's output is shown to the policy; ``{output}`` is replaced."""
    max_turns: int = 4
    """Most generate calls per episode."""
    max_total_tokens: int = 256
    """Most response tokens per episode, generated and observed together."""
    max_new_tokens_per_turn: int = 128
    """Most tokens one turn may generate (the budget left caps it too)."""


@dataclass(frozen=True)
class ToolResult:
    """What a tool call gave back: the text shown to the policy and how it went."""

    output: str
    outcome: ToolOutcome = "ok"


TurnOutput = SampledResponse
"""One generate call's answer (`sluice.infra.serving.protocol.GenerateResponse` and
`sluice.engines.inference.types.GenerationOutput` fit)."""


Generate = Callable[[list[int], int], Awaitable[TurnOutput]]
"""`(input ids, max new tokens) -> the turn's output`, stopping at ``close_token_id`` too."""
CallTool = Callable[[str], Awaitable[ToolResult]]
"""`call text -> its result`; never raises (errors and timeouts are results)."""


@dataclass
class TurnRecord:
    """One turn of an episode, for metrics."""

    generated_tokens: int
    version_start: int | None
    version_end: int | None
    call: str | None = None
    """The call's text, when the turn ended on one."""
    outcome: ToolOutcome | None = None
    """How the call went; None when the turn made no call (or its call was not run)."""
    observation_tokens: int = 0


@dataclass
class Episode:
    """One sample: the response as the streams store it, and its turns."""

    response_token_ids: list[int] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    turns: list[TurnRecord] = field(default_factory=list)

    @property
    def output_token_ids(self) -> list[int]:
        """The response tokens, under the name a single-turn response has."""
        return self.response_token_ids

    @property
    def tool_calls(self) -> int:
        return sum(t.outcome is not None for t in self.turns)

    @property
    def tool_errors(self) -> int:
        return sum(t.outcome in ("error", "timeout") for t in self.turns)

    @property
    def tool_timeouts(self) -> int:
        return sum(t.outcome == "timeout" for t in self.turns)

    @property
    def observation_tokens(self) -> int:
        return len(self.loss_mask) - sum(self.loss_mask)

    def add_generated(self, turn: TurnOutput) -> None:
        n = len(turn.output_token_ids)
        self.response_token_ids += list(turn.output_token_ids)
        self.behaviour_logprobs += list(turn.behaviour_logprobs)[:n]
        self.token_versions += list(turn.token_versions)[:n]
        self.loss_mask += [1] * n

    def add_observation(self, token_ids: Sequence[int]) -> None:
        version = self.token_versions[-1] if self.token_versions else 0
        self.response_token_ids += list(token_ids)
        self.behaviour_logprobs += [0.0] * len(token_ids)
        self.token_versions += [version] * len(token_ids)
        self.loss_mask += [0] * len(token_ids)


def call_text(turn_text: str, spec: EpisodeSpec) -> str | None:
    """The call a turn's text ends with: after the last ``call_open``, before the
    closing ``call_close``; None when the turn opened no call."""
    body = turn_text.removesuffix(spec.call_close)
    start = body.rfind(spec.call_open)
    if start < 0:
        return None
    return body[start + len(spec.call_open) :]


async def run_episode(
    prompt_ids: Sequence[int],
    spec: EpisodeSpec,
    generate: Generate,
    call_tool: CallTool,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
) -> Episode:
    """Run one episode to its end (see the module docstring for the rules)."""
    episode = Episode()
    context = list(prompt_ids)
    for turn_index in range(spec.max_turns):
        room = spec.max_total_tokens - len(episode.response_token_ids)
        if room <= 0:
            episode.finish_reason = "length"
            return episode
        turn = await generate(context, min(spec.max_new_tokens_per_turn, room))
        start, end = version_bounds(turn.token_versions) or (None, None)
        record = TurnRecord(len(turn.output_token_ids), start, end)
        episode.turns.append(record)
        episode.add_generated(turn)
        context += list(turn.output_token_ids)
        called = (
            turn.finish_reason == "stop"
            and bool(turn.output_token_ids)
            and turn.output_token_ids[-1] == spec.close_token_id
        )
        if not called:
            episode.finish_reason = turn.finish_reason  # stop (EOS), length or abort
            return episode
        record.call = call_text(decode(list(turn.output_token_ids)), spec)
        if turn_index == spec.max_turns - 1:
            episode.finish_reason = "length"  # no turn left to read the answer
            return episode
        if record.call is None:
            result = ToolResult(f"error: a call starts with {spec.call_open!r}", "error")
        else:
            result = await call_tool(record.call)
        record.outcome = result.outcome
        observation = encode(spec.observation_template.format(output=result.output))
        if len(episode.response_token_ids) + len(observation) >= spec.max_total_tokens:
            episode.finish_reason = "length"  # no room to show the output and answer
            return episode
        record.observation_tokens = len(observation)
        episode.add_observation(observation)
        context += observation
    episode.finish_reason = "length"
    return episode


async def run_group(
    prompt_ids: Sequence[int],
    n: int,
    spec: EpisodeSpec,
    generate: Callable[[int], Generate],
    call_tool: CallTool,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
) -> list[Episode]:
    """`n` episodes of one prompt, concurrently (their turns batch on the engine);
    `generate(j)` is sample j's generate call (its own seed)."""
    return list(
        await asyncio.gather(
            *(
                run_episode(prompt_ids, spec, generate(j), call_tool, encode, decode)
                for j in range(n)
            )
        )
    )


# ------------------------------------------------------------------ on an in-process engine


def engine_turns(engine: Any, spec: EpisodeSpec, sampling: Any) -> Generate:
    """Turns on `engine` (started: its scheduler thread batches every episode's turns)
    with `sampling` (`SamplingParams`), stopping at the call's closing token too."""
    from sluice.engines.inference.types import GenerationRequest

    async def turn(input_ids: list[int], max_new_tokens: int) -> TurnOutput:
        params = dataclasses.replace(
            sampling,
            max_new_tokens=max_new_tokens,
            stop_token_ids=(*sampling.stop_token_ids, spec.close_token_id),
        )
        # The engine's `GenerationOutput` is a `TurnOutput` as it stands.
        return await engine.generate_async(GenerationRequest(input_ids, params))

    return turn


def run_on_engine(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    spec: EpisodeSpec,
    sampling_of: Callable[[int], Any],
    call_tool: CallTool,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
) -> list[Episode]:
    """One episode per prompt on an in-process engine, all at once (evaluation, the warm
    start's checks); `sampling_of(i)` is prompt i's `SamplingParams`."""
    engine.start()

    async def episodes() -> list[Episode]:
        return list(
            await asyncio.gather(
                *(
                    run_episode(
                        prompt,
                        spec,
                        engine_turns(engine, spec, sampling_of(i)),
                        call_tool,
                        encode,
                        decode,
                    )
                    for i, prompt in enumerate(prompts)
                )
            )
        )

    return asyncio.run(episodes())


def sync_tool(tool: Callable[[str], str]) -> CallTool:
    """A `CallTool` around a plain function that raises on a bad call (the calculator):
    its error becomes an error observation."""

    async def call(text: str) -> ToolResult:
        try:
            return ToolResult(str(tool(text)))
        except Exception as err:  # noqa: BLE001 - any tool failure is shown to the policy
            return ToolResult(f"error: {err}", "error")

    return call
