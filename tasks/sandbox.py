"""Where model-generated code runs: the container sandbox of a run, or None for the
process one.

Two rooms run such code: the reward role's `code` verifier (tasks/reward/role.py) and the
`python` tool of an episode (tasks/tool_runner.py, used by the rollout and evaluate
roles and the warm start). Both choose by the same `reward.sandbox`, so tool calls run
where code rewards do; the choice lives here, in neither room.
"""

from __future__ import annotations

import logging
from typing import Any

from sluice.engines.env import confinement
from sluice.infra.config.run import RunConfig

log = logging.getLogger("sluice.reward")


def code_sandbox(config: RunConfig, *, for_tools: bool = False) -> Any:
    """The container sandbox the `code` verifier runs in, or None for the process one.

    `reward.sandbox: auto` takes containers where the docker package (the `docker`
    extra), an engine and the image are there, and says once why it does not otherwise;
    `docker` insists (``SandboxUnavailable``; the CLI refuses it without the extra).
    `for_tools`: the sandbox of the `python` tool (`episode.tools`), chosen by the same
    `reward.sandbox` whatever the verifier, so tool calls run where code rewards do.
    """
    reward = config.reward
    if reward.sandbox == "process":
        if for_tools or reward.verifier == "code":
            log.info("reward.sandbox=process: %s", confinement.probe().line())
        return None
    if for_tools and "python" not in config.episode.tools:
        return None
    if not for_tools and reward.verifier != "code":
        return None
    from sluice.infra.docker_sandbox import DockerSandbox, SandboxUnavailable

    try:
        return DockerSandbox(reward.sandbox_image, pool_size=reward.sandbox_pool)
    except SandboxUnavailable as exc:
        if reward.sandbox == "docker":
            raise
        controls = confinement.probe()
        if not controls.complete:
            raise SandboxUnavailable(
                f"reward.sandbox=auto: {exc}; the process sandbox does not isolate here "
                f"({controls.line()}); set reward.sandbox: process to run model code in it "
                "anyway"
            ) from exc
        log.warning(
            "reward.sandbox=auto: %s; running code in the process sandbox (%s)",
            exc,
            controls.line(),
        )
        return None
