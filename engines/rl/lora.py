"""LoRA for the torch trainer (`trainer.lora`), through `peft`.

Only the adapters train: every base weight is frozen and out of the optimizer, and the
loss, the proximal pass and the micro-batching see the same model call as without LoRA.
A version is published as merged weights (W + (alpha / r) * B A for every adapted
layer), a plain Hugging Face directory that every engine loads as before; the trainer
state beside it keeps what a resuming trainer needs to go on exactly where it stopped:
the base weights and the adapter, apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sluice.engines.rl.trainer_files import LORA_STATE_FILES

LORA_BASE_FILE, LORA_ADAPTER_FILE = LORA_STATE_FILES
"""Trainer state: the frozen base weights the adapter is trained on, and the adapter's
A and B matrices."""
ADAPTER = "default"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraError(ValueError):
    """LoRA settings this model cannot take (said in one line)."""


@dataclass(frozen=True)
class LoraSettings:
    """What `trainer.lora` asks: rank r (0 = off), alpha, dropout, adapted module names."""

    rank: int = 0
    alpha: int = 16
    dropout: float = 0.0
    target_modules: Sequence[str] = field(default_factory=lambda: DEFAULT_TARGETS)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "target_modules": sorted(self.target_modules),
        }


def linear_layers(model: torch.nn.Module) -> dict[str, list[torch.nn.Linear]]:
    """The model's linear layers by their last name (q_proj, down_proj, ...)."""
    found: dict[str, list[torch.nn.Linear]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            found.setdefault(name.rsplit(".", 1)[-1], []).append(module)
    return found


def check_settings(model: torch.nn.Module, settings: LoraSettings) -> None:
    """Refuse, in one line, modules the model lacks and a rank a layer cannot hold."""
    layers = linear_layers(model)
    missing = sorted(set(settings.target_modules) - set(layers))
    if missing or not settings.target_modules:
        raise LoraError(
            f"trainer.lora.target_modules {sorted(settings.target_modules)}: the model has "
            f"no {', '.join(missing) or 'modules named'}; its linear layers are "
            f"{', '.join(sorted(layers))}"
        )
    smallest = min(
        min(layer.in_features, layer.out_features)
        for name in settings.target_modules
        for layer in layers[name]
    )
    if settings.rank > smallest:
        raise LoraError(
            f"trainer.lora.rank={settings.rank} is larger than the smallest adapted layer "
            f"({smallest}); a rank up to {smallest} fits"
        )


def check_model_dir(model_dir: str | Path, settings: LoraSettings) -> None:
    """`check_settings` against the model in `model_dir`, built without its weights
    (on the meta device: seconds for any size)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    check_settings(model, settings)


def apply_lora(model: Any, settings: LoraSettings) -> Any:
    """`model` with a fresh adapter (B = 0, so it computes what `model` computes); only
    the adapter's parameters require gradients."""
    from peft import LoraConfig, get_peft_model

    check_settings(model, settings)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
    )
    return get_peft_model(model, config, adapter_name=ADAPTER)


def _lora_layers(peft_model: Any) -> dict[str, Any]:
    """Adapted layers by the name their weight has in the plain model."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    return {
        name: module
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A
    }


def _plain(name: str) -> str:
    return name.replace(".base_layer", "")


def base_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    """The frozen base weights, named as in the plain model (no adapter tensors)."""
    state = peft_model.get_base_model().state_dict()
    return {_plain(k): v for k, v in state.items() if ".lora_" not in k}


def adapter_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors (A and B of every adapted layer)."""
    state = peft_model.get_base_model().state_dict()
    return {k: v for k, v in state.items() if ".lora_" in k}


def merged_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    """The plain model's weights with every adapter folded in: W + scale * B A. The
    model itself is left as it is (nothing merged in place and taken out again)."""
    # Weights no adapter touches stay the model's own tensors (tied ones stay tied).
    merged = {k: v.detach() for k, v in base_state_dict(peft_model).items()}
    with torch.no_grad():
        for name, layer in _lora_layers(peft_model).items():
            key = f"{name}.weight"
            delta = layer.get_delta_weight(ADAPTER).detach()
            merged[key] = (merged[key] + delta.to(merged[key].dtype)).contiguous()
    return merged


def save_merged(peft_model: Any, out: Path) -> None:
    """The merged weights as a Hugging Face directory (config and safetensors)."""
    base = peft_model.get_base_model()
    base.save_pretrained(out, state_dict=merged_state_dict(peft_model), safe_serialization=True)


def save_parts(peft_model: Any, state_dir: Path, settings: LoraSettings) -> None:
    """Base weights and adapter into the trainer state directory."""
    from safetensors.torch import save_file

    base: dict[str, torch.Tensor] = {}
    tied: list[str] = []
    seen: set[int] = set()
    for key, value in base_state_dict(peft_model).items():
        # Tied weights (input and output embeddings) are one tensor: stored once.
        if value.data_ptr() in seen:
            tied.append(key)
            continue
        seen.add(value.data_ptr())
        base[key] = value.detach().contiguous()
    meta = {"lora": str(settings.as_dict()), "tied": ",".join(tied)}
    save_file(base, str(state_dir / LORA_BASE_FILE), metadata=meta)
    adapter = {k: v.detach().contiguous() for k, v in adapter_state_dict(peft_model).items()}
    save_file(adapter, str(state_dir / LORA_ADAPTER_FILE), metadata=meta)


def load_parts(model: Any, model_dir: Path, settings: LoraSettings) -> Any:
    """`model` (loaded from a published, merged version) with the base weights and the
    adapter of the trainer state in `model_dir` put back: the exact model that saved
    them. A fresh adapter on `model` when the directory has none (version 0)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    base_path, adapter_path = model_dir / LORA_BASE_FILE, model_dir / LORA_ADAPTER_FILE
    if not base_path.is_file():
        return apply_lora(model, settings)
    with safe_open(str(base_path), "pt") as handle:
        metadata = handle.metadata() or {}
    saved, tied = metadata.get("lora"), set(filter(None, metadata.get("tied", "").split(",")))
    if saved != str(settings.as_dict()):
        raise LoraError(
            f"{str(model_dir)!r} was trained with trainer.lora={saved}; resume it with the "
            f"same settings (now {settings.as_dict()})"
        )
    device = next(model.parameters()).device
    result = model.load_state_dict(load_file(str(base_path), device=str(device)), strict=False)
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise LoraError(
            f"{base_path} does not fit this model (missing {sorted(result.missing_keys)[:3]}, "
            f"unexpected {sorted(result.unexpected_keys)[:3]})"
        )
    peft_model = apply_lora(model, settings)
    adapter = load_file(str(adapter_path), device=str(device))
    state = peft_model.get_base_model().state_dict()
    unknown = sorted(set(adapter) - set(state))
    if unknown:
        raise LoraError(f"{adapter_path} holds tensors the adapter lacks: {unknown[:3]}")
    with torch.no_grad():
        for key, value in adapter.items():
            state[key].copy_(value)
    return peft_model
