"""Reading a Hugging Face checkpoint's tensors and checking they fit the served model.

Also the mismatch injection used by studies: with ``weight_noise_std`` σ > 0 every
weight the engine loads (the initial checkpoint and each update) becomes
w + σ·std(w)·N(0, 1), drawn from a generator keyed by ``(seed, weight version,
tensor name)``. The trainer keeps clean weights, so π_behav ≠ π_prox by
construction and a rollout-correction study has a known, reproducible mismatch to
correct.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import torch

from sluice.engines.inference.rng import U64_MASK
from sluice.engines.inference.types import WeightLoadError


def read_weight_files(model_path: str | Path) -> dict[str, torch.Tensor]:
    """Read every tensor of a Hugging Face checkpoint directory onto the CPU.

    Supports single and sharded safetensors and ``pytorch_model.bin``.
    """
    from safetensors.torch import load_file

    directory = Path(model_path)
    if not directory.is_dir():
        raise WeightLoadError(f"weight directory {str(model_path)!r} does not exist")
    index = directory / "model.safetensors.index.json"
    try:
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            tensors: dict[str, torch.Tensor] = {}
            for shard in shards:
                tensors.update(load_file(str(directory / shard), device="cpu"))
            return tensors
        files = sorted(directory.glob("*.safetensors"))
        if files:
            tensors = {}
            for path in files:
                tensors.update(load_file(str(path), device="cpu"))
            return tensors
        bin_file = directory / "pytorch_model.bin"
        if bin_file.is_file():
            loaded = torch.load(bin_file, map_location="cpu", weights_only=True)
            return dict(loaded)
    except Exception as exc:  # safetensors raises its own error type for corrupt files
        raise WeightLoadError(f"cannot read weights from {str(model_path)!r}: {exc}") from exc
    raise WeightLoadError(
        f"no weights in {str(model_path)!r}: expected model.safetensors, sharded safetensors "
        "with model.safetensors.index.json, or pytorch_model.bin"
    )


def _noise_generator(seed: int, weight_version: int, name: str) -> torch.Generator:
    # Keyed by the tensor's name, not its position: the noise of one tensor never depends
    # on which other tensors a checkpoint holds or the order they were read in.
    key = np.random.SeedSequence(
        [seed & U64_MASK, weight_version & U64_MASK, zlib.crc32(name.encode())]
    )
    return torch.Generator().manual_seed(int(key.generate_state(1, np.uint64)[0]))


def perturb_weights(
    tensors: dict[str, torch.Tensor], noise_std: float, *, seed: int, weight_version: int
) -> dict[str, torch.Tensor]:
    """``w + noise_std · std(w) · N(0, 1)`` for every floating tensor (integer buffers kept).

    The noise is relative to each tensor's own spread, so one σ perturbs embeddings, norms
    and projections alike; a constant tensor (an all-ones norm) stays exact. Drawn on the
    CPU in float32 from a generator keyed by ``(seed, weight_version, name)``: the same
    checkpoint served as the same version gets the same noise on any machine, and every
    new version gets fresh noise, as a real kernel or precision mismatch would.
    """
    if not noise_std:
        return tensors
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            out[name] = tensor
            continue
        clean = tensor.detach().to(device="cpu", dtype=torch.float32)
        noise = torch.randn(
            clean.shape,
            generator=_noise_generator(seed, weight_version, name),
            dtype=torch.float32,
        )
        scale = noise_std * clean.std(correction=0) if clean.numel() else 0.0
        out[name] = (clean + scale * noise).to(tensor.dtype)
    return out


def check_model_type(model_path: str | Path, served_model_type: str) -> None:
    """Raise WeightLoadError if ``model_path``'s config names another model type."""
    config_path = Path(model_path) / "config.json"
    if not config_path.is_file():
        return
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except (OSError, ValueError) as exc:
        raise WeightLoadError(f"cannot read {config_path}: {exc}") from exc
    if model_type is not None and served_model_type and model_type != served_model_type:
        raise WeightLoadError(
            f"weights in {str(model_path)!r} are for model_type {model_type!r}, "
            f"but the engine serves {served_model_type!r}"
        )


def match_state_dict(
    current: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], model_path: str | Path
) -> dict[str, torch.Tensor]:
    """Check ``tensors`` fit the served state dict ``current`` and return ``current``.

    Raises WeightLoadError naming unexpected, missing and misshapen tensors.
    """
    unexpected = sorted(set(tensors) - set(current))
    mismatched = [
        f"{k} {tuple(t.shape)} != {tuple(current[k].shape)}"
        for k, t in tensors.items()
        if k in current and t.shape != current[k].shape
    ]
    loaded_ptrs = {current[k].data_ptr() for k in tensors if k in current}
    # Tied parameters (e.g. lm_head sharing the embedding) are saved once.
    missing = sorted(
        k for k in set(current) - set(tensors) if current[k].data_ptr() not in loaded_ptrs
    )
    problems = []
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:5]}")
    if mismatched:
        problems.append(f"shape mismatches {mismatched[:5]}")
    if missing:
        problems.append(f"missing tensors {missing[:5]}")
    if problems:
        raise WeightLoadError(
            f"weights in {str(model_path)!r} do not fit the served architecture: "
            + "; ".join(problems)
        )
    return current
