"""The container sandbox against a real Docker engine: the code verifier scores through
it, a missing image is named, and containers a dead owner left behind are removed."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.docker]


def test_the_code_verifier_scores_through_containers(sandbox) -> None:
    from sluice.tasks.reward import VerifierPool

    pool = VerifierPool("code", 2, 30.0, 1.0, 0.0, run_python=sandbox.run_python)
    asserts = {"tests": "assert square(3) == 9\nassert square(-2) == 4"}
    io_pairs = {"tests": {"inputs": ["3\n", "5\n"], "outputs": ["9", "25"]}}
    rows = [asserts, asserts, io_pairs, io_pairs]
    texts = [
        "```python\ndef square(x):\n    return x * x\n```",
        "```python\ndef square(x):\n    return 2 * x\n```",
        "```python\nn = int(input())\nprint(n * n)\n```",
        "```python\nn = int(input())\nprint(n + n)\n```",
    ]
    assert pool.score(rows, texts) == [1.0, 0.0, 1.0, 0.0]
    pool.close()


def test_a_missing_sandbox_image_is_named(sandbox) -> None:  # (the engine is up)
    from sluice.infra.docker_sandbox import DockerSandbox, SandboxUnavailable

    with pytest.raises(SandboxUnavailable, match="'sluice-base:no-such-tag' is missing"):
        DockerSandbox("sluice-base:no-such-tag")


def test_containers_left_by_a_dead_owner_are_removed(sandbox) -> None:
    from sluice.infra.docker_sandbox import LABEL, DockerSandbox

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid nothing owns any more
    orphan = sandbox.client.containers.create(
        sandbox.image, ["true"], labels={LABEL: f"{socket.gethostname()}:{gone.pid}:0"}
    )
    DockerSandbox(sandbox.image, pool_size=1).close()
    left = [
        c.id
        for c in sandbox.client.containers.list(all=True, sparse=True, filters={"label": LABEL})
    ]
    assert orphan.id not in left


def test_auto_takes_containers_where_an_engine_answers(sandbox) -> None:
    from sluice.infra.config import load_config
    from sluice.infra.docker_sandbox import DockerSandbox
    from sluice.tasks.reward import code_sandbox

    chosen = code_sandbox(load_config("default", ["reward.verifier=code", "reward.sandbox_pool=1"]))
    assert isinstance(chosen, DockerSandbox)
    try:
        assert chosen.run_python("x = 1", "assert x == 1").passed
    finally:
        chosen.close()
