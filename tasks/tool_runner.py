"""The rollout role's tool runner: every call gets an answer in time, whatever the tool does.

`ToolBox` routes a call's text to its tool (`sluice.engines.env.tools.route_call`) and turns any
outcome into a `ToolResult` the episode can show the policy: the output, an error, or
a timeout. Nothing a tool does reaches the role as an exception.

- ``calculator`` runs inline: bounded arithmetic, microseconds.
- ``python`` runs the call in the sandbox the `code` verifier uses (`reward.sandbox`:
  a container of a warm pool, or the process sandbox; killed at its deadline), from a
  thread so the event loop keeps serving other episodes (`ToolBox.for_run`).
- a user tool ``module:function`` runs in a pool of spawned worker processes that
  imported it once (`CallPool`); a call past ``timeout_s`` is answered as a timeout and
  a call that kills its worker as an error, and only that call's worker is replaced:
  other episodes' calls, running or queued, get their own answers. A path that does not
  import, or names no function, stops the role at start in one line (`ToolSpecError`).
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import logging
import math
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from pebble import ProcessExpired

from sluice.engines.env.episodes import EpisodeSpec, ToolResult
from sluice.engines.env.tools import (
    ToolError,
    ToolFn,
    ToolTimeout,
    calculator,
    python_tool,
    route_call,
)
from sluice.infra.config.run import RunConfig
from sluice.tasks.call_pool import CallPool

log = logging.getLogger("sluice.tools")

BUILTIN_TOOLS = ("calculator", "python")


class ToolSpecError(ValueError):
    """A configured tool that cannot be loaded."""


def load_user_tool(spec: str) -> ToolFn:
    """The function `module:function` names; ToolSpecError naming what is wrong."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ToolSpecError(f"tool {spec!r}: expected calculator, python or 'module:function'")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ToolSpecError(f"tool {spec!r} cannot be loaded: {err}") from None
    if not callable(function):
        raise ToolSpecError(f"tool {spec!r} is not callable")
    return function  # type: ignore[no-any-return]


class UserTools:
    """What a tool worker calls: every user tool, imported once per worker process."""

    def __init__(self, specs: list[str]) -> None:
        self.functions = {spec: load_user_tool(spec) for spec in specs}

    def __call__(self, spec: str, text: str) -> str:
        return str(self.functions[spec](text))


def tool_name(spec: str) -> str:
    """What a call names a tool by: the builtin's name, or a user tool's function name."""
    return spec if spec in BUILTIN_TOOLS else spec.rpartition(":")[2]


class ToolBox:
    """The tools of one run, callable as ``await toolbox(call_text)``."""

    def __init__(
        self, specs: list[str], timeout_s: float, workers: int = 2, *, sandbox: Any = None
    ) -> None:
        """`sandbox`: where ``python`` calls run (a container sandbox, closed with the
        box; None: the process sandbox)."""
        self.timeout_s = timeout_s
        self._sandbox = sandbox
        self.workers = workers
        self.calls = self.errors = self.timeouts = 0
        self._user_specs = [s for s in specs if s not in BUILTIN_TOOLS]
        for spec in self._user_specs:
            load_user_tool(spec)  # fail at start, in one line, not on the first call
        self._routes: dict[str, str] = {tool_name(spec): spec for spec in specs}
        if len(self._routes) != len(specs):
            raise ToolSpecError(f"two tools share a name in {specs}")
        self._python = (
            python_tool(timeout_s=timeout_s, sandbox=sandbox) if "python" in specs else None
        )
        self._pool = CallPool(workers, timeout_s, UserTools, self._user_specs)

    async def __call__(self, call: str) -> ToolResult:
        self.calls += 1
        try:
            name, text = route_call(call, self._routes.keys())
            output = await self._run(self._routes[name], text)
        except (TimeoutError, ToolTimeout):
            self.timeouts += 1
            return ToolResult(f"error: timed out after {self.timeout_s:g} s", "timeout")
        except ToolError as err:
            self.errors += 1
            return ToolResult(f"error: {err}", "error")
        except Exception as err:  # noqa: BLE001 - a user tool's bug is an answer, not a crash
            self.errors += 1
            return ToolResult(f"error: {type(err).__name__}: {err}", "error")
        return ToolResult(output)

    async def _run(self, spec: str, text: str) -> str:
        if spec == "calculator":
            return calculator(text)
        if spec == "python":
            assert self._python is not None
            return await asyncio.to_thread(self._python, text)
        try:
            return str(await self._pool.run(spec, text))
        except TimeoutError:
            log.warning(
                "tool %s timed out after %g s; its worker is replaced", spec, self.timeout_s
            )
            raise
        except (ProcessExpired, BrokenProcessPool):
            raise ToolError("the tool's worker process died") from None

    def stats(self) -> dict[str, int]:
        return {
            "tool_calls": self.calls,
            "tool_errors": self.errors,
            "tool_timeouts": self.timeouts,
        }

    @classmethod
    def for_run(cls, config: RunConfig) -> ToolBox:
        """The run's tools, ``python`` in the sandbox `reward.sandbox` chooses (the
        `code` verifier's: `sluice.tasks.sandbox.code_sandbox`)."""
        from sluice.tasks.sandbox import code_sandbox

        episode = config.episode
        sandbox = code_sandbox(config, for_tools=True)
        try:
            return cls(episode.tools, episode.tool_timeout_s, episode.tool_workers, sandbox=sandbox)
        except BaseException:
            if sandbox is not None:
                sandbox.close()
            raise

    def close(self) -> None:
        self._pool.close()
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None


