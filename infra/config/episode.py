"""The `episode` section: multi-turn episodes in which the policy calls tools between
turns (engines/env/episodes.py)."""

from __future__ import annotations

from pydantic import Field

from sluice.infra.config.section import Section


class EpisodeConfig(Section):
    """Multi-turn episodes: the policy calls tools between turns (engines/env/episodes.py). Off while `tools` is empty: one response per sample."""

    tools: list[str] = []
    """Tools the policy may call: `calculator` (bounded arithmetic), `python` (the call runs as a
    program in the reward sandbox; its output is what it printed), or a user tool `module:function`
    taking the call's text and returning its output (imported in a worker process, run with
    `tool_timeout_s`). With several tools a call reads `name: input`. Empty: single-turn rollouts."""
    call_open: str = "["
    """Text that opens a tool call in the policy's output."""
    call_close: str = "]"
    """Text that closes a call and ends the turn; it must be one token of the policy's tokenizer (generation stops on it as on EOS), e.g. `</tool_call>` for Qwen."""
    observation_template: str = "> {output}\n"
    """How a tool's output is appended for the policy to read; `{output}` is replaced. These observation tokens are context: never trained (`loss_mask` 0)."""
    max_turns: int = Field(4, ge=1, le=64)
    """Most generate calls per episode; a call made on the last one is not run and the episode ends as truncated."""
    max_total_tokens: int = Field(256, ge=1)
    """Most response tokens per episode, generated and observed together; each turn generates at most `rollout.max_new_tokens` of them."""
    tool_timeout_s: float = Field(5.0, gt=0, le=3600)
    """Deadline of one tool call; a call past it shows the policy an error and is counted as a timeout."""
    tool_workers: int = Field(2, ge=1, le=256)
    """Worker processes that run user tools (calculator and python need none)."""
    shaping: str | None = None
    """Per-turn reward shaping: `module:function` called with an episode's turns (a list of dicts
    with `generated_tokens`, `call`, `outcome` (ok, error, timeout or None) and
    `observation_tokens`) and returning a number added to the final-answer reward, e.g. a small
    penalty per failed call. None: the final answer alone."""
