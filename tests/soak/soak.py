"""Fault soak: a real `sluice train` on S3 and an MLflow server while a chaos driver
breaks things, then the run's books (tasks/run/audit.py), counted.

Everything is on loopback: moto's S3 server and `mlflow server` (sqlite behind it) run
as processes of their own; `sluice train` runs as users run it, a process with its own
Prefect API. While it trains, the driver, at random moments (seeded):

- SIGKILLs the rollout, reward, train and evaluate processes (`--kills` each; the pid
  comes from each role's status document), which Prefect starts again (`role_retries`);
- arms the failpoints (infra/failpoints.py) that kill the trainer between uploading a
  checkpoint's weights and its manifest, between creating a registry version and
  moving the alias, and between holding a version for the servers' fast weight path
  (`servers.weight_transfer`, `--weight-transfer`) and writing it durably;
- stops the S3 endpoint for a few seconds (SIGSTOP: requests hang, then go on), and
  takes the MLflow server down for a few seconds (killed, then started again on the
  same port and database: connections are refused meanwhile).

A fault counts as recovered when its target came back: a killed role (or a trainer a
failpoint killed) has a new process in its final status document; an outage ended
and the run went on to finish. Then the audit must find nothing wrong. One line sums
it up:

    soak: faults injected=... recovered=... | shards=... lost=0 duplicated=0 | max staleness=.../eta | steps=.../... in ...s

    python -m tests.soak [--steps 48] [--kills 2] [--outages 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.benchmarks.bench_load import S3_ENV, S3Server  # noqa: E402

BUCKET = "load"  # the bucket S3Server creates
ROLES = ("rollout", "reward", "train", "evaluate")
FAILPOINTS = ("checkpoint.mid_upload", "registry.before_alias", "train.offered_not_durable")
OUTAGE_S = 3.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_http(url: str, timeout_s: float, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer") from None
            time.sleep(0.3)


class MlflowServer:
    """`mlflow server` on a loopback port over a sqlite file; can be taken down and
    started again on the same port and database."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1"]
            + ["--port", str(self.port), "--workers", "1"]
            + ["--backend-store-uri", f"sqlite:///{self.root}/mlflow.db"]
            + ["--artifacts-destination", str(self.root / "mlartifacts")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            _wait_http(f"{self.url}/health", 120, self.process)
        except BaseException:
            self.stop()  # one that never answered is not left running
            raise

    def stop(self) -> None:
        if self.process is not None:
            # The server and its workers, which may outlive a server that already exited.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@dataclass
class Fault:
    kind: str
    """'kill', 'failpoint', 's3' or 'mlflow'."""
    target: str
    """A role, a failpoint name, or the server."""
    pid: int | None = None
    """The process killed (a failpoint's comes from the failpoint file)."""
    recovered: bool = False


@dataclass
class SoakResult:
    faults: list[Fault] = field(default_factory=list)
    returncode: int | None = None
    run_id: str | None = None
    seconds: float = 0.0
    audit: Any = None
    output: str = ""

    @property
    def injected(self) -> list[Fault]:
        return [f for f in self.faults if f.kind != "failpoint" or f.pid is not None]

    def line(self) -> str:
        audit = self.audit
        kinds = Counter(
            f"{f.kind}:{f.target}" if f.kind == "kill" else f.kind for f in self.injected
        )
        detail = ", ".join(f"{k}={n}" for k, n in sorted(kinds.items()))
        recovered = sum(f.recovered for f in self.injected)
        head = f"soak: faults injected={len(self.injected)} recovered={recovered} ({detail})"
        if audit is None:
            return f"{head} | run did not finish (exit {self.returncode})"
        shards = sum(audit.shards.values())
        lost = len(audit.groups_lost)
        return (
            f"{head} | shards={shards} lost={lost} duplicated={audit.duplicated} "
            f"| max staleness={audit.max_staleness}/{audit.max_staleness_allowed} "
            f"| steps={audit.versions[-1] if audit.versions else 0}/{audit.total_steps} "
            f"in {self.seconds:.0f}s"
        )


def soak_overrides(
    root: Path, s3: S3Server, mlflow: MlflowServer, steps: int, weight_transfer: str = "auto"
) -> list[str]:
    from tests.flows.conftest import tiny_run_overrides

    settings = {
        "name": "soak",
        "workdir": str(root / "work"),
        "storage.url": f"s3://{BUCKET}/soak",
        "storage.options": json.dumps({"client_kwargs": s3.options()["client_kwargs"]}),
        "tracking.uri": mlflow.url,
        "tracking.artifact_location": "null",
        "trainer.total_steps": steps,
        "evaluation.every": 3,
        "role_retries": 1000,
        "servers.weight_transfer": weight_transfer,
    }
    return [*tiny_run_overrides(None), *(f"{k}={v}" for k, v in settings.items())]


class Driver:
    """Reads the run's role pids and injects one fault at a time at random moments."""

    def __init__(self, config: Any, s3: S3Server, mlflow: MlflowServer, plan_path: Path):
        self.config = config
        self.s3 = s3
        self.mlflow = mlflow
        self.plan_path = plan_path

    def statuses(self, run_id: str) -> dict[str, dict[str, Any]]:
        from sluice.tasks.run.paths import run_paths
        from sluice.tasks.run.status import read_statuses

        try:
            return read_statuses(self.config, run_paths(self.config, run_id))
        except Exception:
            return {}

    def inject(self, fault: Fault, run_id: str) -> bool:
        """Carry out `fault`; False when its target is not there to hit now."""
        if fault.kind == "kill":
            status = self.statuses(run_id).get(fault.target, {})
            pid = status.get("pid")
            if status.get("state") != "running" or not pid:
                return False
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                return False
            fault.pid = int(pid)
        elif fault.kind == "failpoint":
            plan = json.loads(self.plan_path.read_text() or "{}")
            plan[fault.target] = plan.get(fault.target, 0) + 1
            self.plan_path.write_text(json.dumps(plan))
        elif fault.kind == "s3":
            os.kill(self.s3.process.pid, signal.SIGSTOP)
            time.sleep(OUTAGE_S)
            os.kill(self.s3.process.pid, signal.SIGCONT)
        else:
            self.mlflow.stop()
            time.sleep(OUTAGE_S)
            self.mlflow.start()
        return True


def run_soak(
    steps: int = 48,
    kills: int = 2,
    outages: int = 2,
    seed: int = 0,
    root: Path | None = None,
    weight_transfer: str = "auto",
) -> SoakResult:
    from sluice.infra.config.run import load_config
    from sluice.tasks.run.audit import audit_run

    root = root or Path(tempfile.mkdtemp(prefix="sluice-soak-"))
    rng = random.Random(seed)
    os.environ.update(S3_ENV)
    s3 = S3Server()
    mlflow: MlflowServer | None = None
    flow: subprocess.Popen[bytes] | None = None
    plan_path = root / "failpoints.json"
    plan_path.write_text("{}")
    result = SoakResult()
    try:
        mlflow = MlflowServer(root)
        overrides = soak_overrides(root, s3, mlflow, steps, weight_transfer)
        config = load_config("default", overrides)
        driver = Driver(config, s3, mlflow, plan_path)
        faults = [Fault("kill", role) for role in ROLES for _ in range(kills)]
        faults += [Fault("failpoint", name) for name in FAILPOINTS]
        faults += [Fault(kind, "server") for kind in ("s3", "mlflow") for _ in range(outages)]
        rng.shuffle(faults)
        env = {
            **os.environ,
            "SLUICE_FAILPOINTS": str(plan_path),
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        }
        command = [sys.executable, "-m", "sluice.flows.cli", "train"]
        command += [part for o in overrides for part in ("--set", o)]
        started = time.monotonic()
        # Its own process group: the roles and its Prefect server go with it at the end.
        flow = subprocess.Popen(
            command,
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        lines: list[str] = []
        reader = threading.Thread(
            target=lambda: lines.extend(raw.decode(errors="replace") for raw in flow.stdout),  # type: ignore[union-attr]
            daemon=True,
        )
        reader.start()
        run_id = None
        pending = list(faults)
        # One fault per training step at most, at a random moment within it, so the
        # faults spread over the run instead of piling up in its first seconds.
        last_step, next_at = 0, 0.0
        while flow.poll() is None:
            time.sleep(0.1)
            if run_id is None:
                found = [
                    m for line in list(lines) if (m := re.search(r"starting run (\S+):", line))
                ]
                run_id = found[0].group(1) if found else None
                continue
            step = driver.statuses(run_id).get("train", {}).get("step", 0)
            if not pending or step <= last_step or step >= steps - 1:
                continue
            if not next_at:
                next_at = time.monotonic() + rng.uniform(0.0, 1.5)
            if time.monotonic() < next_at:
                continue
            if driver.inject(pending[0], run_id):
                result.faults.append(pending.pop(0))
                last_step = step
            next_at = 0.0
        reader.join(timeout=30)
        result.seconds = time.monotonic() - started
        result.returncode = flow.returncode
        result.run_id = run_id
        result.output = "".join(lines)
        plan = json.loads(plan_path.read_text() or "{}")
        fired = plan.get("fired", [])
        for fault in result.faults:
            if fault.kind == "failpoint":
                hit = [f for f in fired if f["name"] == fault.target]
                fault.pid = hit[0]["pid"] if hit else None
        if flow.returncode == 0 and run_id:
            final = driver.statuses(run_id)
            for fault in result.faults:
                if fault.kind in ("s3", "mlflow"):
                    fault.recovered = True  # the endpoint came back and the run finished
                elif fault.pid is not None:
                    role = fault.target if fault.kind == "kill" else "train"
                    fault.recovered = final.get(role, {}).get("pid") not in (None, fault.pid)
            result.audit = audit_run(config, run_id)
    finally:
        if flow is not None:  # whatever of the run is left after an error in the driver
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(flow.pid, signal.SIGKILL)
            flow.wait()
        if mlflow is not None:
            mlflow.stop()
        # An outage an error cut short leaves the server stopped: let close() end it.
        with contextlib.suppress(ProcessLookupError):
            os.kill(s3.process.pid, signal.SIGCONT)
        s3.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.soak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--steps", type=int, default=48, help="training steps of the run")
    parser.add_argument("--kills", type=int, default=2, help="SIGKILLs of each role")
    parser.add_argument("--outages", type=int, default=2, help="outages of S3 and of MLflow each")
    parser.add_argument("--seed", type=int, default=0, help="seeds when and in which order")
    parser.add_argument(
        "--weight-transfer",
        default="auto",
        choices=["auto", "disk", "distributed", "shared_memory"],
        help="servers.weight_transfer of the run (auto: disk on a CPU)",
    )
    args = parser.parse_args(argv)
    result = run_soak(
        args.steps, args.kills, args.outages, args.seed, weight_transfer=args.weight_transfer
    )
    print(result.line())
    problems = result.audit.problems() if result.audit is not None else ["run failed"]
    for problem in problems:
        print(f"  problem: {problem}")
    if result.returncode != 0:
        print(result.output[-4000:])
    return 0 if not problems and result.returncode == 0 else 1
