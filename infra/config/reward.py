"""The `reward` section: how responses are scored, where model-written code runs, and
the reward shaping applied before the advantages."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sluice.infra.config.section import Section


class RewardConfig(Section):
    """Scoring of responses."""

    verifier: str = "builtin"
    """`builtin`, `math`, `code`, `reasoning_gym` (the task's own scoring, for `problem.name: reasoning_gym`), or an import path `package.module:function(row, response_text) -> float`."""
    correct_reward: float = 1.0
    """Reward of a verified-correct response."""
    incorrect_reward: float = 0.0
    """Reward of a wrong, unparsable or timed-out response."""
    num_workers: int = Field(1, ge=1, le=256)
    """Verifier worker processes."""
    timeout_s: float = Field(10.0, gt=0)
    """Wall-clock limit per verifier call; a timeout scores `incorrect_reward`."""
    sandbox: Literal["auto", "process", "docker"] = "auto"
    """Where the `code` verifier runs model-written code: `docker` (a fresh container per run from
    `sandbox_image`: no network, read-only root, memory, CPU and pids limits, the deadline enforced
    from outside; needs a Docker engine, e.g. `bash infra/docker/engine.sh`, and refuses to start
    without one), `process` (a subprocess under kernel controls: a PID namespace, an unprivileged
    uid, Landlock and seccomp, with Python-level guards and rlimits; no engine needed; its start-up
    line names the controls this machine applies, docs/sandboxes.md), or `auto`: docker where an
    engine and the image answer, else process only where all four kernel controls apply (otherwise
    the role refuses to start in one line; set `process` to run model code there anyway). The
    `python` tool of multi-turn episodes runs in the same sandbox. Other verifiers run no code and
    start no sandbox."""
    sandbox_image: str = "sluice-base:bookworm"
    """Image of the docker sandbox's containers: any image with /usr/bin/python3 (`infra/docker/engine.sh` builds this one)."""
    sandbox_pool: int = Field(2, ge=0, le=64)
    """Containers the docker sandbox keeps started ahead: a run takes one (start-up is seconds, a
    run often less), so size it to the reward role's `num_workers`. 0 = start each run's container
    when it comes."""
    poll_interval_s: float = Field(0.25, gt=0)
    """How often the reward role lists the rollouts stream when it has nothing to score."""
    overlong_buffer_tokens: int = Field(0, ge=0)
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): a response longer than
    `rollout.max_new_tokens` minus this many tokens loses reward linearly, down to
    `overlong_penalty` at the cap; 0 = off. Applied by the trainer before the advantages
    (`reward/shaping_mean`). verl: `reward_model.overlong_buffer.len`."""
    overlong_penalty: float = Field(1.0, ge=0)
    """Reward lost by a response that reaches the cap (`overlong_buffer_tokens`). verl: `reward_model.overlong_buffer.penalty_factor`."""
    numeric_closeness: float = Field(0.0, ge=0, lt=1)
    """Partial credit kappa for a wrong numeric answer, training rewards only (`verifier:
    reasoning_gym`): it scores as if the task gave kappa * max(0, 1 - |answer - gold| / max(|gold|,
    1)), so a group whose answers are all wrong still ranks them by how far off they are; held-out
    accuracy stays exact. 0 = off. No anchor has the key: verl and TRL take a custom reward function
    for this."""
