"""Cluster mode's rules: what a Ray cluster needs, refused in one line before anything
starts; the config the nodes read; the head's address probed with a deadline."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from sluice.flows.cluster import (
    ClusterError,
    check_nodes_reach_api,
    node_config,
    probe_address,
    worker_env,
)
from sluice.infra.config.cluster import ClusterConfig, RolePlacement, cluster_requirements
from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import load_config

CLUSTER = ["cluster.engine=ray", "cluster.address=head:6379"]


def test_local_mode_and_a_one_node_instance_need_nothing_more() -> None:
    assert cluster_requirements(ClusterConfig(), "file://.sluice/runs", "sqlite:///x.db") == []
    one_node = ClusterConfig(engine="ray")
    assert cluster_requirements(one_node, "file://.sluice/runs", "sqlite:///x.db") == []


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        ([], "storage.url=file://.sluice/runs is this machine's disk"),
        (["storage.url=memory://x"], "lives inside one process"),
        (
            ["storage.url=file:///shared/runs", "tracking.uri=http://mlflow:5000"],
            "cluster.shared_filesystem=true",
        ),
        (
            ["storage.url=file://runs", "cluster.shared_filesystem=true"],
            "is a relative path",
        ),
        (["storage.url=ftp://host/runs"], "cannot tell whether every node reaches 'ftp://'"),
        (["storage.url=s3://bucket/runs"], "tracking.uri=sqlite:///.sluice/mlflow.db is a file"),
    ],
)
def test_a_cluster_without_shared_storage_or_tracking_is_refused_in_one_line(
    overrides: list[str], names: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, [*CLUSTER, *overrides])
    message = str(caught.value)
    assert names in message
    assert "\n" not in message
    assert message.startswith("--set: cluster.engine=ray at head:6379: ")


def test_a_cluster_with_object_storage_and_a_tracking_server_is_accepted() -> None:
    config = load_config(
        None, [*CLUSTER, "storage.url=s3://bucket/runs", "tracking.uri=http://mlflow:5000"]
    )
    assert config.cluster.engine == "ray"
    shared = load_config(
        None,
        [
            *CLUSTER,
            "storage.url=file:///nfs/runs",
            "cluster.shared_filesystem=true",
            "tracking.uri=https://mlflow.example",
        ],
    )
    assert shared.storage.url == "file:///nfs/runs"


def test_a_placement_becomes_ray_options_and_sync_goes_where_train_goes() -> None:
    placed = RolePlacement(num_cpus=2, num_gpus=1, resources={"node_type_train": 1})
    assert placed.ray_options() == {
        "num_cpus": 2.0,
        "num_gpus": 1.0,
        "resources": {"node_type_train": 1.0},
    }
    assert RolePlacement().ray_options() == {"num_cpus": 1.0, "num_gpus": 0.0}
    cluster = ClusterConfig(train=placed)
    assert cluster.placement("sync") is cluster.train
    with pytest.raises(KeyError):
        cluster.placement("nobody")
    with pytest.raises(ConfigError, match="resource amounts must be > 0"):
        load_config(None, ["cluster.reward.resources={gpu_node: 0}"])


def test_the_nodes_config_has_every_local_path_absolute(tmp_path: Path) -> None:
    config = load_config(None, ["cluster.engine=ray"])
    shipped = node_config(config, cwd=tmp_path)
    assert shipped.workdir == str(tmp_path / ".sluice")
    assert shipped.storage.url == f"file://{tmp_path}/.sluice/runs"
    assert shipped.tracking.uri == f"sqlite:///{tmp_path}/.sluice/mlflow.db"
    assert shipped.tracking.artifact_location == str(tmp_path / ".sluice/mlartifacts")
    # Remote URLs stay as they are; node_workdir replaces the workdir.
    remote = load_config(
        None,
        [
            *CLUSTER,
            "storage.url=s3://bucket/runs",
            "tracking.uri=http://mlflow:5000",
            "tracking.artifact_location=s3://bucket/artifacts",
            "cluster.node_workdir=/var/lib/sluice",
        ],
    )
    shipped = node_config(remote, cwd=tmp_path)
    assert (shipped.workdir, shipped.storage.url) == ("/var/lib/sluice", "s3://bucket/runs")
    assert shipped.tracking.uri == "http://mlflow:5000"
    assert shipped.tracking.artifact_location == "s3://bucket/artifacts"


def test_workers_get_the_prefect_api_and_the_configured_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sluice.flows.cluster import FORWARDED_ENV

    for name in FORWARDED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    config = load_config(None, ["cluster.engine=ray", "cluster.env={HF_HOME: /cache}"])
    env = worker_env(config, "http://10.0.0.5:4200/api")
    assert env == {
        "DO_NOT_TRACK": "true",
        "HF_HOME": "/cache",
        "PREFECT_API_URL": "http://10.0.0.5:4200/api",
    }


def test_a_loopback_prefect_api_is_refused_when_a_node_is_elsewhere() -> None:
    check_nodes_reach_api("http://127.0.0.1:4200/api", ["127.0.0.1"])
    check_nodes_reach_api("http://10.0.0.5:4200/api", ["10.0.0.7", "10.0.0.8"])
    with pytest.raises(ClusterError, match=r"Ray node\(s\) at 203\.0\.113\.9 cannot reach"):
        check_nodes_reach_api("http://localhost:4200/api", ["127.0.0.1", "203.0.113.9"])


def test_a_head_address_nothing_answers_is_refused_within_the_deadline() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(ClusterError, match=f"cannot join the Ray cluster at 127.0.0.1:{port}"):
        probe_address(f"127.0.0.1:{port}", timeout_s=2)
    assert time.monotonic() - started < 5
    with pytest.raises(ClusterError, match="expected auto, HOST:PORT"):
        probe_address("head-without-port")
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        probe_address(f"ray://127.0.0.1:{listening.getsockname()[1]}")
    probe_address("auto")


def test_a_placement_no_node_offers_is_refused_naming_what_the_nodes_offer() -> None:
    from sluice.flows.cluster import check_placement_fits

    offered = [
        {"CPU": 2.0, "memory": 1e9, "node:127.0.0.1": 1.0, "head_node": 1.0},
        {"CPU": 4.0, "GPU": 1.0, "train_node": 1.0},
    ]
    fits = load_config(None, ["cluster.engine=ray", "cluster.train.resources={train_node: 1}"])
    check_placement_fits(fits, "train", offered)
    check_placement_fits(fits, "sync", offered)  # the colocated baseline goes where train goes
    check_placement_fits(load_config(None, ["cluster.train.num_gpus=1"]), "train", offered)
    too_big = load_config(
        None, ["cluster.engine=ray", "cluster.train.num_gpus=1", "cluster.train.num_cpus=8"]
    )
    with pytest.raises(ClusterError) as caught:
        check_placement_fits(too_big, "train", offered)
    assert str(caught.value) == (
        "no node of the Ray cluster offers what cluster.train asks (CPU 8, GPU 1); its "
        "nodes offer: CPU 2, head_node 1; CPU 4, GPU 1, train_node 1"
    )
    with pytest.raises(ClusterError, match=r"cluster.reward asks \(CPU 1, rollout_node 1\)"):
        check_placement_fits(
            load_config(None, ["cluster.reward.resources={rollout_node: 1}"]), "reward", offered
        )


def test_each_inference_server_actor_asks_for_its_placement_and_its_gpus() -> None:
    from sluice.flows.cluster import check_placement_fits
    from sluice.tasks.process.ray_servers import actor_options

    cpu = load_config(
        None, ["cluster.engine=ray", "servers.launch=ray", "cluster.servers.resources={s: 1}"]
    )
    options = actor_options(cpu)
    assert (options["num_cpus"], options["num_gpus"], options["resources"]) == (1.0, 0.0, {"s": 1})
    assert options["max_restarts"] == 0  # the flow starts a lost server again, not Ray
    sglang = [
        "cluster.engine=ray",
        "servers.launch=ray",
        "servers.engine=sglang",
        "servers.gpus_per_server=2",
    ]
    assert actor_options(load_config(None, sglang))["num_gpus"] == 2.0
    pinned = load_config(None, [*sglang, "cluster.servers.num_gpus=4"])
    assert actor_options(pinned)["num_gpus"] == 4.0
    offered = [{"CPU": 8.0, "GPU": 1.0}]
    with pytest.raises(ClusterError, match=r"cluster.servers asks \(CPU 1, GPU 2\)"):
        check_placement_fits(load_config(None, sglang), "servers", offered)
    check_placement_fits(cpu, "servers", [{"CPU": 1.0, "s": 1.0}])
