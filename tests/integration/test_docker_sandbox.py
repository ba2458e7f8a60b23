"""The container sandbox against a real Docker engine: the code verifier scores through
it, every forged verdict of `tests/unit/verdict_hacks.py` scores 0 in it, the `python`
tool runs in it under `reward.sandbox: docker`, a missing image is named, and
containers a dead owner left behind are removed."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.docker]


def test_the_code_verifier_scores_through_containers(sandbox) -> None:
    from sluice.tasks.reward.role import VerifierPool

    pool = VerifierPool("code", 2, 30.0, 1.0, 0.0, sandbox=sandbox)
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
    from sluice.infra.config.run import load_config
    from sluice.infra.docker_sandbox import DockerSandbox
    from sluice.tasks.sandbox import code_sandbox

    chosen = code_sandbox(load_config("default", ["reward.verifier=code", "reward.sandbox_pool=1"]))
    assert isinstance(chosen, DockerSandbox)
    try:
        assert chosen.run_python("x = 1", "assert x == 1").passed
    finally:
        chosen.close()


def test_forged_verdicts_score_zero_in_containers(sandbox) -> None:
    """The same hacks as the process sandbox's test, judged through containers: the
    container's attached stdin/stdout carry the calls, the tests run here."""
    import time

    from sluice.engines.env.verifiers import load_verifier, outcome_of
    from tests.unit.verdict_hacks import ADD_TESTS, HACKS, HONEST, SLOW

    verify = load_verifier("code", timeout_s=2.0, memory_mb=256, sandbox=sandbox)
    row = {"prompt_id": "add", "tests": ADD_TESTS}
    assert sandbox.wait_warm(120)
    assert verify(row, f"```python\n{HONEST}```") == 1.0
    escaped = []
    for name, code in HACKS.items():
        sandbox.wait_warm(120)  # the deadline under test is the run's, not a cold start
        started = time.monotonic()
        score = verify(row, f"```python\n{code}```")
        took = time.monotonic() - started
        if score != 0.0 or took > 2.0 + 5.0 or (name in SLOW) != (outcome_of(score) == "timeout"):
            escaped.append(f"{name}: {float(score)} ({outcome_of(score)}) in {took:.1f} s")
    print(f"\nforged verdicts (docker): tried {len(HACKS)}, scored 0: {len(HACKS) - len(escaped)}")
    assert escaped == []
    assert verify(row, f"```python\n{HONEST}```") == 1.0


def test_the_python_tool_runs_in_the_docker_sandbox_when_configured(sandbox) -> None:
    from sluice.infra.config.run import load_config
    from sluice.infra.docker_sandbox import DockerSandbox
    from sluice.tasks.tool_runner import ToolBox

    config = load_config(
        "default",
        ["episode.tools=[python]", "reward.sandbox=docker", "reward.sandbox_pool=1"],
    )
    box = ToolBox.for_run(config)
    try:
        assert isinstance(box._sandbox, DockerSandbox)
        # Only a container's root has /.dockerenv; the process sandbox runs on the host.
        check = "import os\nprint(os.path.exists('/.dockerenv'), os.getuid())"
        import asyncio

        result = asyncio.run(box(check))
        assert result.output == "True 65534", result
    finally:
        box.close()
