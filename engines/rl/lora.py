"""LoRA for the torch trainer (`trainer.lora`), through `peft`.

Only the adapters train: every base weight is frozen and out of the optimizer, and the
loss, the proximal pass and the micro-batching see the same model call as without LoRA.
A version after 0 is published as the adapter alone, in PEFT's format
(``sluice.engines.policy.adapter``): megabytes instead of the model. The base is version
0, which never changes, so a resuming trainer loads the base, then the adapter, and goes
on exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sluice.engines.policy.adapter import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    read_adapter_config,
)

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


def save_adapter(peft_model: Any, out: Path) -> None:
    """The adapter as PEFT writes it (``adapter_config.json``, ``adapter_model.safetensors``):
    a directory PEFT, SGLang and Sluice's engine load on top of the base."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    peft_model.peft_config[ADAPTER].save_pretrained(str(out))
    state = get_peft_model_state_dict(peft_model, adapter_name=ADAPTER)
    tensors = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(tensors, str(out / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})


def saved_settings(config: dict[str, Any]) -> dict[str, Any]:
    """`LoraSettings.as_dict` of a saved ``adapter_config.json``."""
    targets = config.get("target_modules") or []
    return {
        "rank": config.get("r"),
        "alpha": config.get("lora_alpha"),
        "dropout": config.get("lora_dropout"),
        "target_modules": sorted([targets] if isinstance(targets, str) else targets),
    }


def load_adapter(model: Any, adapter_dir: Path, settings: LoraSettings) -> Any:
    """`model` (the base) with the adapter saved in `adapter_dir` put back: the exact
    model that saved it. A fresh adapter when there is none (version 0)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    peft_model = apply_lora(model, settings)
    if not (adapter_dir / ADAPTER_CONFIG_FILE).is_file():
        return peft_model
    saved = saved_settings(read_adapter_config(adapter_dir))
    if saved != settings.as_dict():
        raise LoraError(
            f"{str(adapter_dir)!r} was trained with trainer.lora={saved}; resume it with the "
            f"same settings (now {settings.as_dict()})"
        )
    device = next(model.parameters()).device
    tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS_FILE), device=str(device))
    result = set_peft_model_state_dict(peft_model, tensors, adapter_name=ADAPTER)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise LoraError(f"{adapter_dir} holds tensors the adapter lacks: {unexpected[:3]}")
    return peft_model
