"""How many layouts can the planner sweep a second? And does slicing a large fleet
change its answer? Side by side in one run.

Two sweeps, the shape ``sluice plan`` runs:

- **CPU-sized**: a run of this machine's default (B=16 × G=8, ~40-token responses with
  a long tail), every split of 8 devices × η ∈ {0, 1, 2, 4, 8} × B ∈ {8, 16, 32};
- **cluster-sized**: 512 prompts × 16, lognormal responses (mean 6,000, cut at
  27,648), H100 datasheet costs for a 7B model, every split of 128 GPUs in steps of 8
  × η ∈ {1, 4, 8}.

For the cluster sweep, three layouts are also simulated unsliced (every server) and
their throughput compared with the sliced answer the sweep used.

Run: ``python tests/benchmarks/bench_planner.py``
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sluice.engines.planner.costs import CostModel, Layout, Workload  # noqa: E402
from sluice.engines.planner.hardware import GPUS, MODELS, gpu_costs, kv_slots, lognormal_lengths  # noqa: E402
from sluice.engines.planner.search import async_layouts, sweep  # noqa: E402
from sluice.engines.planner.simulate import simulate  # noqa: E402


def timed_sweep(label: str, workload: Workload, costs: CostModel, layouts: list[Layout]) -> None:
    started = time.perf_counter()
    candidates = sweep(workload, costs, layouts, steps=20)
    seconds = time.perf_counter() - started
    best = max(candidates, key=lambda c: c.throughput)
    print(
        f"{label}: {len(layouts)} layouts in {seconds:.2f} s = {len(layouts) / seconds:,.0f} "
        f"layouts/s ({1e3 * seconds / len(layouts):.1f} ms each); fastest "
        f"{best.layout.rollout_devices}:{best.layout.train_devices} η={best.layout.max_staleness} "
        f"B={best.layout.prompts_per_batch}"
    )


def main() -> None:
    # CPU-sized: costs of the order this machine's runs calibrate to.
    cpu_costs = CostModel(
        decode_step_s=1.4e-3,
        decode_row_s=4.8e-5,
        decode_context_s=2.8e-7,
        prefill_token_s=2.5e-5,
        weight_load_s=0.03,
        train_token_s=1.2e-4,
        prefill_call_s=1.1e-3,
        train_step_s=0.08,
        publish_s=0.33,
        reward_s=0.15,
        train_scaling=0.67,
        decode_scaling=0.24,
    )
    cpu_workload = Workload(lognormal_lengths(38, 0.9, 256), (17,), 8, trained_fraction=0.4)
    cpu_base = Layout("async", 8, 1, 16, slots_per_server=64, max_tokens_per_micro_batch=8192)
    cpu_layouts = async_layouts(
        cpu_base, etas=[0, 1, 2, 4, 8], batch_sizes=[8, 16, 32], one_server=True
    )
    timed_sweep("CPU-sized (8 devices)", cpu_workload, cpu_costs, cpu_layouts)

    gpu, model = GPUS["h100"], MODELS["qwen2.5-7b"]
    lengths = lognormal_lengths(6000, 0.8, 27648)
    workload = Workload(lengths, (300,), 16)
    costs = gpu_costs(gpu, model)
    slots = kv_slots(gpu, model, 300 + sum(lengths) / len(lengths) / 2)
    base = Layout("async", 128, 8, 512, slots_per_server=slots, devices_per_server=1)
    layouts = [
        replace(layout, devices_per_server=1)
        for layout in async_layouts(
            base, etas=[1, 4, 8], batch_sizes=[512], splits=range(8, 128, 8)
        )
    ]
    timed_sweep("cluster-sized (128 GPUs, 512 × 16)", workload, costs, layouts)

    print("slicing: throughput of the sliced simulation against every server simulated")
    for rollout in (64, 96, 112):
        layout = replace(base, rollout_devices=rollout, max_staleness=4)
        started = time.perf_counter()
        sliced = simulate(workload, costs, layout, steps=10)
        sliced_s = time.perf_counter() - started
        started = time.perf_counter()
        full = simulate(workload, costs, layout, steps=10, slice_servers=rollout)
        full_s = time.perf_counter() - started
        print(
            f"  {rollout}:{128 - rollout} η=4: sliced {sliced.trained_tokens_per_s:,.0f} tok/s "
            f"({sliced_s:.2f} s), unsliced {full.trained_tokens_per_s:,.0f} tok/s ({full_s:.2f} s), "
            f"ratio {sliced.trained_tokens_per_s / full.trained_tokens_per_s:.3f}"
        )


if __name__ == "__main__":
    main()
