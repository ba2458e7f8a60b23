"""`sluice train` across separate machines that share nothing but object storage: Ray
nodes as Docker containers of `sluice:local` on a network of the test's own
(tests/integration/container_cluster.py), moto's S3 server, the Prefect API and the
MLflow server in containers too. The rollout and reward roles run on the head, the
trainer on a node of its own. Mid-run the trainer's container is killed, every process
at once, and a new train node joins (as a spare or an autoscaler brings one): the
trainer fails over to it from the newest committed version on S3, and the run finishes
on its own, with the failover in its summary and a clean audit.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.flows.conftest import tiny_run_overrides
from tests.integration.container_cluster import CREDENTIALS, S3_PORT, Exec, container_cluster

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.cluster]
REPO = Path(__file__).resolve().parents[2]
BUCKET = "sluice-cluster"
STEPS = 10
TRAIN_NODE = {"train_node": 1}

AUDIT = """
import json, sys
from sluice.infra.config import load_config
from sluice.tasks.run.audit import audit_run
from sluice.tasks.run.failovers import read_failovers
config = load_config("default", json.loads(sys.argv[1]))
audit = audit_run(config, sys.argv[2])
print(json.dumps({"problems": audit.problems(), "versions": audit.versions,
    "lost": audit.groups_lost, "duplicated": audit.duplicated,
    "max_staleness": audit.max_staleness, "failovers": read_failovers(config, sys.argv[2])}))
"""


@pytest.fixture(scope="module")
def s3_image(sluice_image: str) -> str:
    subprocess.run(["bash", "infra/docker/image.sh", "s3"], cwd=REPO, check=True, timeout=900)
    return "sluice-s3:local"


def overrides(tag: str, head_address: str) -> list[str]:
    placement = ("workdir=", "storage.", "tracking.")
    tiny = tiny_run_overrides(Path("/tmp"), **{"trainer.total_steps": STEPS, "role_retries": 2})
    options = {
        "client_kwargs": {"endpoint_url": f"http://s3:{S3_PORT}", "region_name": "us-east-1"}
    }
    return [
        *(o for o in tiny if not o.startswith(placement)),
        "name=cc",
        "workdir=/tmp/sluice-flow",
        f"storage.url=s3://{BUCKET}/run-{tag}",
        f"storage.options={json.dumps(options)}",
        "tracking.uri=http://mlflow:5000",
        "tracking.artifact_location=null",
        "evaluation.during_run=false",
        "cluster.engine=ray",
        f"cluster.address={head_address}:6379",
        "cluster.node_workdir=/tmp/sluice-node",
        "cluster.rollout.resources={head_node: 1}",
        "cluster.reward.resources={head_node: 1}",
        "cluster.train.resources={train_node: 1}",
    ]


def test_the_trainer_fails_over_between_machines_that_share_only_object_storage(
    sluice_image: str, s3_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    from sluice.infra.config import load_config
    from sluice.tasks.run.paths import run_paths
    from sluice.tasks.run.status import read_statuses

    for name, value in CREDENTIALS.items():  # moto's, for this machine's reads of S3
        monkeypatch.setenv(name, value)
    with container_cluster(sluice_image, s3_image) as cluster:
        cluster.start_services()
        s3_url = f"http://{cluster.address('s3')}:{S3_PORT}"
        boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1").create_bucket(
            Bucket=BUCKET
        )
        cluster.start_node("head", 3, {"head_node": 3})
        cluster.start_node("c", 2, TRAIN_NODE)
        head = cluster.address("ray-head")
        sets = overrides(cluster.tag, head)
        # This machine reads the run's statuses at S3's address on the test's network.
        options = {"client_kwargs": {"endpoint_url": s3_url, "region_name": "us-east-1"}}
        here = load_config(
            "default",
            [*sets, f"storage.options={json.dumps(options)}"],
        )
        train = Exec(
            cluster.name("ray-head"),
            ["sluice", "train", *(part for s in sets for part in ("--set", s))],
        )
        try:
            run_id = wait_for(lambda: run_id_of(train.output), 240, "the run to start", train)
            paths = run_paths(here, run_id)

            def step() -> int:
                statuses = read_statuses(here, paths)
                return int(statuses.get("train", {}).get("step") or 0)

            wait_for(lambda: step() >= 3, 300, "three steps on node c", train)
            cluster.kill("ray-c")
            cluster.start_node("e", 2, TRAIN_NODE)
            assert train.wait(600) == 0, train.output[-4000:]
        finally:
            train.kill()
        assert "train lost its Ray node" in train.output, train.output[-4000:]
        assert "trainer failovers: 1 (next version committed" in train.output
        books = json.loads(
            Exec(cluster.name("ray-head"), ["python", "-c", AUDIT, json.dumps(sets), run_id])
            .finish(120)
            .strip()
            .splitlines()[-1]
        )
    assert books["problems"] == [], books["problems"]
    assert books["versions"][-1] == STEPS
    assert books["lost"] == [] and books["duplicated"] == 0
    assert books["max_staleness"] <= 1  # tiny_run_overrides: staleness.max_staleness=1
    (failover,) = books["failovers"]
    assert failover["role"] == "train" and failover["step_at_loss"] >= 3
    assert failover["recovered_at"] > failover["lost_at"]


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
