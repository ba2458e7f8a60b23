"""LoRA adapter directories (PEFT's on-disk format) and folding one into its base weights.

A LoRA run publishes each version after 0 as an adapter directory: ``adapter_config.json``
and ``adapter_model.safetensors`` exactly as PEFT writes them (so PEFT, SGLang's
``/load_lora_adapter`` and Hugging Face tools read it as is), plus ``sluice_adapter.json``,
the reference to the base checkpoint the adapter was trained on (its URL and digest; the
tasks layer writes and checks it).

This module needs neither PEFT nor transformers: the inference engine folds an adapter
into the weights it serves with it, and ``merge_adapter_dir`` writes the merged model
(W + (alpha / r) · B A for every adapted layer, PEFT's ``get_delta_weight`` for a plain
LoRA layer) as a Hugging Face directory any engine loads.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
BASE_REFERENCE_FILE = "sluice_adapter.json"
"""Which base checkpoint (URL, digest, policy version) an adapter version was trained on."""
ADAPTER_FILES = (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, BASE_REFERENCE_FILE)
_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


class AdapterError(ValueError):
    """An adapter directory that cannot be read or does not fit the base (one line)."""


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` holds a LoRA adapter rather than full weights."""
    return (Path(path) / ADAPTER_CONFIG_FILE).is_file()


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter: per adapted weight (named as in the base model), its A and B."""

    scale: float
    """alpha / r: the factor of B A in the merged weight."""
    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    """Base weight name (``model.layers.0.self_attn.q_proj.weight``) -> (A [r, in], B [out, r])."""
    config: Mapping[str, Any]
    """``adapter_config.json`` as read."""

    def delta(self, name: str) -> torch.Tensor:
        """scale · B A for base weight `name`, in float32."""
        a, b = self.factors[name]
        return self.scale * (b.float() @ a.float())


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    """``adapter_config.json`` of `path`, refused in one line unless it is plain LoRA."""
    config_path = Path(path) / ADAPTER_CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"cannot read {config_path}: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterError(f"{config_path} is not a LoRA adapter config (peft_type LORA)")
    unsupported = [
        key for key in ("use_rslora", "use_dora", "fan_in_fan_out") if config.get(key)
    ] + ([f"bias={config['bias']}"] if config.get("bias", "none") != "none" else [])
    if unsupported:
        raise AdapterError(f"{config_path}: {', '.join(unsupported)} is not supported")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise AdapterError(f"{config_path}: r must be a positive integer, got {config.get('r')!r}")
    return config


def read_adapter(path: str | Path) -> Adapter:
    """The adapter in directory `path` (PEFT's file names and tensor keys)."""
    from safetensors.torch import load_file

    config = read_adapter_config(path)
    weights = Path(path) / ADAPTER_WEIGHTS_FILE
    try:
        tensors = load_file(str(weights), device="cpu")
    except Exception as exc:  # safetensors raises its own error type for damaged files
        raise AdapterError(f"cannot read {weights}: {exc}") from exc
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem, side = (key[: -len(_A)], "A") if key.endswith(_A) else (key[: -len(_B)], "B")
        if not key.endswith((_A, _B)) or not stem.startswith(_PREFIX):
            raise AdapterError(f"{weights} holds {key!r}, which is no LoRA A or B matrix")
        halves.setdefault(stem[len(_PREFIX) :] + ".weight", {})[side] = tensor
    factors = {}
    for name, pair in halves.items():
        if set(pair) != {"A", "B"} or pair["A"].shape[0] != pair["B"].shape[1]:
            raise AdapterError(f"{weights}: {name} has no matching A and B")
        factors[name] = (pair["A"], pair["B"])
    if not factors:
        raise AdapterError(f"{weights} holds no adapted layer")
    return Adapter(scale=config["lora_alpha"] / config["r"], factors=factors, config=config)


def merged_weights(
    base: Mapping[str, torch.Tensor], adapter: Adapter, where: str | Path = "adapter"
) -> dict[str, torch.Tensor]:
    """The adapted weights W + scale · B A (in W's dtype); every other weight is unchanged
    and left out. Raises AdapterError naming a weight the base lacks or cannot take."""
    merged: dict[str, torch.Tensor] = {}
    for name in adapter.factors:
        weight = base.get(name)
        a, b = adapter.factors[name]
        if weight is None or tuple(weight.shape) != (b.shape[0], a.shape[1]):
            found = "missing" if weight is None else f"of shape {tuple(weight.shape)}"
            raise AdapterError(
                f"{where} does not fit the base model: it adapts {name} "
                f"({b.shape[0]}x{a.shape[1]}), which the base has {found}"
            )
        merged[name] = (weight.float() + adapter.delta(name)).to(weight.dtype)
    return merged


def merge_adapter_dir(base_dir: str | Path, adapter_dir: str | Path, out: str | Path) -> Path:
    """Write base + adapter, merged, as a Hugging Face directory `out` (the base's config,
    tokenizer and other files, and one ``model.safetensors``)."""
    from safetensors.torch import save_file

    from sluice.engines.inference.weights import read_weight_files

    base_dir, out = Path(base_dir), Path(out)
    tensors = read_weight_files(base_dir)
    tensors.update(merged_weights(tensors, read_adapter(adapter_dir), adapter_dir))
    out.mkdir(parents=True, exist_ok=True)
    for path in base_dir.iterdir():
        weights = path.name.endswith((".safetensors", ".safetensors.index.json", ".bin"))
        if path.is_file() and not weights and not path.name.startswith("sluice_"):
            shutil.copyfile(path, out / path.name)
    # Tied weights are stored once in the base; safetensors refuses shared storage.
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return out
