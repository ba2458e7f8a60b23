"""Benchmark: a trainer failover on a Ray cluster, measured.

A Ray cluster of nodes on this machine (processes, as in tests/integration/test_cluster.py):
a head for the rollout role, the reward role and the inference server actor, and a train
node. Streams and checkpoints on moto's S3 server, MLflow behind `mlflow server`. `sluice
train` runs `--steps` versions; once the trainer has reached `--kill-at`, its node is
killed (every process at once) and a new train node starts at the same moment, as a spare
or an autoscaler would bring one. Printed, from the run's failover record and registry:

- seconds from the loss to the new trainer's first step past the lost one's, and to the
  next committed version (the new trainer first waits out the lost one's lease);
- what the rollout side did meanwhile: samples written, groups in flight;
- the audit: groups lost, groups trained twice, versions, largest staleness.

    python tests/benchmarks/bench_failover.py [--steps 12 --kill-at 4 --rounds 1]
    python tests/benchmarks/bench_failover.py --containers [--rounds 1]

`--containers`: every node a container of `sluice:local` on a network of its own,
sharing only S3 (tests/integration/test_container_cluster.py: 10 steps, the trainer's
container killed after its third), where the new trainer also waits out the lost one's
trainer lease.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository's tests package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BUCKET = "sluice-bench"


def start_s3() -> tuple[object, object]:
    """moto's S3 server on a free loopback port and its endpoint, with a bucket."""
    import boto3
    from moto.server import ThreadedMotoServer

    from tests.integration.conftest import S3Endpoint

    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=BUCKET)
    return server, S3Endpoint(endpoint_url=url, bucket=BUCKET)


def one_failover(root: Path, s3: object, mlflow: object, steps: int, kill_at: int) -> None:
    from sluice.infra.config.run import load_config
    from sluice.tasks.run.audit import audit_run
    from sluice.tasks.run.failovers import failover_summary, read_failovers
    from sluice.tasks.run.paths import run_paths, run_registry
    from sluice.tasks.run.status import read_statuses
    from tests.integration.ray_cluster import RayCluster
    from tests.integration.test_cluster import TRAIN_NODE, Train, cluster_overrides, wait_until

    (root / "ray").mkdir()
    cluster = RayCluster(root / "ray")
    try:
        cluster.start_node("head", 4, {"head_node": 3, "reward_node": 2})
        cluster.start_node("c", 2, TRAIN_NODE)
        overrides = [
            *cluster_overrides(root, s3, mlflow, cluster.address, **{"trainer.total_steps": steps}),
            "cluster.servers.resources={reward_node: 1}",
        ]
        config = load_config("default", overrides)
        train = Train(root, overrides)
        try:
            run_id = train.started()
            paths = run_paths(config, run_id)

            def train_status() -> dict:
                return read_statuses(config, paths).get("train", {})

            wait_until(
                lambda: int(train_status().get("step") or 0) >= kill_at, 600, "--kill-at", train
            )
            node = cluster.node_of(train_status()["pid"])
            assert node is not None and node.name == "c", node
            node.kill()
            cluster.start_node("e", 2, TRAIN_NODE)
            code = train.wait(900)
        finally:
            train.kill()
        if code != 0:
            raise SystemExit(f"sluice train exited {code}:\n{train.output[-3000:]}")
        failovers = read_failovers(config, run_id)
        commits = [v.created_at_ms / 1000 for v in run_registry(config, run_id).versions()]
        audit = audit_run(config, run_id)
    finally:
        cluster.stop()
    for entry, row in zip(failovers, failover_summary(failovers, commits), strict=True):
        before = entry.get("rollout_at_loss") or {}
        after = entry.get("rollout_at_recovery") or {}
        print(
            f"  lost at step {entry['step_at_loss']}: first step past it "
            f"{row['to_first_step_s']:.1f} s after the loss, next committed version "
            f"{row['to_next_commit_s']:.1f} s after it"
        )
        print(
            f"  rollout meanwhile: {row['samples_generated_meanwhile']} samples generated "
            f"(written {before.get('samples_written')} -> {after.get('samples_written')}), "
            f"groups in flight {before.get('groups_in_flight')} -> "
            f"{after.get('groups_in_flight')}"
        )
    print(
        f"  audit: {len(audit.problems())} problems, groups lost {len(audit.groups_lost)}, "
        f"trained twice {audit.duplicated}, versions {audit.versions[0]}..{audit.versions[-1]}, "
        f"largest staleness {audit.max_staleness} (bound {config.staleness.max_staleness})"
    )


