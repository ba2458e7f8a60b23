"""The data plane and the registry under load: many writers, two consumers, concurrent
version commits and alias polls. Counts first (nothing lost, nothing twice), then rates.

Streams: moto's S3 server runs as its own process on loopback. W writer processes
each commit `--shards` one-group shards to one stream while two consumer processes
(two ledgers, as the reward role and an auditor would be) poll, read and ack until
they have every shard. The same is run with one writer first, side by side, so the
table's ratio column is W writers against one. "added latency" is the time from a
shard's commit (the time in its name) to the consumer's poll that first offered it.

Registry: one committer process commits `--versions` policy versions (a small
checkpoint each, on the same S3 server) to a sqlite MLflow registry while `--pollers`
processes read the alias as fast as they can. Every poll must see a version at least
as new as the last one it saw, and one whose checkpoint is complete.

    python tests/benchmarks/bench_load.py [--writers 8] [--shards 250] [--versions 40]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
BUCKET = "load"
STREAM = "rollouts"


# ---------------------------------------------------------------- S3 server


class S3Server:
    """moto's S3 server as a process on a free loopback port, with one bucket."""

    def __init__(self) -> None:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **S3_ENV},
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.2)
        import boto3

        boto3.client("s3", endpoint_url=self.url, region_name="us-east-1").create_bucket(
            Bucket=BUCKET
        )

    def options(self) -> dict[str, Any]:
        return {
            "client_kwargs": {"endpoint_url": self.url, "region_name": "us-east-1"},
            "key": "testing",
            "secret": "testing",
        }

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)


# ---------------------------------------------------------------- streams


def _writer(
    root: str, options: dict[str, Any], run: str, writer: int, shards: int, queue: Any
) -> None:
    import numpy as np

    from sluice.infra.streams.writer import StreamWriter
    from tests.benchmarks.bench_streams import make_groups_table

    rng = np.random.default_rng(writer)
    out = StreamWriter(root, run, STREAM, f"gen-{writer}", storage_options=options)
    tables = [make_groups_table(rng, writer * 1_000_000 + index, 1) for index in range(shards)]
    started = time.time()  # imports and data made: the clock covers the writes alone
    for table in tables:
        out.write(table)
    queue.put(("writer", (started, time.time())))


def _consumer(
    root: str, options: dict[str, Any], run: str, name: str, expected: int, queue: Any
) -> None:
    from sluice.infra.streams.reader import StreamReader

    reader = StreamReader(root, run, STREAM, consumer=name, storage_options=options)
    latencies: list[float] = []
    seen = 0
    deadline = time.monotonic() + 1800
    while seen < expected and time.monotonic() < deadline:
        offered = reader.poll()
        polled_ns = time.time_ns()
        if not offered:
            time.sleep(0.05)
            continue
        for ref in offered:
            latencies.append((polled_ns - ref.commit_time_ns) / 1e9)
            reader.read(ref)
            reader.ack([ref])
            seen += 1
    queue.put((name, latencies))


@dataclass
class StreamLoad:
    writers: int
    shards: int
    """Shards committed in all."""
    write_s: float
    """From the first write to the last commit, over all writers."""
    drain_s: float
    """From the first write to both consumers holding every shard."""
    latency_p50_s: float
    latency_p95_s: float
    lost: int
    """Committed shards a consumer never acked (both consumers summed)."""
    duplicated: int
    """Acks beyond one per shard and consumer (both consumers summed)."""

    @property
    def shards_per_s(self) -> float:
        return self.shards / self.write_s


def stream_load(root: str, options: dict[str, Any], writers: int, shards_each: int) -> StreamLoad:
    """W writer processes and two consumer processes on one fresh stream; the counts."""
    from sluice.infra.streams.reader import StreamReader

    run = f"load-{uuid.uuid4().hex[:8]}"
    total = writers * shards_each
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    consumers = [
        ctx.Process(target=_consumer, args=(root, options, run, name, total, queue))
        for name in ("reward", "audit")
    ]
    producers = [
        ctx.Process(target=_writer, args=(root, options, run, w, shards_each, queue))
        for w in range(writers)
    ]
    for process in (*consumers, *producers):
        process.start()
    spans: list[tuple[float, float]] = []
    results: dict[str, list[float]] = {}
    for _ in range(len(producers) + len(consumers)):
        who, value = queue.get(timeout=1800)
        if who == "writer":
            spans.append(value)
        else:
            results[who] = value
    drained = time.time()
    first = min(start for start, _ in spans)
    write_s = max(end for _, end in spans) - first
    drain_s = drained - first
    for process in (*producers, *consumers):
        process.join()
    if any(p.exitcode for p in (*producers, *consumers)):
        raise RuntimeError("a writer or consumer process failed")

    committed = {r.name for r in StreamReader(root, run, STREAM, "probe", options).committed()}
    lost = duplicated = 0
    for name in results:
        records = {r.record_id: r for r in StreamReader(root, run, STREAM, name, options).records()}
        counts = Counter(shard for r in records.values() for shard in r.shards)
        lost += len(committed - set(counts))
        duplicated += sum(n - 1 for n in counts.values() if n > 1)
    if len(committed) != total:
        lost += total - len(committed)
    latencies = sorted(x for values in results.values() for x in values)
    return StreamLoad(
        writers=writers,
        shards=total,
        write_s=write_s,
        drain_s=drain_s,
        latency_p50_s=statistics.median(latencies),
        latency_p95_s=latencies[int(0.95 * (len(latencies) - 1))],
        lost=lost,
        duplicated=duplicated,
    )


