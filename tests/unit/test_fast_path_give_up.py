"""The rollout role gives a fast weight path up after GIVE_UP_AFTER versions in a row it
failed to deliver while the run went on, but not for the versions it cannot deliver
once the trainer is done and gone: every run ends that way, and counting those gave
the path up (and loaded the last version from disk, uncounted) at the end of every
run. The sender here is a real HTTP address nobody listens on. (That failures while
the run goes on do give the path up: tests/unit/test_weight_transfer_config.py.)"""

import asyncio
import socket
import time

import pytest

from sluice.infra.registry import CommittedVersion
from sluice.infra.serving.client import InferenceClient
from sluice.tasks.rollout.transfer import FastWeights
from sluice.tasks.rollout.weights import ServedWeights


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def version(number: int) -> CommittedVersion:
    return CommittedVersion(
        policy_version=number,
        checkpoint_uri=f"file:///nowhere/v{number}",
        model_version=number + 1,
        trainer_step=number,
        run_id=None,
        checkpoint_digest=None,
        created_at_ms=int(time.time() * 1000),
        tags={},
    )


@pytest.fixture
def fast(tmp_path, local_run_config):
    config = local_run_config(tmp_path, "servers.weight_transfer=distributed")
    weights = FastWeights(config, "r", "distributed", "gloo")
    weights.sender_url = f"http://127.0.0.1:{closed_port()}"  # the trainer is gone
    yield config, weights
    asyncio.run(weights.aclose())


def test_versions_the_gone_trainer_cannot_deliver_after_the_run_never_give_the_path_up(
    tmp_path, fast
):
    config, path = fast
    served = ServedWeights(config, tmp_path / "cache", run_over=lambda: True)
    served.fast = path

    async def updates() -> list[bool]:
        client = InferenceClient([f"http://127.0.0.1:{closed_port()}"])
        try:
            return [await served.load(client, {}, version(v)) for v in range(1, 6)]
        finally:
            await client.aclose()

    assert asyncio.run(updates()) == [False] * 5  # not loaded, and not from disk either
    assert not path.given_up
    assert served.stats.weight_fallbacks == 0
    assert served.stats.weight_bytes_moved == 0
