"""A real Ray cluster of several nodes on this machine, for the cluster tests and the
cluster benchmark: `ray start --head` and `ray start --address ...`, each node a `ray
start --block` process; the node is that process and everything it started (its raylet,
agents and workers, and whatever those start), so killing all of them at once is
losing that node.

Every node listens on 127.0.0.1. Token authentication is off (the nodes, the drivers
and the tests share one loopback), and health checks are quick, so a lost node is
declared dead in seconds rather than the default half minute.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    # A node starting on a loaded 2-core machine may take longer than Ray's default.
    "RAY_raylet_start_wait_time_s": "120",
}
"""Environment of every node and of every driver that joins them."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RayNode:
    name: str
    process: subprocess.Popen[bytes]
    resources: dict[str, float]

    def processes(self) -> set[int]:
        """Every process running on the node: `ray start` and all it started, down to
        the roles a Ray worker started (Ray puts its workers in sessions of their own,
        so the process group is not enough)."""
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                # The command name is in parentheses and may hold spaces.
                fields = stat.read_text().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        found, todo = set(), [self.process.pid]
        while todo:
            pid = todo.pop()
            if pid not in found:
                found.add(pid)
                todo.extend(children.get(pid, []))
        return found

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def hosts(self, pid: int) -> bool:
        """Whether process `pid` runs on this node."""
        return pid in self.processes()

    def kill(self) -> None:
        """Lose the node: SIGKILL to all of it at once."""
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(30)


@dataclass
class RayCluster:
    """A head and worker nodes on loopback; `address` is the head's GCS."""

    root: Path
    port: int = field(default_factory=free_port)
    nodes: list[RayNode] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_node(self, name: str, num_cpus: int, resources: dict[str, float]) -> RayNode:
        head = not self.nodes
        command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block"]
        command += ["--node-ip-address", "127.0.0.1", "--num-cpus", str(num_cpus)]
        command += ["--resources", json.dumps(resources), "--disable-usage-stats"]
        if head:
            command += ["--head", "--port", str(self.port), "--include-dashboard", "false"]
        else:
            command += ["--address", self.address]
        log = open(self.root / f"ray-{name}.log", "ab")  # noqa: SIM115 - the node's lifetime
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **RAY_ENV},
            start_new_session=True,
        )
        node = RayNode(name, process, resources)
        self.nodes.append(node)
        self.wait_for(lambda alive: name_of(resources) in alive, f"node {name} to join", process)
        return node

    def alive_resources(self) -> list[str]:
        """One line per live node from `ray status` (its custom resources)."""
        done = subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "status", "--address", self.address],
            capture_output=True,
            text=True,
            env={**os.environ, **RAY_ENV},
            timeout=60,
        )
        return re.findall(r"([A-Za-z_]+_node)", done.stdout) if done.returncode == 0 else []

    def wait_for(
        self,
        predicate,  # noqa: ANN001 - takes the list alive_resources returns
        what: str,
        process: subprocess.Popen[bytes] | None = None,
        timeout_s: float = 180.0,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{what}: ray start exited {process.returncode}")
            if predicate(self.alive_resources()):
                return
            time.sleep(1.0)
        raise RuntimeError(f"timed out waiting for {what}")

    def node_of(self, pid: int) -> RayNode | None:
        return next((node for node in self.nodes if node.hosts(pid)), None)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.kill()


def name_of(resources: dict[str, float]) -> str:
    """The node's own marker resource (`<name>_node`), which `ray status` lists."""
    return next(key for key in resources if key.endswith("_node"))
