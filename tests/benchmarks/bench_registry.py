"""How cheap is the rollout side's registry poll? Side-by-side latencies in one run.

Rollout workers call ``CheckpointRegistry.newest_servable()`` every ``poll_interval_s``. This
script fills a sqlite MLflow registry with N committed policy versions and times, in the
same process and interleaved:

- ``latest()``: one alias lookup on a cached client (what Sluice does);
- a fresh ``MlflowClient`` per poll reading the same alias (no client caching);
- listing every version and taking the newest (polling without an alias).

Run: ``python tests/benchmarks/bench_registry.py [--versions 200] [--polls 300]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def _make_checkpoint(root: Path, version: int) -> Path:
    source = root / f"src{version}"
    source.mkdir(parents=True)
    (source / "config.json").write_text(json.dumps({"model_type": "llama", "v": version}))
    (source / "model.safetensors").write_bytes(os.urandom(4096))
    return source


def _time_ms(fn: Callable[[], object], polls: int) -> list[float]:
    out = []
    for _ in range(polls):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=200, help="committed versions to create")
    parser.add_argument("--polls", type=int, default=300, help="timed polls per method")
    args = parser.parse_args()

    from mlflow import MlflowClient

    from sluice.infra.checkpoints import save_checkpoint
    from sluice.infra.registry import CheckpointRegistry

    with tempfile.TemporaryDirectory(prefix="sluice-bench-registry-") as tmp:
        root = Path(tmp)
        uri = f"sqlite:///{root}/mlflow.db"
        started = time.perf_counter()
        registry = CheckpointRegistry(uri, "bench-policy")
        init_s = time.perf_counter() - started

        commit_ms = []
        for version in range(1, args.versions + 1):
            ckpt = save_checkpoint(_make_checkpoint(root, version), str(root / f"ck{version}"))
            start = time.perf_counter()
            registry.commit(version, ckpt, tags={"staleness.mean": 1.0})
            commit_ms.append((time.perf_counter() - start) * 1000)

        def fresh_client_poll() -> object:
            return MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version_by_alias(
                "bench-policy", registry.mlflow_alias
            )

        def list_all_poll() -> object:
            return registry.versions()[-1]

        assert registry.newest_servable() is not None
        assert registry.newest_servable().policy_version == args.versions  # type: ignore[union-attr]
        methods = {
            "latest() [alias, cached client]": registry.latest,
            "fresh client + alias": fresh_client_poll,
            "list all versions, take newest": list_all_poll,
        }
        timings: dict[str, list[float]] = {name: [] for name in methods}
        # Interleave rounds so load from other processes hits every method alike.
        rounds = 5
        for _ in range(rounds):
            for name, fn in methods.items():
                timings[name].extend(_time_ms(fn, max(1, args.polls // rounds)))

    print(f"registry: sqlite, {args.versions} committed versions, {args.polls} polls per method")
    print(f"first client + table creation: {init_s:.2f} s (once per process)")
    print(
        f"commit (verify manifest + create version + move alias): "
        f"median {statistics.median(commit_ms):.1f} ms"
    )
    base = statistics.median(timings["latest() [alias, cached client]"])
    for name, values in timings.items():
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        print(
            f"{name:34s} median {statistics.median(values):7.2f} ms  p99 {p99:7.2f} ms  "
            f"x{statistics.median(values) / base:5.1f} vs latest()"
        )


if __name__ == "__main__":
    main()
