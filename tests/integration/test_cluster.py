"""Sluice on a real Ray cluster of several nodes on loopback (`cluster.engine: ray`).

The run goes as a user runs it: `sluice train` as a process with its own Prefect API,
streams and checkpoints on moto's S3 server, MLflow behind `mlflow server`. Its roles
are placed by the resources each node declares: rollout on the head, the reward role
and the inference server (a Ray actor, `servers.launch: ray`) on one worker node
(`reward_node`), train on the other (`train_node`). Then nodes are lost, all their
processes killed at once:

- the reward role's node, with the server: the flow places the reward role and the
  server again, on a node of the same kind that joins afterwards (as an autoscaler
  would bring one), the rollout role brings the new server to the version it serves,
  and the run goes on;
- the train role's node: the flow fails the trainer over to a train node that joins
  afterwards, from the newest committed version and its trainer state on S3, and the
  run finishes on its own, with the failover in its summary.

The run's books (tasks/run/audit.py) must then show nothing lost, nothing trained
twice and the staleness bound kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.flows.conftest import tiny_run_overrides
from tests.integration.conftest import S3Endpoint
from tests.integration.ray_cluster import RAY_ENV, RayCluster
from tests.soak.soak import MlflowServer

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

STEPS = 10
REWARD_NODE = {"worker": 1, "reward_node": 2}
"""A node of the kind the reward role and the inference server go to."""
TRAIN_NODE = {"worker": 1, "train_node": 1}


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    """Starts as a head and two worker nodes; a test that loses nodes adds new ones, so
    the next test finds a head and two live worker nodes too."""
    ray_cluster = RayCluster(tmp_path_factory.mktemp("ray"))
    try:
        ray_cluster.start_node("head", 3, {"head_node": 3})
        ray_cluster.start_node("b", 2, REWARD_NODE | {"b_node": 1})
        ray_cluster.start_node("c", 2, TRAIN_NODE | {"c_node": 1})
        yield ray_cluster
    finally:
        ray_cluster.stop()


def cluster_overrides(
    root: Path, s3: S3Endpoint, mlflow: MlflowServer, address: str, **extra: object
) -> list[str]:
    """A tiny run on moto's S3 and the MLflow server, its roles placed on the nodes."""
    placement = ("workdir=", "storage.", "tracking.")
    tiny = tiny_run_overrides(root, **{"trainer.total_steps": STEPS, "role_retries": 2, **extra})
    options = json.dumps({"client_kwargs": s3.storage_options()["client_kwargs"]})
    return [
        *(o for o in tiny if not o.startswith(placement)),
        f"name=cl{os.getpid()}",
        f"workdir={root / 'work'}",
        f"storage.url=s3://{s3.bucket}/cluster-{uuid.uuid4().hex[:8]}",
        f"storage.options={options}",
        f"tracking.uri={mlflow.url}",
        "tracking.artifact_location=null",
        "evaluation.during_run=false",
        "cluster.engine=ray",
        f"cluster.address={address}",
        f"cluster.node_workdir={root / 'nodes'}",
        "cluster.rollout.resources={head_node: 1}",
        "cluster.reward.resources={reward_node: 1}",
        "cluster.train.resources={train_node: 1}",
        "servers.launch=ray",
        "cluster.servers.resources={reward_node: 1}",
    ]


