"""Multi-turn episodes: the turn rules, what each response token records, the built-in
tools and how a call reaches its tool (engines/env/episodes.py, engines/env/tools.py).

The policy here is a script of turns, each a real `GenerateResponse`-shaped answer,
so every rule is checked exactly; tests/integration runs episodes on the engine."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from sluice.engines.env.episodes import EpisodeSpec, ToolResult, call_text, run_episode
from sluice.engines.env.tools import ToolError, calculator, python_tool, route_call

EOS = 3


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids if i != EOS)


SPEC = EpisodeSpec(
    call_open="[", call_close="]", close_token_id=ord("]"), max_turns=3, max_total_tokens=64
)


@dataclass
class Turn:
    output_token_ids: list[int]
    behaviour_logprobs: list[float]
    token_versions: list[int]
    finish_reason: str


def turn(text: str, version: int, end: str = "call") -> Turn:
    ids = encode(text) + ([EOS] if end == "eos" else [])
    finish = "length" if end == "length" else ("abort" if end == "abort" else "stop")
    return Turn(ids, [-0.5] * len(ids), [version] * len(ids), finish)


class ScriptedPolicy:
    """Answers each generate call with the next scripted turn; keeps what it was asked."""

    def __init__(self, *turns: Turn) -> None:
        self.turns = list(turns)
        self.asked: list[tuple[list[int], int]] = []

    async def __call__(self, input_ids: list[int], max_new_tokens: int) -> Turn:
        self.asked.append((list(input_ids), max_new_tokens))
        return self.turns.pop(0)


async def calculate(call: str) -> ToolResult:
    try:
        return ToolResult(calculator(call))
    except ToolError as err:
        return ToolResult(f"error: {err}", "error")


def run(policy: ScriptedPolicy, spec: EpisodeSpec = SPEC, prompt: str = "37*48+19:"):
    return asyncio.run(run_episode(encode(prompt), spec, policy, calculate, encode, decode))


def test_a_call_runs_its_tool_and_the_answer_comes_after_the_observation() -> None:
    # A weight update lands between the turns: each token keeps its own version.
    policy = ScriptedPolicy(turn("[37*48+19]", version=4), turn("1795", version=5, end="eos"))
    episode = run(policy)
    assert decode(episode.response_token_ids) == "[37*48+19]> 1795\n1795"
    assert episode.finish_reason == "stop"
    observed = len("> 1795\n")
    assert episode.loss_mask == [1] * 10 + [0] * observed + [1] * 5
    assert episode.behaviour_logprobs == [-0.5] * 10 + [0.0] * observed + [-0.5] * 5
    assert episode.token_versions == [4] * (10 + observed) + [5] * 5
    assert (episode.tool_calls, episode.tool_errors, episode.observation_tokens) == (1, 0, 7)
    assert [(t.version_start, t.version_end, t.outcome) for t in episode.turns] == [
        (4, 4, "ok"),
        (5, 5, None),
    ]
    # The second turn saw the prompt, the call and the observation, as token ids.
    second_input, second_budget = policy.asked[1]
    assert second_input == encode("37*48+19:[37*48+19]> 1795\n")
    assert second_budget == SPEC.max_total_tokens - len("[37*48+19]> 1795\n")


def test_a_tool_error_is_shown_to_the_policy_and_counted() -> None:
    episode = run(ScriptedPolicy(turn("[2+*3]", 0), turn("[2*3]", 0), turn("6", 0, "eos")))
    assert decode(episode.response_token_ids).startswith("[2+*3]> error: cannot read")
    assert (episode.tool_calls, episode.tool_errors) == (2, 1)
    assert episode.finish_reason == "stop"


def test_a_call_without_its_opening_is_an_error_observation() -> None:
    episode = run(ScriptedPolicy(turn("6*7]", 0), turn("42", 0, "eos")))
    assert "error: a call starts with '['" in decode(episode.response_token_ids)
    assert episode.tool_errors == 1


def test_a_call_on_the_last_turn_ends_the_episode_without_running_it() -> None:
    policy = ScriptedPolicy(turn("[1+1]", 0), turn("[2+2]", 0), turn("[3+3]", 0))
    episode = run(policy)
    assert episode.finish_reason == "length"
    assert len(episode.turns) == 3 and episode.tool_calls == 2
    assert decode(episode.response_token_ids).endswith("[3+3]")


def test_the_token_budget_caps_each_turn_and_an_observation_that_does_not_fit() -> None:
    tight = EpisodeSpec("[", "]", ord("]"), max_turns=4, max_total_tokens=12)
    policy = ScriptedPolicy(turn("[99*99]", 0))
    episode = run(policy, tight)
    assert policy.asked[0][1] == 12
    assert episode.finish_reason == "length"  # "> 9801\n" would leave no room to answer
    assert episode.observation_tokens == 0 and episode.tool_calls == 1


def test_an_aborted_turn_ends_the_episode_as_aborted() -> None:
    episode = run(ScriptedPolicy(turn("[1+1]", 0), turn("2", 1, end="abort")))
    assert episode.finish_reason == "abort"


def test_the_call_is_the_text_after_the_last_opening() -> None:
    assert call_text("think [no] then [6*7]", SPEC) == "6*7"
    assert call_text("6*7]", SPEC) is None


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("37*48+19", "1795"),
        ("7/2", "3.5"),
        ("-(2**10) // 3", "-342"),
        ("-7 % 3", "2"),
        ("1/3", "0.333333333333"),
    ],
)
def test_the_calculator_does_exact_arithmetic(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("__import__('os').system('true')", "only numbers"),
        ("1/0", "division by zero"),
        ("10**50", "too large"),
        ("2**0.5", "whole number"),
        ("9**9**9", "whole number"),
        ("", "empty"),
        ("1 +", "cannot read"),
    ],
)
def test_the_calculator_refuses_anything_but_bounded_arithmetic(
    expression: str, problem: str
) -> None:
    with pytest.raises(ToolError, match=problem):
        calculator(expression)


def test_the_python_tool_prints_and_reports_errors_and_timeouts() -> None:
    run_code = python_tool(timeout_s=2)
    assert run_code("print(6 * 7)") == "42"
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        run_code("1/0")
    with pytest.raises(ToolError, match="timed out"):
        run_code("while True: pass")


def test_one_tool_takes_the_whole_call_and_several_need_a_name() -> None:
    assert route_call("1+2", {"calculator"}) == ("calculator", "1+2")
    both = {"calculator", "python"}
    assert route_call("python: print(1)", both) == ("python", "print(1)")
    with pytest.raises(ToolError, match="among calculator, python"):
        route_call("search: cats", both)


def test_episode_metrics_count_turns_calls_observations_and_per_turn_staleness() -> None:
    from sluice.engines.rl.samples import episode_stats, staleness_stats, turn_starts
    from sluice.infra.streams.schema import table_from_rows

    def row(i, mask, versions, turns, calls, errors):
        n = len(mask)
        return {
            "sample_id": f"s{i}", "group_id": "g", "prompt_id": "p", "prompt_token_ids": [1],
            "response_token_ids": [7] * n, "behaviour_logprobs": [-0.1] * n,
            "token_versions": versions, "finish_reason": "stop", "task": "t", "worker": "w",
            "loss_mask": mask, "turns": turns, "tool_calls": calls, "tool_errors": errors,
        }  # fmt: skip

    # Episode 0: turn 1 at v3, observation, turn 2 at v5. Episode 1: one turn at v4.
    table = table_from_rows(
        [
            row(0, [1, 1, 0, 0, 1, 1], [3, 3, 3, 3, 5, 5], turns=2, calls=1, errors=0),
            row(1, [1, 1], [4, 4], turns=1, calls=0, errors=0),
        ]
    )
    assert turn_starts([1, 1, 0, 0, 1, 1]) == [0, 4]
    stats = episode_stats(table)
    assert stats["episode/turns_mean"] == 1.5 and stats["episode/calling_fraction"] == 0.5
    assert stats["episode/observation_token_share"] == 2 / 8
    assert stats["episode/tool_error_rate"] == 0.0
    staleness = staleness_stats(table, policy_version=6)
    # Turn lags: 6-3, 6-5 and 6-4; the last turns: 6-5 and 6-4.
    assert staleness["staleness/turn_mean"] == (3 + 1 + 2) / 3
    assert staleness["staleness/turn_max"] == 3
    assert staleness["staleness/last_turn_mean"] == (1 + 2) / 2
    single = table_from_rows([{**row(2, [1], [0], 1, 0, 0), "loss_mask": None}])
    assert "staleness/turn_mean" not in staleness_stats(single, 1)


def test_shaping_earned_in_the_episode_is_added_to_the_verifiers_reward() -> None:
    from sluice.engines.rl.samples import score_table
    from sluice.infra.streams.schema import table_from_rows

    rows = [
        {
            "sample_id": f"s{i}", "group_id": "g", "prompt_id": "p", "prompt_token_ids": [1],
            "response_token_ids": [7], "behaviour_logprobs": [-0.1], "token_versions": [0],
            "finish_reason": "stop", "task": "t", "worker": "w", "prompt": "q", "answer": "a",
            "row_json": "{}", "shaping_reward": shaping,
        }
        for i, shaping in enumerate([-0.25, 0.0, None])
    ]  # fmt: skip
    scored = score_table(table_from_rows(rows), lambda rows, texts: [1.0] * len(rows), str)
    assert scored.column("reward").to_pylist() == [0.75, 1.0, 1.0]
