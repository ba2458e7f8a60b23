"""What the inference-server launcher asks Docker for (no engine needed): each engine's
command line, devices, mounts and network; and the settings it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import load_config
from sluice.tasks.process.servers import server_mounts, server_specs


def _config(tmp_path: Path, *sets: str):
    return load_config(
        "default",
        [f"workdir={tmp_path}/work", f"storage.url=file://{tmp_path}/store", *sets],
    )


def test_sglang_servers_get_their_own_gpus_tensor_parallel_over_them(tmp_path) -> None:
    config = _config(
        tmp_path,
        "servers.launch=docker",
        "servers.engine=sglang",
        "servers.image=sglang:test",
        "servers.count=2",
        "servers.gpus_per_server=2",
        "servers.extra_args=[--mem-fraction-static, '0.7']",
        "rollout.dtype=bfloat16",
        "seed=7",
    )
    specs = server_specs(config, [31001, 31002], tmp_path / "work" / "m", weight_version=3)
    second = specs[1]
    command = second.command()
    assert command[:3] == ["python3", "-m", "sglang.launch_server"]
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert flags["--model-path"] == str((tmp_path / "work" / "m").resolve())
    assert flags["--port"] == "31002" and flags["--host"] == "127.0.0.1"
    assert flags["--tp-size"] == "2" and flags["--weight-version"] == "3"
    assert flags["--dtype"] == "bfloat16" and flags["--random-seed"] == "7"
    assert command[-2:] == ["--mem-fraction-static", "0.7"]

    options = second.run_options("r1", 1)
    assert options["network_mode"] == "host"
    (request,) = options["device_requests"]
    assert request.device_ids == ["2", "3"] and request.capabilities == [["gpu"]]
    assert options["ipc_mode"] == "host"
    assert options["labels"] == {
        "sluice.inference-server": "r1",
        "sluice.inference-server.index": "1",
    }
    assert options["name"] == "sluice-r1-server-1"
    assert second.url == "http://127.0.0.1:31002"


def test_sluice_servers_run_on_cpu_with_the_run_directories_mounted_read_only(tmp_path) -> None:
    config = _config(tmp_path, "servers.launch=docker", "threads_per_role=3")
    (spec,) = server_specs(config, [31005], tmp_path / "work" / "m", weight_version=0)
    assert spec.image == "sluice:local"
    command = spec.command()
    assert command[:3] == ["python", "-m", "sluice.infra.serving.server"]
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert flags["--device"] == "cpu" and flags["--num-threads"] == "3"
    options = spec.run_options("r2", 0)
    assert "device_requests" not in options and "ipc_mode" not in options
    mounts = {str((tmp_path / d).resolve()) for d in ("work", "store")}
    assert options["volumes"] == {p: {"bind": p, "mode": "ro"} for p in mounts}


def test_a_storage_root_inside_the_workdir_is_mounted_through_it(tmp_path) -> None:
    config = load_config(
        "default", [f"workdir={tmp_path}/w", f"storage.url=file://{tmp_path}/w/runs"]
    )
    assert server_mounts(config) == (str((tmp_path / "w").resolve()),)
    remote = load_config("default", [f"workdir={tmp_path}/w", "storage.url=s3://b/runs"])
    assert server_mounts(remote) == (str((tmp_path / "w").resolve()),)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["servers.engine=sglang"], "servers.engine=sglang in containers needs servers.image"),
        (
            ["servers.engine=sglang", "servers.image=x"],
            "servers.engine=sglang needs servers.gpus_per_server >= 1",
        ),
        (
            ["servers.launch=docker", "rollout.server_urls=[http://h:1]"],
            "unset rollout.server_urls or set servers.launch=embedded",
        ),
        (
            ["servers.launch=docker", "rollout.weight_noise_std=0.1"],
            "set servers.launch=embedded or rollout.weight_noise_std=0",
        ),
        (["servers.count=0"], "servers.count"),
        (["servers.launch=ray"], "servers.launch=ray places the servers on the run's Ray cluster"),
    ],
)
def test_launcher_settings_that_cannot_work_are_refused(tmp_path, sets, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        _config(tmp_path, *sets)


def test_the_rollout_role_names_a_missing_server_document(tmp_path) -> None:
    from sluice.tasks.run.control import launched_server_urls, write_launched_servers

    config = _config(tmp_path, "servers.launch=docker")
    with pytest.raises(RuntimeError, match="the `train` flow launches the servers"):
        launched_server_urls(config, "nope")
    write_launched_servers(config, "r3", ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert launched_server_urls(config, "r3") == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