class Train:
    """`sluice train` as its own process group, its output collected as it comes."""

    def __init__(self, root: Path, overrides: list[str], resume: str | None = None) -> None:
        command = [sys.executable, "-m", "sluice.flows.cli", "train"]
        command += [part for o in overrides for part in ("--set", o)]
        command += ["--resume", resume] if resume else []
        env = {**os.environ, **RAY_ENV, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90"}
        self.process = subprocess.Popen(
            command,
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        self.lines.extend(raw.decode(errors="replace") for raw in self.process.stdout)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def started(self, timeout_s: float = 180) -> str:
        """The run's id, once `sluice train` has printed it."""
        wait_until(lambda: self.run_id() is not None, timeout_s, "the run to start", self)
        run_id = self.run_id()
        assert run_id is not None
        return run_id

    def run_id(self) -> str | None:
        found = re.search(r"(?:starting|resuming) run (\S+):", self.output)
        return found.group(1) if found else None

    def wait(self, timeout_s: float) -> int:
        code = self.process.wait(timeout_s)
        self.reader.join(30)
        return code

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def wait_until(predicate, timeout_s: float, what: str, train: Train) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if train.process.poll() is not None:
            raise AssertionError(f"sluice train exited before {what}:\n{train.output[-4000:]}")
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}:\n{train.output[-4000:]}")


@pytest.mark.usefixtures("shared_prefect_api")
def test_roles_on_three_nodes_survive_a_lost_reward_node_and_fail_the_trainer_over(
    tmp_path: Path, moto_s3: S3Endpoint, mlflow_server: MlflowServer, cluster: RayCluster
) -> None:
    from sluice.infra.config.run import load_config
    from sluice.tasks.run.audit import audit_run
    from sluice.tasks.run.failovers import read_failovers
    from sluice.tasks.run.paths import run_paths
    from sluice.tasks.run.status import read_statuses

    root = tmp_path
    overrides = cluster_overrides(root, moto_s3, mlflow_server, cluster.address)
    config = load_config("default", overrides)
    train = Train(root, overrides)
    try:
        run_id = train.started()
        paths = run_paths(config, run_id)

        def status(role: str) -> dict:
            return read_statuses(config, paths).get(role, {})

        def step() -> int:
            return int(status("train").get("step") or 0)

        wait_until(lambda: step() >= 2, 300, "two steps", train)
        placed = {
            role: cluster.node_of(status(role)["pid"]) for role in ("rollout", "reward", "train")
        }
        names = {role: node.name if node else None for role, node in placed.items()}
        # Placed by the resources each node declares: rollout where head_node is, reward
        # and the server where reward_node is, train where train_node is.
        assert names == {"rollout": "head", "reward": "b", "train": "c"}, names
        assert [n.name for n in cluster.nodes if server_processes(n)] == ["b"]
        urls_before = launched_urls(config, run_id)

        lost_reward_pid = status("reward")["pid"]
        placed["reward"].kill()
        replacement = cluster.start_node("d", 2, REWARD_NODE | {"d_node": 1})
        assert not placed["reward"].alive
        wait_until(
            lambda: (
                status("reward").get("pid") not in (None, lost_reward_pid)
                and replacement.hosts(status("reward")["pid"])
                and bool(server_processes(replacement))
            ),
            300,
            "the reward role and the inference server to run on the new node",
            train,
        )
        reached = step()
        wait_until(lambda: step() >= reached + 2, 300, "two more steps after the loss", train)
        assert "reward lost its Ray node" in train.output
        assert "inference server 0 died; started again at" in train.output
        # The new server answers elsewhere, the rollout role found it and loaded the
        # version it serves into it.
        assert launched_urls(config, run_id) != urls_before
        assert status("rollout").get("server_recoveries", 0) >= 1

        step_at_loss = step()
        placed["train"].kill()
        joined = cluster.start_node("e", 2, TRAIN_NODE | {"e_node": 1})
        wait_until(
            lambda: joined.hosts(status("train").get("pid", -1)),
            300,
            "the trainer to fail over to the node that joined",
            train,
        )
        assert train.wait(600) == 0, train.output[-4000:]
    finally:
        train.kill()
    assert "train lost its Ray node" in train.output
    assert "trainer failovers: 1 (next version committed" in train.output, train.output[-3000:]
    (failover,) = read_failovers(config, run_id)
    assert failover["role"] == "train"
    # Noted once the new trainer, on the new node, trained past the lost one's step.
    assert failover["recovered_at"] > failover["lost_at"]
    assert failover["step_at_recovery"] > failover["step_at_loss"] >= step_at_loss

    audit = audit_run(config, run_id)
    assert audit.problems() == [], audit.problems()
    assert audit.versions[-1] == STEPS
    assert audit.groups_lost == [] and audit.duplicated == 0
    assert audit.max_staleness <= config.staleness.max_staleness
    assert not any(server_processes(node) for node in cluster.nodes)  # gone with the run


def processes_running(node, marker: bytes) -> list[int]:  # noqa: ANN001 - a RayNode
    """Pids of the processes on `node` whose command line holds `marker`."""
    found = []
    for pid in node.processes():
        with contextlib.suppress(OSError):
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def rank_actors(node) -> list[int]:  # noqa: ANN001 - a RayNode
    """Pids of the trainer's following ranks (Ray actors) running on `node`."""
    return processes_running(node, b"RankActor")


def server_processes(node) -> list[int]:  # noqa: ANN001 - a RayNode
    """Pids of the inference servers running on `node`."""
    return processes_running(node, b"-m\x00sluice.infra.serving.server\x00")


def launched_urls(config, run_id: str) -> list[str]:  # noqa: ANN001 - a RunConfig
    from sluice.tasks.run.control import launched_server_urls

    return launched_server_urls(config, run_id)


@pytest.mark.usefixtures("shared_prefect_api")
@pytest.mark.parametrize("split", ["data_parallel", "tensor_parallel"])
def test_two_trainer_ranks_train_on_two_nodes_sharing_only_storage(
    tmp_path: Path, moto_s3: S3Endpoint, mlflow_server: MlflowServer, cluster: RayCluster, split
) -> None:
    """Rank 1 on another node than rank 0 fetches the start version from S3 rather than
    read rank 0's directory, and (tensor parallel) sends its optimizer shard to rank 0 at
    each save, so the committed trainer state holds every shard."""
    from sluice.infra.config.run import load_config
    from sluice.tasks.run.audit import audit_run
    from sluice.tasks.run.paths import filesystem, run_paths
    from sluice.tasks.run.status import read_statuses

    steps = 4
    overrides = [
        *cluster_overrides(
            tmp_path,
            moto_s3,
            mlflow_server,
            cluster.address,
            **{
                "trainer.total_steps": steps,
                "trainer.backend": "megatron",
                f"trainer.{split}": 2,
            },
        ),
        "cluster.reward.resources={head_node: 1}",
        "cluster.servers.resources={head_node: 1}",
        "cluster.train.resources={worker: 1}",
        "cluster.train_strategy=STRICT_SPREAD",
    ]
    config = load_config("default", overrides)
    train = Train(tmp_path, overrides)
    try:
        run_id = train.started()
        paths = run_paths(config, run_id)

        def trained() -> int:
            return int(read_statuses(config, paths).get("train", {}).get("step") or 0)

        wait_until(lambda: trained() >= 1, 300, "a step of the split trainer", train)
        statuses = read_statuses(config, paths)
        nodes = {r: cluster.node_of(statuses[r]["pid"]) for r in ("rollout", "reward", "train")}
        assert nodes["rollout"].name == nodes["reward"].name == "head"
        # The inference server went with the rollout role (both ask for head_node).
        assert [n.name for n in cluster.nodes if server_processes(n)] == ["head"]
        rank0 = nodes["train"]
        workers = [n for n in cluster.nodes if n.alive and "worker" in n.resources]
        assert len(workers) == 2 and rank0 in workers, [n.name for n in workers]
        rank1 = next(n for n in workers if n is not rank0)
        # Rank 1 is an actor on the other worker node, none on rank 0's.
        assert rank_actors(rank1) and not rank_actors(rank0), (rank0.name, rank1.name)
        # On another node than rank 0, rank 1 fetched the start version from S3 into its
        # own cache rather than read rank 0's directory (on a real cluster it has none).
        fetched = tmp_path / "nodes" / "runs" / run_id / "train-rank1"
        assert any(p.name == "config.json" for p in fetched.rglob("*")), fetched
        assert train.wait(600) == 0, train.output[-4000:]
    finally:
        train.kill()
    audit = audit_run(config, run_id)
    assert audit.problems() == [], audit.problems()
    assert audit.versions[-1] == steps
    fs, state = filesystem(config, paths.trainer_state(steps))
    names = {Path(p).name for p in fs.ls(state, detail=False)}
    if split == "tensor_parallel":  # rank 1's shard reached rank 0, then storage
        assert {"optimizer.pt", "optimizer.tp1.pt"} <= names, names
        assert not list((fetched / "shards").iterdir()), sorted(map(str, fetched.rglob("*")))
    else:
        assert "optimizer.pt" in names, names
    # The ranks and the server went with the run.
    assert not any(rank_actors(node) or server_processes(node) for node in cluster.nodes)


def test_a_one_node_instance_is_started_for_the_run_not_joined_from_a_running_cluster(
    tmp_path: Path, cluster: RayCluster
) -> None:
    """`cluster.address: null` starts a Ray instance of the run's own, even while
    another cluster runs on this machine (ray.init() with no address would join it,
    through /tmp/ray/ray_current_cluster). It runs on the temporary Prefect API a user
    gets without PREFECT_API_URL (the other two tests share the session's server), so
    the roles on Ray workers reporting to that API stays tested."""
    from sluice.infra.config.run import load_config
    from sluice.tasks.run.paths import run_paths
    from sluice.tasks.run.status import read_statuses

    overrides = [*tiny_run_overrides(tmp_path), "cluster.engine=ray", "evaluation.during_run=false"]
    train = Train(tmp_path, overrides)
    try:
        assert train.wait(600) == 0, train.output[-4000:]
    finally:
        train.kill()
    run_id = train.run_id()
    assert run_id is not None
    config = load_config("default", overrides)
    statuses = read_statuses(config, run_paths(config, run_id))
    assert statuses["train"]["step"] == config.trainer.total_steps
    # Ray says which it did: started an instance, or connected to the running cluster.
    assert {"rollout", "reward", "train"} <= set(statuses)
    assert "Started a local Ray instance" in train.output
    assert "Connecting to existing Ray cluster" not in train.output
