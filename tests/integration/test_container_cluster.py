"""`sluice train` across separate machines that share nothing but object storage: Ray
nodes as Docker containers of `sluice:local` on a network of the test's own
(tests/integration/container_cluster.py), moto's S3 server, the Prefect API and the
MLflow server in containers too. The rollout and reward roles run on the head, the
trainer's two data-parallel Megatron ranks on two nodes of their own (rank 1 fetching
its start from S3). Mid-run a train container is killed, every process at once, and a
new node joins (as a spare or an autoscaler brings one): losing rank 0's machine fails
the trainer over from the newest committed version on S3, losing rank 1's restarts the
role where it was; either way the run finishes on its own with a clean audit. (A
one-rank trainer failing over is the same path with one bundle: the Ray test of
tests/integration/test_cluster.py loses a one-rank trainer's node.)
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.flows.conftest import tiny_run_overrides
from tests.integration.container_cluster import (
    CREDENTIALS,
    S3_PORT,
    ContainerCluster,
    Exec,
    container_cluster,
)

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.cluster]
REPO = Path(__file__).resolve().parents[2]
BUCKET = "sluice-cluster"
STEPS = 10

AUDIT = """
import json, sys
from sluice.infra.config.run import load_config
from sluice.tasks.run.audit import audit_run
from sluice.tasks.run.failovers import read_failovers
from sluice.tasks.run.paths import run_paths
from sluice.tasks.run.status import read_statuses
config = load_config("default", json.loads(sys.argv[1]))
audit = audit_run(config, sys.argv[2])
print(json.dumps({"problems": audit.problems(), "versions": audit.versions,
    "lost": audit.groups_lost, "duplicated": audit.duplicated,
    "max_staleness": audit.max_staleness, "failovers": read_failovers(config, sys.argv[2]),
    "trainer_host": read_statuses(config, run_paths(config, sys.argv[2]))["train"]["host"],
    "trainer_started_at": read_statuses(config, run_paths(config, sys.argv[2]))["train"]["started_at"]}))
