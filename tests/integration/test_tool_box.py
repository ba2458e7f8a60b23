"""The rollout role's tool runner with real worker processes: a user tool that answers,
raises, hangs or kills its worker; every call gets an answer in time (tasks/tool_runner.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sluice.tasks.tool_runner import Shaping, ToolBox, ToolSpecError

pytestmark = pytest.mark.integration

PLUGIN = textwrap.dedent(
    """
    import os
    import time
    from pathlib import Path

    def reverse(text):
        return text[::-1]

    def broken(text):
        raise RuntimeError("the tool has a bug")

    def hang(text):
        time.sleep(3600)

    def die(text):
        os._exit(3)

    def nap(text):
        time.sleep(0.3)
        return str(os.getpid())

    def stall(folder):
        Path(folder, "stall-started").touch()
        time.sleep(3600)

    def hold(folder):
        # Runs until the test releases it (or 30 s): it is running when `stall` is killed.
        Path(folder, "hold-started").touch()
        deadline = time.monotonic() + 30
        while not Path(folder, "release").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return "held"

    def mark(text):
        folder, name = text.split()
        Path(folder, name + "-marked").touch()
        return name

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


async def _until(path: Path, bound_s: float = 30.0) -> None:
    deadline = time.monotonic() + bound_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        await asyncio.sleep(0.02)


def test_a_tool_timeout_leaves_other_episodes_running_and_queued_calls_untouched(
    plugin: str, tmp_path: Path
) -> None:
    specs = [f"{plugin}:{name}" for name in ("nap", "stall", "hold", "mark")]
    box = ToolBox(specs, timeout_s=3.0, workers=2)
    folder = tmp_path / "calls"
    folder.mkdir()
    seen: dict[str, bool] = {}
    asked: set[str] = set()

    async def stalled_episode():
        result = await box(f"stall: {folder}")
        # Its worker was killed and is being replaced; the call on the other worker is
        # still running, and the two calls queued behind both have not started.
        seen["hold running"] = not (folder / "release").exists()
        seen["queued, not started"] = asked == {"b", "c"} and not list(folder.glob("*-marked"))
        (folder / "release").touch()
        return result

    async def holding_episode():
        await _until(folder / "stall-started")
        await asyncio.sleep(1.0)  # well inside the stalled call's 3 s
        return await box(f"hold: {folder}")

    async def queued_episode(name: str):
        await _until(folder / "hold-started")  # both workers are busy from here on
        await asyncio.sleep(0.2)
        asked.add(name)
        return await box(f"mark: {folder} {name}")

    async def episodes():
        # Both workers up before any deadline runs: two naps at once on two processes.
        for _ in range(10):
            first, second = await asyncio.gather(box("nap: x"), box("nap: x"))
            if first.output != second.output:
                break
        return await asyncio.gather(
            stalled_episode(),
            holding_episode(),
            queued_episode("b"),
            queued_episode("c"),
        )

    async def bounded():
        return await asyncio.wait_for(episodes(), 60)

    try:
        stalled, held, b, c = asyncio.run(bounded())
    finally:
        box.close()
    assert multiprocessing.active_children() == []
    assert stalled.outcome == "timeout"
    assert (held.output, held.outcome) == ("held", "ok")
    assert [(b.output, b.outcome), (c.output, c.outcome)] == [("b", "ok"), ("c", "ok")]
    assert seen == {"hold running": True, "queued, not started": True}
    assert box.stats()["tool_timeouts"] == 1 and box.stats()["tool_errors"] == 0


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
