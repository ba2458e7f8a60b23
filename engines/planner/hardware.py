"""Cost models from documented per-GPU figures, for planning before any run exists.

A decode step of b sequences over c context tokens reads the weights once and the
K/V of every context token, and computes 2·P FLOPs per sequence::

    t_step = overhead + weight_bytes / (HBM · bw_eff) + c · kv_bytes / (HBM · bw_eff)
             + b · 2P / (FLOPS · decode_mfu)

(the roofline's two sides added, not maxed: at the batch sizes RL decodes at, the
weight read and the per-row compute overlap poorly on real servers, and the sum is
the conservative choice). A prefilled token costs 2P / (FLOPS · prefill_mfu); a
trained token 8P / (FLOPS · train_mfu) — forward, backward (2×), and the proximal
policy's extra forward pass. A weight update pauses a server for the weights'
bytes over ``weight_sync_gbps`` plus a fixed ``update_overhead_s``.

The GPU figures are the vendors' datasheet numbers (dense BF16 tensor FLOPS, HBM
bandwidth, memory). The efficiencies are assumptions, not measurements: each plan
prints them, and ``--set`` changes them. They are the part to replace with a
calibration (``sluice plan --from-run``) as soon as a run on the real hardware exists.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from sluice.engines.planner.costs import CostModel


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_tflops: float
    """Dense BF16 tensor throughput, datasheet (TFLOP/s)."""
    hbm_tbps: float
    """HBM bandwidth, datasheet (TB/s)."""
    memory_gib: float


GPUS: dict[str, Gpu] = {
    # NVIDIA datasheets: H100 SXM5 989 TFLOPS BF16 dense, 3.35 TB/s, 80 GB. The H800 is
    # the H100 SXM with a cut NVLink: the same compute and HBM.
    "h100": Gpu("H100 SXM", 989.0, 3.35, 80.0),
    "h800": Gpu("H800 SXM", 989.0, 3.35, 80.0),
    "h200": Gpu("H200 SXM", 989.0, 4.8, 141.0),
    # H20: 148 TFLOPS BF16 dense, 4.0 TB/s, 96 GB (NVIDIA's China-market Hopper).
    "h20": Gpu("H20", 148.0, 4.0, 96.0),
    "a100": Gpu("A100 SXM 80GB", 312.0, 2.039, 80.0),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, BF16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


MODELS: dict[str, ModelShape] = {
    # Hugging Face configs of the Qwen2.5 family (R1-Distill-Qwen shares them).
    "qwen2.5-1.5b": ModelShape("Qwen2.5-1.5B", 1.54e9, 28, 2, 128),
    "qwen2.5-7b": ModelShape("Qwen2.5-7B", 7.62e9, 28, 4, 128),
    "qwen2.5-14b": ModelShape("Qwen2.5-14B", 14.7e9, 48, 8, 128),
    "qwen2.5-32b": ModelShape("Qwen2.5-32B", 32.5e9, 64, 8, 128),
}


@dataclass(frozen=True)
class Efficiency:
    """Assumed fractions of the datasheet a real stack reaches (see the module docstring)."""

    decode_bw_eff: float = 0.6
    """Share of HBM bandwidth a decode step's reads get (SGLang/vLLM, CUDA graphs)."""
    decode_mfu: float = 0.3
    """Share of tensor FLOPS the per-row decode compute gets."""
    prefill_mfu: float = 0.5
    train_mfu: float = 0.35
    """Model FLOPs utilisation of training (FSDP or Megatron at this scale)."""
    step_overhead_s: float = 0.004
    """Per decode step outside the kernels (scheduler, sampling, launch)."""
    weight_sync_gbps: float = 10.0
    """GB/s a new version's weights reach a server at (storage read or broadcast)."""
    update_overhead_s: float = 1.0
    """Fixed part of a weight update (pause, flush caches, resume)."""
    publish_s: float = 5.0
    """From a train step's end to the rollout seeing the version (save, commit, poll)."""
    reward_s: float = 1.0
    memory_utilisation: float = 0.85
    """Share of GPU memory the inference server may use (weights + K/V)."""


def gpu_costs(gpu: Gpu, model: ModelShape, eff: Efficiency = Efficiency()) -> CostModel:
    flops = gpu.bf16_tflops * 1e12
    bandwidth = gpu.hbm_tbps * 1e12
    weight_bytes = 2.0 * model.params
    return CostModel(
        decode_step_s=eff.step_overhead_s + weight_bytes / (bandwidth * eff.decode_bw_eff),
        decode_row_s=2.0 * model.params / (flops * eff.decode_mfu),
        decode_context_s=model.kv_bytes_per_token / (bandwidth * eff.decode_bw_eff),
        prefill_token_s=2.0 * model.params / (flops * eff.prefill_mfu),
        weight_load_s=eff.update_overhead_s + weight_bytes / (eff.weight_sync_gbps * 1e9),
        train_token_s=8.0 * model.params / (flops * eff.train_mfu),
        publish_s=eff.publish_s,
        reward_s=eff.reward_s,
    )


def kv_slots(
    gpu: Gpu,
    model: ModelShape,
    mean_context_tokens: float,
    devices_per_server: int = 1,
    eff: Efficiency = Efficiency(),
    cap: int = 1024,
) -> int:
    """Sequences a server can hold at once: K/V memory left after the weights, over the
    mean context a resident sequence carries (prompt + half its response)."""
    free = devices_per_server * gpu.memory_gib * 2**30 * eff.memory_utilisation
    free -= 2.0 * model.params
    if free <= 0:
        raise ValueError(
            f"{model.name} does not fit on {devices_per_server} x {gpu.name}: "
            "raise devices_per_server"
        )
    return max(1, min(cap, int(free / (model.kv_bytes_per_token * max(1.0, mean_context_tokens)))))


def with_efficiency(eff: Efficiency, **changes: float) -> Efficiency:
    """`eff` with named fields changed; an unknown name is one clear error."""
    known = set(Efficiency.__dataclass_fields__)
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ValueError(f"unknown efficiency field(s) {unknown}; known: {sorted(known)}")
    return replace(eff, **changes)


def lognormal_lengths(
    mean: float, sigma: float, cap: int | None, n: int = 4096, seed: int = 0
) -> tuple[int, ...]:
    """``n`` response lengths with this mean before the cap (a fixed, seeded sample)."""
    if mean < 1 or sigma < 0:
        raise ValueError(f"response mean must be >= 1 and sigma >= 0, got {mean}, {sigma}")
    mu = np.log(mean) - sigma**2 / 2
    draws = np.random.default_rng(seed).lognormal(mu, sigma, n)
    if cap is not None:
        draws = np.minimum(draws, cap)
    return tuple(int(max(1, round(x))) for x in draws)
