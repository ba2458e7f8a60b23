"""The rollout role's tool runner with real worker processes: a user tool that answers,
raises, hangs or kills its worker; every call gets an answer in time (tasks/tool_runner.py)."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time

import pytest

from sluice.tasks.tool_runner import Shaping, ToolBox, ToolSpecError

pytestmark = pytest.mark.integration

PLUGIN = textwrap.dedent(
    """
    import os
    import time

    def reverse(text):
        return text[::-1]

    def broken(text):
        raise RuntimeError("the tool has a bug")

    def hang(text):
        time.sleep(3600)

    def die(text):
        os._exit(3)

    def penalty(turns):
        return -0.1 * sum(t["outcome"] in ("error", "timeout") for t in turns)

    def broken_hook(turns):
        raise KeyError("outcome")
    """
)


@pytest.fixture
def plugin(tmp_path, monkeypatch) -> str:
    (tmp_path / "episode_tools.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("episode_tools", None)
    return "episode_tools"


def test_user_tools_answer_fail_hang_and_die_without_taking_the_role_down(plugin: str) -> None:
    specs = [f"{plugin}:{name}" for name in ("reverse", "broken", "hang", "die")]
    box = ToolBox([*specs, "calculator"], timeout_s=2.0, workers=1)

    async def calls() -> list:
        results = [await box("reverse: abc"), await box("broken: x")]
        started = time.monotonic()
        results.append(await box("hang: x"))
        results.append(time.monotonic() - started)
        results += [
            await box("die: x"),
            await box("reverse: fresh pool"),
            await box("calculator: 6*7"),
        ]
        return results

    try:
        reverse, broken, hung, waited, died, after, calc = asyncio.run(calls())
    finally:
        box.close()
    assert (reverse.output, reverse.outcome) == ("cba", "ok")
    assert broken.outcome == "error" and "RuntimeError: the tool has a bug" in broken.output
    assert hung.outcome == "timeout" and waited < 2.0 + 5.0
    assert died.outcome == "error" and "worker process died" in died.output
    assert (after.output, calc.output) == ("loop hserf", "42")
    assert box.stats() == {"tool_calls": 6, "tool_errors": 2, "tool_timeouts": 1}


def test_the_python_tool_runs_in_the_sandbox_and_times_out_as_a_timeout() -> None:
    box = ToolBox(["python"], timeout_s=2.0)

    async def calls() -> list:
        return [await box("print(6 * 7)"), await box("1/0"), await box("while True: pass")]

    printed, failed, hung = asyncio.run(calls())
    box.close()
    assert (printed.output, printed.outcome) == ("42", "ok")
    assert failed.outcome == "error" and "ZeroDivisionError" in failed.output
    assert hung.outcome == "timeout" and "timed out" in hung.output
    assert box.stats() == {"tool_calls": 3, "tool_errors": 1, "tool_timeouts": 1}


def test_a_tool_that_cannot_be_loaded_stops_the_role_at_start(plugin: str) -> None:
    with pytest.raises(ToolSpecError, match="cannot be loaded"):
        ToolBox([f"{plugin}:missing"], timeout_s=1.0)
    with pytest.raises(ToolSpecError, match="'module:function'"):
        ToolBox(["search"], timeout_s=1.0)


def test_a_shaping_hook_sees_every_turn_and_a_broken_one_adds_nothing(plugin: str) -> None:
    from sluice.engines.env.episodes import Episode, TurnRecord

    episode = Episode(
        turns=[
            TurnRecord(5, 0, 0, call="1+", outcome="error", observation_tokens=4),
            TurnRecord(5, 0, 0, call="1+1", outcome="ok", observation_tokens=3),
            TurnRecord(3, 1, 1),
        ]
    )
    assert Shaping(f"{plugin}:penalty")(episode) == pytest.approx(-0.1)
    assert Shaping(None)(episode) == 0.0
    broken = Shaping(f"{plugin}:broken_hook")
    assert broken(episode) == 0.0 and broken(episode) == 0.0
    assert broken.failures == 2
    with pytest.raises(ToolSpecError):
        Shaping(f"{plugin}:no_such_hook")