def episode_spec(config: RunConfig, tokenizer: Any) -> EpisodeSpec:
    """The episode rules of a run; its call's closing text must be one token."""
    cfg = config.episode
    close = tokenizer.encode(cfg.call_close, add_special_tokens=False)
    if len(close) != 1:
        raise ValueError(
            f"episode.call_close={cfg.call_close!r} is {len(close)} tokens of the policy's "
            "tokenizer; generation can only stop on one token: pick text that is a single "
            "token (e.g. '</tool_call>' for Qwen, ']' for the built-in tiny model)"
        )
    return EpisodeSpec(
        call_open=cfg.call_open,
        call_close=cfg.call_close,
        close_token_id=int(close[0]),
        observation_template=cfg.observation_template,
        max_turns=cfg.max_turns,
        max_total_tokens=cfg.max_total_tokens,
        max_new_tokens_per_turn=config.rollout.max_new_tokens,
    )


def plain_tool(config: RunConfig) -> ToolFn:
    """The run's tools as one plain function of a call's text, in this process (the
    warm start's held-out check: a few hundred calls, no worker pool)."""
    from sluice.tasks.sandbox import code_sandbox

    functions: dict[str, ToolFn] = {}
    for spec in config.episode.tools:
        if spec == "calculator":
            functions[tool_name(spec)] = calculator
        elif spec == "python":
            sandbox = code_sandbox(config, for_tools=True)
            if sandbox is not None:  # containers of a pool: removed when the process ends
                atexit.register(sandbox.close)
            timeout_s = config.episode.tool_timeout_s
            functions[tool_name(spec)] = python_tool(timeout_s=timeout_s, sandbox=sandbox)
        else:
            functions[tool_name(spec)] = load_user_tool(spec)

    def call(text: str) -> str:
        name, argument = route_call(text, functions)
        return functions[name](argument)

    return call


class Shaping:
    """The run's per-turn shaping hook (`episode.shaping`), called safely: a hook that
    raises or returns something not finite adds 0 and is counted, never crashes."""

    def __init__(self, spec: str | None) -> None:
        self.failures = 0
        self._hook = load_user_tool(spec) if spec else None

    def __call__(self, episode: Any) -> float:
        if self._hook is None:
            return 0.0
        turns = [
            {
                "generated_tokens": t.generated_tokens,
                "call": t.call,
                "outcome": t.outcome,
                "observation_tokens": t.observation_tokens,
            }
            for t in episode.turns
        ]
        try:
            value = float(self._hook(turns))  # type: ignore[arg-type]
        except Exception as err:  # noqa: BLE001 - a user hook's bug costs its bonus only
            self.failures += 1
            if self.failures == 1:
                log.warning(
                    "episode.shaping raised %r; adding 0 (counted as shaping_failures)", err
                )
            return 0.0
        if not math.isfinite(value):
            self.failures += 1
            return 0.0
        return value
