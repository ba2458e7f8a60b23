"""Policy versions over each weight path, side by side in one invocation.

Part 1, the transfer alone (``--versions`` versions per path and server dtype): a real
Sluice server process on the model, and in this process the trainer's side: the model
in float32, nudged before each version as a step would. Per version and path:

- **offer**: what the trainer's process pays for the servers to get the version. disk:
  nothing beyond the durable checkpoint it writes anyway (the server reads those
  files); shared memory and distributed: one copy of the weights into the sender in
  the servers' dtype (``WeightSender.offer``). The train role makes that copy on its
  background thread on a CPU (from the host copy its deferred save took), on the
  critical path on a GPU (a device copy); part 2 measures the stall as the role has it.
- **commit → served**: from the version being committed (durable, so servable) to the
  server answering that it serves it: disk, ``/update_weights_from_disk`` on the
  checkpoint (read and copy in); shared memory, the handles fetched from the sender
  and ``/update_weights_from_tensor``; distributed, the buckets broadcast over gloo
  while the server receives (``/update_weights_from_distributed``). The weight group is
  formed once, before the first version, and its forming time is printed apart.
- **bytes moved** to the server per version: the files it read (disk) or the bytes sent.
After each version the server's greedy tokens on a fixed prompt are checked equal
across paths (the same weights served).

Part 2, the run (``--minutes`` per arm, 0 skips it): ``sluice train reasoning_gym`` on
the model with ``servers.weight_transfer`` = disk (with the checkpoint written before
the next step, as before this change: ``trainer.background_save=false``), disk, shared
memory and distributed, each for the same wall time (``trainer.time_budget_s``), one
after the other, evaluation off. Per arm: steps, steps per second, the trainer's stall
per published version (``train/publish_stall_s``, mean), commit → served (the rollout's
median), bytes moved per update and fall-backs to disk.

On a GPU (``--device cuda``) part 1 keeps the trainer's weights and the server on the
GPU: the group is NCCL and shared memory is CUDA IPC. ``--synthetic B`` replaces the
model's weights with a random Llama of about B billion parameters (for the ~1B row).

Run: ``python tests/benchmarks/bench_weight_transfer.py --model DIR [--versions 5]
[--minutes 4] [--dtypes float32 bfloat16] [--device cuda] [--synthetic 1.0]
[--set key=value ...]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.benchmarks.bench_default_run import run_train  # noqa: E402

PATHS = ("disk", "shared_memory", "distributed")
GROUP = "bench_weights"


def start_server(
    model: Path, dtype: str, log: Path, device: str = "cpu"
) -> tuple[subprocess.Popen[bytes], str]:
    from sluice.tasks.process.ports import free_port

    port = free_port()
    command = [
        sys.executable, "-m", "sluice.infra.serving.server", "--model", str(model),
        "--port", str(port), "--dtype", dtype, "--max-batch-size", "4",
        "--max-seq-len", "256", "--log-level", "warning", "--device", device,
        "--weight-group-timeout-s", "120",
        *(["--num-threads", "1"] if device == "cpu" else []),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}"


def wait_healthy(http: Any, url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if http.get(url + "/health").status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    raise SystemExit(f"server {url} did not become healthy in {timeout_s} s")


def greedy(http: Any, url: str) -> list[int]:
    body = {
        "input_ids": [1, 504, 3458, 314, 216, 34, 30, 34, 47],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
    }
    return list(http.post(url + "/generate", json=body).json()["output_ids"])


def post_ok(http: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = http.post(url, json=body)
    payload = answer.json()
    if answer.status_code != 200 or not payload.get("success", True):
        raise SystemExit(f"{url}: {answer.status_code} {payload}")
    return dict(payload)


def transfer_part(
    model: Path, versions: int, dtypes: list[str], bucket_mb: float, device: str = "cpu"
) -> list[str]:
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    from sluice.engines.inference.loading import resolve_dtype
    from sluice.tasks.train.sender import WeightSender

    trainer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)
    initial = {k: v.clone() for k, v in trainer.state_dict().items()}
    backend = "nccl" if device.startswith("cuda") else "gloo"
    generator = torch.Generator(device=trainer.device).manual_seed(0)
    rows: list[str] = []
    tokens: dict[tuple[str, int], list[int]] = {}
    http = httpx.Client(timeout=600)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    with tempfile.TemporaryDirectory(prefix="sluice-wt-") as scratch:
        root = Path(scratch)
        for dtype in dtypes:
            for path in PATHS:
                # Every path starts from the same weights and nudges them the same way.
                trainer.load_state_dict(initial)
                generator.manual_seed(0)
                process, url = start_server(model, dtype, root / f"{path}-{dtype}.log", device)
                sender = WeightSender(
                    dtype=resolve_dtype(dtype),
                    bucket_bytes=int(bucket_mb * 2**20),
                    group_timeout_s=120.0,
                )
                sender_url = sender.start()
                try:
                    wait_healthy(http, url)
                    formed = float("nan")
                    if path == "distributed":
                        t0 = time.perf_counter()
                        opened = post_ok(
                            http,
                            sender_url + "/groups",
                            {"group_name": GROUP, "world_size": 2, "backend": backend},
                        )
                        post_ok(
                            http,
                            url + "/init_weights_update_group",
                            {
                                **opened,
                                "rank_offset": 1,
                                "world_size": 2,
                                "group_name": GROUP,
                                "backend": backend,
                            },
                        )
                        deadline = time.monotonic() + 150
                        while http.get(f"{sender_url}/groups/{GROUP}").json()["state"] == "forming":
                            if time.monotonic() > deadline:
                                raise SystemExit("the weight group did not form in 150 s")
                            time.sleep(0.01)
                        formed = time.perf_counter() - t0
                    stalls, served, moved = [], [], []
                    for v in range(1, versions + 1):
                        with torch.no_grad():
                            for p in trainer.parameters():
                                p.add_(
                                    1e-3
                                    * p.abs().mean()
                                    * torch.randn(p.shape, generator=generator, device=p.device)
                                )
                        checkpoint = root / f"ckpt-{path}-{dtype}-v{v}"
                        if path == "disk":
                            trainer.save_pretrained(checkpoint, safe_serialization=True)
                            stalls.append(0.0)
                            t0 = time.perf_counter()
                            post_ok(
                                http,
                                url + "/update_weights_from_disk",
                                {"model_path": str(checkpoint), "weight_version": str(v)},
                            )
                            served.append(time.perf_counter() - t0)
                            moved.append(
                                sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
                            )
                        else:
                            t0 = time.perf_counter()
                            sender.offer(v, trainer.state_dict())
                            stalls.append(time.perf_counter() - t0)
                            meta = http.get(f"{sender_url}/versions/{v}").json()
                            t0 = time.perf_counter()
                            if path == "shared_memory":
                                handles = http.get(f"{sender_url}/versions/{v}/handles").json()
                                post_ok(
                                    http,
                                    url + "/update_weights_from_tensor",
                                    {**handles, "weight_version": str(v)},
                                )
                            else:
                                for b, bucket in enumerate(meta["buckets"]):
                                    body = {
                                        k: [meta[k][i] for i in bucket]
                                        for k in ("names", "dtypes", "shapes")
                                    }
                                    receive = pool.submit(
                                        post_ok,
                                        http,
                                        url + "/update_weights_from_distributed",
                                        {
                                            **body,
                                            "group_name": GROUP,
                                            "weight_version": str(v),
                                            "load_format": "flattened_bucket",
                                        },
                                    )
                                    post_ok(
                                        http,
                                        f"{sender_url}/groups/{GROUP}/broadcast",
                                        {"version": v, "bucket": b},
                                    )
                                    receive.result()
                            served.append(time.perf_counter() - t0)
                            moved.append(meta["bytes"])
                        tokens[(f"{path}", v)] = greedy(http, url)
                        if path != "disk" and tokens[(path, v)] != tokens.get(
                            ("disk", v), tokens[(path, v)]
                        ):
                            print(
                                f"warning: {path} v{v} ({dtype}) serves other tokens than disk",
                                flush=True,
                            )
                    row = (
                        f"| {path} | {dtype} | {statistics.mean(stalls):.3f} | "
                        f"{statistics.median(served):.3f} | {statistics.mean(moved) / 1e6:.1f} | "
                        f"{formed:.2f} |"
                    )
                except (Exception, SystemExit) as error:  # noqa: BLE001 - a row, not a stop
                    # NCCL refuses two ranks on one GPU, for one: the row says why, and the
                    # other paths still run.
                    cause = " ".join(str(error).split())[:240]
                    row = f"| {path} | {dtype} | failed: {type(error).__name__}: {cause} | | | |"
                finally:
                    sender.stop()
                    process.terminate()
                    try:
                        process.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait()
                print(row, flush=True)
                rows.append(row)
    return rows


def run_part(model: Path, minutes: float, seed: int, extra: list[str]) -> list[str]:
    from tests.benchmarks.bench_lora import figures

    arms = {
        "disk, checkpoint before next step": [
            "servers.weight_transfer=disk",
            "trainer.background_save=false",
        ],
        "disk": ["servers.weight_transfer=disk"],
        "shared_memory": ["servers.weight_transfer=shared_memory"],
        "distributed": ["servers.weight_transfer=distributed"],
    }
    rows = []
    for arm, settings in arms.items():
        with tempfile.TemporaryDirectory(prefix="sluice-wt-run-") as scratch:
            workdir = Path(scratch)
            command = ["sluice", "train", "reasoning_gym", "--set", f"seed={seed}"]
            for item in [
                f"model.path={model}",
                f"trainer.time_budget_s={max(60.0, minutes * 60 - 50):.0f}",
                "evaluation.during_run=false",
                *settings,
                *extra,
            ]:
                command += ["--set", item]
            _, wall = run_train(command, workdir, arm)
            result = figures(workdir)
            stall, status = run_extras(workdir)
            steps = result["steps"]
            row = (
                f"| {arm} | {steps} | {steps / max(1e-9, wall):.4f} | {result['s_per_step']:.1f} | "
                f"{stall:.2f} | {result['commit_to_served_s']:.2f} | "
                f"{status.get('weight_bytes_moved', 0) / max(1, status.get('weight_updates', 0)) / 1e6:.0f} | "
                f"{status.get('weight_updates', 0)} | {status.get('weight_fallbacks', 0)} | {wall:.0f} |"
            )
            print(row, flush=True)
            rows.append(row)
    return rows


def run_extras(workdir: Path) -> tuple[float, dict[str, Any]]:
    """The trainer's mean stall per published version (MLflow) and the rollout's status."""
    from mlflow.tracking import MlflowClient

    from sluice.flows.run_dirs import absolute_store_settings, resolve_run
    from sluice.infra.config.run import load_config
    from sluice.infra.tracking import get_metric_history
    from sluice.tasks.run.paths import run_paths
    from sluice.tasks.run.status import read_statuses
    from tests.benchmarks.bench_default_run import curves_of  # noqa: F401  same store layout

    stores = absolute_store_settings(workdir)
    run_id, config = resolve_run(load_config(None, stores), None, stores)
    client = MlflowClient(tracking_uri=config.tracking.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("sluice").experiment_id])
    stalls = [
        v
        for _, v in get_metric_history(
            config.tracking.uri, run.info.run_id, "train/publish_stall_s"
        )
    ]
    rollout = read_statuses(config, run_paths(config, run_id)).get("rollout", {})
    return (statistics.mean(stalls) if stalls else float("nan")), rollout


def synthetic_model(tokenizer_from: Path, billions: float, device: str = "cpu") -> Path:
    """A random Llama of about `billions` x 1e9 parameters (hidden 2048, 16 heads, 4 key/
    value heads, MLP 5632; layers to reach the size), with `tokenizer_from`'s tokenizer."""
    import shutil

    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    vocab = int(AutoConfig.from_pretrained(tokenizer_from).vocab_size)
    hidden, mlp = 2048, 5632
    per_layer = 4 * hidden * hidden * 3 // 4 + 3 * hidden * mlp  # attention (GQA) + MLP
    layers = max(1, round((billions * 1e9 - vocab * hidden) / per_layer))
    out = Path(tempfile.mkdtemp(prefix="sluice-synthetic-")) / "model"
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True,
        max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):  # random init of a billion weights: seconds on a GPU
        model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    count = sum(p.numel() for p in model.parameters()) / 1e9
    print(f"synthetic model: {layers} layers, {count:.2f} B parameters at {out}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="an imported SmolLM2 directory")
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda: the trainer's weights and the server on the GPU, the group on "
        "NCCL, shared memory as CUDA IPC (two processes on one GPU: NCCL refuses that, "
        "so give the server another GPU with CUDA_VISIBLE_DEVICES ordering, or read that row "
        "as the refusal it is)",
    )
    parser.add_argument(
        "--synthetic",
        type=float,
        default=None,
        metavar="BILLIONS",
        help="instead of --model's weights, a random Llama of about this many billion "
        "parameters (SmolLM2's tokenizer and vocabulary), built once into a temp directory",
    )
    args = parser.parse_args()
    model = args.model.resolve()
    if args.synthetic:
        model = synthetic_model(model, args.synthetic, args.device)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}; "
        f"model {model}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    print(
        "\n| path | server dtype | offer per version (s) | commit → served (s, median) | MB moved per version | group formed (s) |"
    )
    print("|---|---|---|---|---|---|", flush=True)
    transfer_part(model, args.versions, args.dtypes, args.bucket_mb, args.device)
    if args.minutes > 0:
        print(
            "\n| arm | steps | steps/s (wall) | s/step | trainer stall per version (s) | "
            "commit → served (s, median) | MB per update | updates | fall-backs | wall s |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
        run_part(model, args.minutes, args.seed, args.overrides)


if __name__ == "__main__":
    main()
