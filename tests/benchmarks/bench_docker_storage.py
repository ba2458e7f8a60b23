"""Container start under Docker's two storage drivers, side by side in one invocation.

    python tests/benchmarks/bench_docker_storage.py [--image sluice-base:bookworm] [--runs 5]

The running engine (infra/docker/engine.sh: overlay2 where an overlay mounts) against a
second engine started here on the vfs driver (its own data root, socket and exec root,
removed at the end), the image copied into it with `docker save | docker load`. Each
round times `docker run --rm --network none IMAGE true` on each engine in turn (create,
start, wait, remove): what every server, worker, sandbox and compose container of the
test suite pays. Prints each engine's median and the vfs / overlay2 ratio.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def docker(host: str | None, *args: str, timeout_s: float = 900) -> str:
    command = ["docker", *(["-H", host] if host else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}")
    return done.stdout


def start_vfs_engine(root: Path) -> tuple[subprocess.Popen, str]:
    host = f"unix://{root}/docker.sock"
    engine = subprocess.Popen(
        [
            "dockerd",
            "--iptables=false",
            "--bridge=none",
            "--storage-driver=vfs",
            f"--data-root={root}/data",
            f"--exec-root={root}/exec",
            f"--pidfile={root}/docker.pid",
            f"--host={host}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(root / "dockerd.log").open("wb"),
    )
    deadline = time.monotonic() + 120
    while subprocess.run(["docker", "-H", host, "info"], capture_output=True).returncode != 0:
        if engine.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the vfs engine did not start (see {root}/dockerd.log)")
        time.sleep(1)
    return engine, host


def one_run(host: str | None, image: str) -> float:
    started = time.perf_counter()
    docker(host, "run", "--rm", "--network", "none", image, "true")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", default="sluice-base:bookworm")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    driver = json.loads(docker(None, "info", "--format", "{{json .Driver}}"))
    if driver != "overlay2":
        raise SystemExit(f"the running engine uses {driver}, not overlay2 (infra/docker/engine.sh)")
    size = int(docker(None, "image", "inspect", "-f", "{{.Size}}", args.image))
    root = Path(tempfile.mkdtemp(prefix="sluice-vfs-"))
    engine, host = start_vfs_engine(root)
    try:
        saved = subprocess.Popen(["docker", "save", args.image], stdout=subprocess.PIPE)
        subprocess.run(["docker", "-H", host, "load", "-q"], stdin=saved.stdout, check=True)
        saved.wait()
        times: dict[str, list[float]] = {"overlay2": [], "vfs": []}
        for _ in range(args.runs):  # alternating, so drift falls on both alike
            times["overlay2"].append(one_run(None, args.image))
            times["vfs"].append(one_run(host, args.image))
    finally:
        engine.terminate()
        engine.wait(60)
        subprocess.run(["umount", "-R", str(root / "exec")], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"image {args.image} ({size / 1e6:.0f} MB), {args.runs} runs of `docker run --rm ... true`"
    )
    for name, values in times.items():
        print(
            f"{name:9s} median {statistics.median(values):.2f} s  ({', '.join(f'{v:.2f}' for v in values)})"
        )
    ratio = statistics.median(times["vfs"]) / statistics.median(times["overlay2"])
    print(f"vfs / overlay2: {ratio:.1f}x")


if __name__ == "__main__":
    main()