"""


@pytest.fixture(scope="module")
def s3_image(sluice_image: str) -> str:
    subprocess.run(["bash", "infra/docker/image.sh", "s3"], cwd=REPO, check=True, timeout=900)
    return "sluice-s3:local"


@pytest.fixture(scope="module")
def machines(sluice_image: str, s3_image: str) -> Iterator[ContainerCluster]:
    """The services and a Ray head (the rollout and reward roles' node) for the module;
    each test adds the train nodes it loses."""
    import boto3

    with (
        pytest.MonkeyPatch.context() as patch,
        container_cluster(sluice_image, s3_image) as cluster,
    ):
        for name, value in CREDENTIALS.items():  # moto's, for this machine's reads of S3
            patch.setenv(name, value)
        cluster.start_services()
        s3_url = f"http://{cluster.address('s3')}:{S3_PORT}"
        boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1").create_bucket(
            Bucket=BUCKET
        )
        cluster.start_node("head", 3, {"head_node": 3})
        yield cluster


def overrides(cluster: ContainerCluster, run: str, train_node: str, **extra: object) -> list[str]:
    tiny = tiny_run_overrides(None, **{"trainer.total_steps": STEPS, "role_retries": 2, **extra})
    options = {
        "client_kwargs": {"endpoint_url": f"http://s3:{S3_PORT}", "region_name": "us-east-1"}
    }
    return [
        *tiny,
        "name=cc",
        "workdir=/tmp/sluice-flow",
        f"storage.url=s3://{BUCKET}/{run}-{cluster.tag}",
        f"storage.options={json.dumps(options)}",
        "tracking.uri=http://mlflow:5000",
        "tracking.artifact_location=null",
        "evaluation.during_run=false",
        "cluster.engine=ray",
        f"cluster.address={cluster.address('ray-head')}:6379",
        "cluster.node_workdir=/tmp/sluice-node",
        "cluster.rollout.resources={head_node: 1}",
        "cluster.reward.resources={head_node: 1}",
        f"cluster.train.resources={{{train_node}: 1}}",
    ]


def fail_over(
    cluster: ContainerCluster,
    sets: list[str],
    spare: str,
    spare_resources: dict,
    victim: Callable[[dict], str] = lambda trainer: trainer["host"],
):
    """Run `sluice train` on the head; once the trainer has trained three steps, kill
    the container `victim` names (from the train role's status; by default the one it
    runs in) and start `spare`. Returns the run's output, the train role's status when
    the container was killed and the run's books (audit and failovers, read on the head)."""
    from sluice.infra.config.run import load_config
    from sluice.tasks.run.paths import run_paths
    from sluice.tasks.run.status import read_statuses

    # This machine reads the run's statuses at S3's address on the test's network.
    s3_url = f"http://{cluster.address('s3')}:{S3_PORT}"
    options = {"client_kwargs": {"endpoint_url": s3_url, "region_name": "us-east-1"}}
    here = load_config("default", [*sets, f"storage.options={json.dumps(options)}"])
    train = Exec(
        cluster.name("ray-head"),
        ["sluice", "train", *(part for s in sets for part in ("--set", s))],
    )
    try:
        run_id = wait_for(lambda: run_id_of(train.output), 240, "the run to start", train)
        paths = run_paths(here, run_id)

        def trainer() -> dict:
            return read_statuses(here, paths).get("train", {})

        wait_for(lambda: int(trainer().get("step") or 0) >= 3, 300, "three steps", train)
        first = trainer()
        cluster.kill(victim(first))
        cluster.start_node(spare, 2, spare_resources)
        assert train.wait(600) == 0, train.output[-4000:]
    finally:
        train.kill()
    audit = Exec(cluster.name("ray-head"), ["python", "-c", AUDIT, json.dumps(sets), run_id])
    books = json.loads(audit.finish(120).strip().splitlines()[-1])
    return train.output, first, books


def check_books(output: str, books: dict) -> None:
    """One failover in the summary, and nothing lost, trained twice or too stale."""
    assert "train lost its Ray node" in output, output[-4000:]
    assert "trainer failovers: 1 (next version committed" in output, output[-3000:]
    assert books["problems"] == [], books["problems"]
    assert books["versions"][-1] == STEPS
    assert books["lost"] == [] and books["duplicated"] == 0
    assert books["max_staleness"] <= 1  # tiny_run_overrides: staleness.max_staleness=1
    (failover,) = books["failovers"]
    assert failover["role"] == "train" and failover["step_at_loss"] >= 3
    assert failover["recovered_at"] > failover["lost_at"]


def test_two_data_parallel_ranks_on_two_machines_fail_over_with_their_trainer(
    machines: ContainerCluster,
) -> None:
    """Rank 1 on the other machine fetches the start version from S3 (there is no other
    way); when rank 0's machine is lost, both ranks are placed again, on the machine
    that survived and the one that joined."""
    machines.start_node("c2", 2, {"dp_node": 1})
    machines.start_node("d2", 2, {"dp_node": 1})
    sets = [
        *overrides(
            machines,
            "two-ranks",
            "dp_node",
            **{"trainer.backend": "megatron", "trainer.data_parallel": 2},
        ),
        "cluster.train_strategy=STRICT_SPREAD",
    ]
    output, first, books = fail_over(machines, sets, "e2", {"dp_node": 1})
    assert first["host"] in ("ray-c2", "ray-d2")
    check_books(output, books)
    assert books["trainer_host"] in ({"ray-c2", "ray-d2"} - {first["host"]}) | {"ray-e2"}


def test_losing_rank_1s_machine_restarts_the_trainer_with_a_rank_on_the_machine_that_joins(
    machines: ContainerCluster,
) -> None:
    """The node of a following rank is lost, not the train role's: rank 0's next
    collective call fails, its task starts the role again (`role_retries`) on its own
    node, and Ray places the lost bundle of the ranks' placement group on the machine
    that joins, where rank 1 fetches its start from S3. Not a failover: the train role's
    node lived."""
    machines.start_node("c3", 2, {"dp3_node": 1})
    machines.start_node("d3", 2, {"dp3_node": 1})
    sets = [
        *overrides(
            machines,
            "rank-one",
            "dp3_node",
            **{"trainer.backend": "megatron", "trainer.data_parallel": 2},
        ),
        "cluster.train_strategy=STRICT_SPREAD",
    ]
    _, first, books = fail_over(
        machines,
        sets,
        "e3",
        {"dp3_node": 1},
        victim=lambda trainer: ({"ray-c3", "ray-d3"} - {trainer["host"]}).pop(),
    )
    assert books["problems"] == [], books["problems"]
    assert books["versions"][-1] == STEPS
    assert books["lost"] == [] and books["duplicated"] == 0
    assert books["failovers"] == []  # the train role's node lived
    # Its task started the train role again, where it was.
    assert books["trainer_host"] == first["host"]
    assert books["trainer_started_at"] != first["started_at"]


def run_id_of(output: str) -> str | None:
    found = re.search(r"(?:starting|resuming) run (\S+):", output)
    return found.group(1) if found else None


def wait_for(predicate, timeout_s: float, what: str, train: Exec):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if train.process.poll() is not None:
            raise AssertionError(f"sluice train exited before {what}:\n{train.output[-4000:]}")
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}:\n{train.output[-4000:]}")