def containers_failover(rounds: int) -> None:
    """The same, with every node a container of `sluice:local` sharing only S3
    (tests/integration/test_container_cluster.py): a new trainer there also waits out
    the lost one's trainer lease, which on one machine it takes over at once."""
    import subprocess

    from tests.integration.container_cluster import CREDENTIALS, container_cluster
    from tests.integration.test_container_cluster import BUCKET, fail_over, overrides

    repo = Path(__file__).resolve().parents[2]
    for target in ("sluice", "s3"):
        subprocess.run(["bash", "infra/docker/image.sh", target], cwd=repo, check=True)
    os.environ.update(CREDENTIALS)
    import boto3

    with container_cluster("sluice:local", "sluice-s3:local") as cluster:
        cluster.start_services()
        s3_url = f"http://{cluster.address('s3')}:9000"
        boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1").create_bucket(
            Bucket=BUCKET
        )
        cluster.start_node("head", 3, {"head_node": 3})
        for round_ in range(rounds):
            node = f"train_{round_}"
            cluster.start_node(f"c{round_}", 2, {node: 1})
            sets = overrides(cluster, f"bench-{round_}", node)
            output, first, books = fail_over(cluster, sets, f"e{round_}", {node: 1})
            lost = first["host"]
            (entry,) = books["failovers"]
            before = entry.get("rollout_at_loss") or {}
            after = entry.get("rollout_at_recovery") or {}
            line = next(x for x in output.splitlines() if "trainer failovers:" in x)
            print(
                f"round {round_ + 1} (containers, {lost} killed at step {entry['step_at_loss']}):"
            )
            print(
                f"  first step past it {entry['recovered_at'] - entry['lost_at']:.1f} s after the loss"
            )
            print(f"  {line.strip()}")
            print(
                f"  rollout: written {before.get('samples_written')} -> "
                f"{after.get('samples_written')}, groups in flight "
                f"{before.get('groups_in_flight')} -> {after.get('groups_in_flight')}"
            )
            print(
                f"  audit: {len(books['problems'])} problems, groups lost {len(books['lost'])}, "
                f"trained twice {books['duplicated']}, last version {books['versions'][-1]}, "
                f"largest staleness {books['max_staleness']}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-at", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--containers", action="store_true", help="nodes as containers sharing only S3"
    )
    args = parser.parse_args()
    import torch

    from tests.integration.ray_cluster import RAY_ENV
    from tests.soak.soak import MlflowServer

    os.environ.update(RAY_ENV)
    machine = (
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}, torch {torch.__version__}"
    )
    if args.containers:
        print(f"{machine}; nodes as containers sharing only S3; tiny run of 10 steps, the")
        print("train role's container killed once it has trained 3, a new node started at once")
        containers_failover(args.rounds)
        return
    print(
        f"{machine}; tiny run of {args.steps} steps, the train node killed at step "
        f"{args.kill_at}, a new one started at once"
    )
    server, s3 = start_s3()
    with tempfile.TemporaryDirectory(prefix="sluice-failover-") as tmp:
        (Path(tmp) / "mlflow").mkdir()
        mlflow = MlflowServer(Path(tmp) / "mlflow")
        try:
            for round_ in range(args.rounds):
                print(f"round {round_ + 1}:")
                started = time.monotonic()
                root = Path(tmp) / f"round{round_}"
                root.mkdir()
                one_failover(root, s3, mlflow, args.steps, args.kill_at)
                print(f"  ({time.monotonic() - started:.0f} s in all)")
        finally:
            mlflow.stop()
            server.stop()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