# ---------------------------------------------------------------- registry


def _committer(tracking_uri: str, model: str, root: str, options: dict, versions: int) -> None:
    from sluice.infra.checkpoints import save_checkpoint
    from sluice.infra.registry import CheckpointRegistry

    registry = CheckpointRegistry(tracking_uri, model, storage_options=options)
    with tempfile.TemporaryDirectory() as local:
        for version in range(versions):
            (Path(local) / "config.json").write_text(f'{{"version": {version}}}')
            (Path(local) / "model.safetensors").write_bytes(os.urandom(4096))
            uri = save_checkpoint(local, f"{root}/ckpt/v{version:06d}", options)
            registry.commit(version, uri)


def _poller(tracking_uri: str, model: str, options: dict, last_version: int, queue: Any) -> None:
    from sluice.infra.checkpoints import verify_checkpoint
    from sluice.infra.registry import CheckpointRegistry

    registry = CheckpointRegistry(tracking_uri, model, storage_options=options)
    newest, polls, regressions, incomplete = -1, 0, 0, 0
    latencies: list[float] = []
    deadline = time.monotonic() + 1800
    while newest < last_version and time.monotonic() < deadline:
        started = time.perf_counter()
        latest = registry.newest_servable()
        latencies.append(time.perf_counter() - started)
        polls += 1
        if latest is None:
            continue
        if latest.policy_version < newest:
            regressions += 1
        if latest.policy_version > newest:
            try:
                verify_checkpoint(latest.checkpoint_uri, options)
            except Exception:
                incomplete += 1
            newest = latest.policy_version
    queue.put((polls, regressions, incomplete, newest, latencies))


@dataclass
class RegistryLoad:
    versions: int
    pollers: int
    commit_s: float
    polls: int
    poll_p50_s: float
    regressions: int
    """Polls that saw an older version than an earlier poll of the same poller."""
    incomplete: int
    """Versions seen whose checkpoint manifest could not be read."""
    missed_last: int
    """Pollers that never saw the last version."""


def registry_load(root: str, options: dict[str, Any], versions: int, pollers: int) -> RegistryLoad:
    """One committer and `pollers` alias pollers on a fresh sqlite registry."""
    from sluice.infra.registry import CheckpointRegistry

    workdir = Path(tempfile.mkdtemp(prefix="sluice-load-"))
    tracking_uri = f"sqlite:///{workdir}/mlflow.db"
    model = f"load-{uuid.uuid4().hex[:8]}"
    CheckpointRegistry(tracking_uri, model)  # registers the model (and the schema) once
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    watchers = [
        ctx.Process(target=_poller, args=(tracking_uri, model, options, versions - 1, queue))
        for _ in range(pollers)
    ]
    for process in watchers:
        process.start()
    started = time.monotonic()
    committer = ctx.Process(
        target=_committer, args=(tracking_uri, model, f"{root}/{model}", options, versions)
    )
    committer.start()
    committer.join()
    commit_s = time.monotonic() - started
    results = [queue.get(timeout=1800) for _ in watchers]
    for process in watchers:
        process.join()
    if committer.exitcode:
        raise RuntimeError("the committer failed")
    latencies = sorted(x for r in results for x in r[4])
    return RegistryLoad(
        versions=versions,
        pollers=pollers,
        commit_s=commit_s,
        polls=sum(r[0] for r in results),
        poll_p50_s=statistics.median(latencies),
        regressions=sum(r[1] for r in results),
        incomplete=sum(r[2] for r in results),
        missed_last=sum(1 for r in results if r[3] != versions - 1),
    )


# ---------------------------------------------------------------- report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--shards", type=int, default=250, help="shards per writer")
    parser.add_argument("--versions", type=int, default=40)
    parser.add_argument("--pollers", type=int, default=4)
    args = parser.parse_args(argv)
    os.environ.update(S3_ENV)
    server = S3Server()
    try:
        root = f"s3://{BUCKET}/runs"
        runs = [stream_load(root, server.options(), w, args.shards) for w in (1, args.writers)]
        registry = registry_load(root, server.options(), args.versions, args.pollers)
    finally:
        server.close()
    base = runs[0]
    print(f"# streams on moto's S3 server ({os.cpu_count()} cores), 2 consumers")
    print(
        "| writers | shards | shards/s | vs 1 writer | drained in | added latency p50 | p95 | lost | duplicated |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r.writers} | {r.shards} | {r.shards_per_s:.1f} | "
            f"{r.shards_per_s / base.shards_per_s:.2f}x | {r.drain_s:.1f} s | "
            f"{r.latency_p50_s:.3f} s | {r.latency_p95_s:.3f} s | {r.lost} | {r.duplicated} |"
        )
    print(f"# registry: 1 committer, {registry.pollers} alias pollers (sqlite MLflow)")
    print(
        "| versions | commits/s | polls | poll p50 | went backwards | incomplete seen | pollers missing the last |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {registry.versions} | {registry.versions / registry.commit_s:.2f} | "
        f"{registry.polls} | {registry.poll_p50_s * 1e3:.1f} ms | {registry.regressions} | "
        f"{registry.incomplete} | {registry.missed_last} |"
    )
    bad = sum(r.lost + r.duplicated for r in runs) + registry.regressions + registry.incomplete
    return 1 if bad or registry.missed_last else 0


if __name__ == "__main__":
    sys.exit(main())
