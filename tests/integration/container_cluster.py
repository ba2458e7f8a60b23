"""A cluster of separate machines on this one: each node a Docker container of
`sluice:local` with its own file system and address on a user-defined network of the
test's own, object storage (`sluice-s3:local`, moto's S3 server) the only thing they
share, and the Prefect API and the MLflow server in containers of their own.

The Docker engine here runs without a default bridge or iptables
(infra/docker/engine.sh), so every container joins the test's network, where they
reach each other by name, and this machine reaches them at their addresses on it.
Nothing is published on another interface.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator

from tests.integration.ray_cluster import RAY_ENV

S3_PORT, MLFLOW_PORT, PREFECT_PORT, RAY_PORT = 9000, 5000, 4200, 6379
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def docker(*args: str, timeout: float = 300, check: bool = True) -> str:
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout.strip()


class ContainerCluster:
    """Containers on one network, removed (with the network) by `close`."""

    def __init__(self, image: str, s3_image: str) -> None:
        self.image, self.s3_image = image, s3_image
        self.tag = uuid.uuid4().hex[:6]
        self.network = f"sluice-cluster-{self.tag}"
        self.containers: list[str] = []
        self.killed: set[str] = set()
        docker("network", "create", "--driver", "bridge", self.network)
        self.env = {
            **CREDENTIALS,
            **RAY_ENV,
            "PREFECT_API_URL": f"http://prefect:{PREFECT_PORT}/api",
            "DO_NOT_TRACK": "1",
            "MLFLOW_DISABLE_TELEMETRY": "true",
        }

    def name(self, alias: str) -> str:
        return f"{alias}-{self.tag}"

    def run(self, alias: str, command: list[str], image: str | None = None, **opts: str) -> str:
        """Start a detached container named by `alias` on the network (its alias there)."""
        args = ["run", "-d", "--name", self.name(alias), "--hostname", alias]
        args += ["--network", self.network, "--network-alias", alias, "--shm-size", "512m"]
        for key, value in self.env.items():
            args += ["-e", f"{key}={value}"]
        for key, value in opts.items():
            args += [f"--{key.replace('_', '-')}", value]
        docker(*args, image or self.image, *command)
        self.containers.append(self.name(alias))
        return self.name(alias)

    def address(self, alias: str) -> str:
        """The container's address on the test's network (this machine reaches it)."""
        template = f'{{{{(index .NetworkSettings.Networks "{self.network}").IPAddress}}}}'
        return docker("inspect", "-f", template, self.name(alias))

    def start_services(self) -> None:
        """S3, MLflow and the Prefect API, each in its container; returns once all answer."""
        self.run("s3", [], image=self.s3_image)
        self.run(
            "mlflow",
            ["mlflow", "server", "--host", "0.0.0.0", "--port", str(MLFLOW_PORT)]
            + ["--workers", "1", "--backend-store-uri", "sqlite:////tmp/mlflow.db"]
            + ["--serve-artifacts", "--artifacts-destination", "/tmp/mlflow-artifacts"]
            + ["--allowed-hosts", "mlflow,mlflow:*,localhost,localhost:*,127.0.0.1,127.0.0.1:*"],
        )
        self.run(
            "prefect",
            ["prefect", "server", "start", "--host", "0.0.0.0", "--port", str(PREFECT_PORT)],
        )
        for alias, port, path in (
            ("s3", S3_PORT, "/"),
            ("mlflow", MLFLOW_PORT, "/health"),
            ("prefect", PREFECT_PORT, "/api/health"),
        ):
            self.wait_http(alias, f"http://{self.address(alias)}:{port}{path}", 180)

    def wait_http(self, alias: str, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(url, timeout=5).close()  # noqa: S310 - test network
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{alias} did not answer at {url}:\n{self.logs(alias)}")
            time.sleep(1)

    def start_node(self, alias: str, num_cpus: int, resources: dict[str, float]) -> str:
        """A Ray node in a container of its own: the head for the first."""
        head = not any(c.startswith("ray-") for c in self.containers)
        start = ["ray", "start", "--block", "--node-ip-address", "$(hostname -i)"]
        start += ["--num-cpus", str(num_cpus), "--resources", f"'{json.dumps(resources)}'"]
        start += ["--disable-usage-stats"]
        if head:
            start += ["--head", "--port", str(RAY_PORT), "--include-dashboard=false"]
        else:
            start += ["--address", f"ray-head:{RAY_PORT}"]
        name = self.run(f"ray-{alias}", ["bash", "-c", " ".join(start)])
        live = [c for c in self.containers if c.startswith("ray-") and c not in self.killed]
        self.wait_ray_nodes(len(live))
        return name

    def wait_ray_nodes(self, count: int, timeout_s: float = 180) -> None:
        """Until the cluster has `count` live nodes (as its head reports them)."""
        probe = (
            "import ray; ray.init(address='auto', log_to_driver=False); "
            "print(sum(n['Alive'] for n in ray.nodes()))"
        )
        deadline = time.monotonic() + timeout_s
        seen = ""
        while time.monotonic() < deadline:
            seen = docker(
                "exec", self.name("ray-head"), "python", "-c", probe, check=False, timeout=120
            )
            if seen.strip().splitlines()[-1:] == [str(count)]:
                return
            time.sleep(2)
        raise AssertionError(f"{count} Ray nodes did not come up: {seen[-500:]}")

    def kill(self, alias: str) -> None:
        """Lose the machine: every process of the container at once."""
        docker("kill", self.name(alias))
        self.killed.add(self.name(alias))

    def logs(self, alias: str) -> str:
        return docker("logs", "--tail", "50", self.name(alias), check=False)

    def close(self) -> None:
        for name in reversed(self.containers):
            docker("rm", "-f", name, check=False, timeout=120)
        docker("network", "rm", self.network, check=False)


class Exec:
    """A command run in a container (`docker exec`), its output collected as it comes."""

    def __init__(self, container: str, command: list[str]) -> None:
        self.process = subprocess.Popen(
            ["docker", "exec", container, *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
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

    def wait(self, timeout_s: float) -> int:
        code = self.process.wait(timeout_s)
        self.reader.join(30)
        return code

    def finish(self, timeout_s: float) -> str:
        """The whole output, once the command exited 0."""
        code = self.wait(timeout_s)
        if code != 0:
            raise AssertionError(f"exited {code}:\n{self.output[-4000:]}")
        return self.output

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait()


@contextlib.contextmanager
def container_cluster(image: str, s3_image: str) -> Iterator[ContainerCluster]:
    cluster = ContainerCluster(image, s3_image)
    try:
        yield cluster
    finally:
        cluster.close()
