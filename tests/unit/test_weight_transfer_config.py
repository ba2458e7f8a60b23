"""Which path a full-weight version takes to the servers (`servers.weight_transfer`), and
the settings refused in one line."""

import pytest

from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import load_config
from sluice.infra.config.servers import weight_transfer_path


def resolved(*overrides: str) -> str:
    return weight_transfer_path(load_config("default", list(overrides)))


def test_auto_takes_disk_on_a_cpu_where_the_page_cache_serves_as_fast():
    assert resolved("device=cpu") == "disk"
    assert resolved("servers.launch=docker") == "disk"  # CPU servers


def test_auto_takes_shared_memory_on_a_cpu_when_versions_between_checkpoints_are_not_written():
    assert resolved("device=cpu", "checkpoint.every_versions=10") == "shared_memory"
    assert resolved("servers.launch=docker", "checkpoint.every_versions=10") == "disk"
    urls = 'rollout.server_urls=["http://10.0.0.5:30000"]'
    assert resolved("device=cpu", "checkpoint.every_versions=10", urls) == "disk"


def test_auto_takes_a_fast_path_for_servers_on_gpus():
    assert resolved("device=cuda") == "shared_memory"  # the embedded server: CUDA IPC
    assert resolved("servers.launch=docker", "servers.gpus_per_server=1") == "distributed"


def test_auto_takes_disk_for_servers_given_by_url():
    assert resolved('rollout.server_urls=["http://10.0.0.5:30000"]') == "disk"


def test_auto_takes_disk_for_lora_adapters_and_the_megatron_backend():
    assert resolved("device=cuda", "trainer.lora.rank=4") == "disk"
    assert resolved("device=cuda", "trainer.backend=megatron") == "disk"


def test_an_explicit_path_is_kept():
    assert resolved("servers.weight_transfer=distributed") == "distributed"
    assert resolved("servers.weight_transfer=disk") == "disk"


def test_lora_keeps_its_adapter_route_whatever_path_is_asked():
    assert resolved("trainer.lora.rank=4", "servers.weight_transfer=distributed") == "disk"


def test_a_fast_path_for_the_megatron_backend_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="use disk or auto"):
        load_config("default", ["trainer.backend=megatron", "servers.weight_transfer=distributed"])


def test_shared_memory_with_servers_by_url_is_refused():
    with pytest.raises(ConfigError, match="only the embedded server shares its host"):
        load_config(
            "default",
            ["servers.weight_transfer=shared_memory", 'rollout.server_urls=["http://h:1"]'],
        )


def test_the_rollout_gives_up_a_fast_path_that_keeps_failing(tmp_path):
    """Three versions in a row that the fast path could not deliver (here: no trainer
    ever published a sender) and later versions go straight to disk, with no deadline
    to wait out each time."""
    import asyncio

    from sluice.infra.serving.client import InferenceClient
    from sluice.tasks.rollout.transfer import GIVE_UP_AFTER, FastPathFailed, FastWeights

    config = load_config("default", [f"storage.url=file://{tmp_path}/store"])
    fast = FastWeights(config, "no-such-run", "shared_memory", "gloo")

    async def attempt(version: int) -> str:
        async with InferenceClient(["http://127.0.0.1:9"]) as client:
            try:
                await fast.load(client, version)
            except FastPathFailed as exc:
                fast.count_failure()  # what the rollout role does while the run goes on
                return str(exc)
        return "delivered"

    answers = [asyncio.run(attempt(v)) for v in range(1, GIVE_UP_AFTER + 2)]
    assert all("has not published its weight sender" in a for a in answers[:GIVE_UP_AFTER])
    assert fast.given_up
    assert f"failed {GIVE_UP_AFTER} versions in a row" in answers[-1]
