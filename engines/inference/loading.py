"""Loading a local Hugging Face causal LM for serving, and what the engine reads off it.

The engine implements full attention only, so a model whose attention uses an
active sliding window shorter than ``max_seq_len`` is refused rather than
windowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")
    return _DTYPES[dtype]


def load_causal_lm(model_dir: str | Path, dtype: torch.dtype) -> Any:
    """``AutoModelForCausalLM`` from local files only, with SDPA attention, on the CPU."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            str(model_dir),
            dtype=dtype,
            local_files_only=True,
            attn_implementation="sdpa",
        )
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError by case
        raise ValueError(
            f"cannot load a causal LM from {str(model_dir)!r}: {type(exc).__name__}: {exc}"
        ) from exc


def check_attention_is_full(config: Any, max_seq_len: int) -> None:
    """Raise ValueError if the model's attention is windowed within ``max_seq_len``."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"model layer types {unknown} are not supported by the engine")
        windowed = "sliding_attention" in layer_types
    else:
        windowed = window is not None and getattr(config, "use_sliding_window", True) is not False
    if windowed and window is not None and int(window) < max_seq_len:
        raise ValueError(
            f"model uses a sliding attention window of {window} tokens; the engine only "
            f"implements full attention, so set max_seq_len <= {window}"
        )


def eos_token_ids(model: Any) -> frozenset[int]:
    """Every EOS id the model's generation config and config name."""
    ids: set[int] = set()
    sources = [getattr(model, "generation_config", None), model.config]
    for source in sources:
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else list(value))
    return frozenset(int(i) for i in ids)
