"""Hugging Face Llama/Qwen2 <-> Megatron-core ``GPTModel``: the config and the weights.

Sluice publishes every policy version as a Hugging Face directory (what the inference
engine and SGLang load), so the Megatron backend converts on the way in and on the
way out; both directions are exact copies, no arithmetic.

Where the two layouts differ:

- attention: HF keeps ``q_proj``, ``k_proj`` and ``v_proj`` apart. Megatron fuses them
  into ``linear_qkv`` and orders the rows *per query group*: for each of the
  ``num_key_value_heads`` groups, that group's query heads, then its key head, then
  its value head (so a tensor-parallel split along the groups keeps each group whole).
  Qwen2's q/k/v biases follow the same order.
- MLP: ``linear_fc1`` is ``[gate_proj; up_proj]`` (Megatron's gated linear unit applies
  the activation to the first half); ``linear_fc2`` is ``down_proj``.
- norms: ``input_layernorm`` / ``pre_mlp_layernorm`` / ``final_layernorm``.
- tied embeddings: Megatron's ``output_layer`` then holds no weight.

Only shapes whose arithmetic both libraries compute alike are accepted (RoPE without
scaling, RMSNorm, SiLU-gated MLP, no sliding window, no MLP or output-projection
bias); anything else is refused with the field that differs.
"""

from __future__ import annotations

from typing import Any

import torch

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2"})


class UnsupportedModelError(ValueError):
    """The Hugging Face config has a feature the Megatron conversion does not carry."""


def check_supported(hf_config: Any) -> None:
    """Raise ``UnsupportedModelError`` naming the first field Megatron would compute differently."""
    model_type = str(getattr(hf_config, "model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} has no Megatron conversion; "
            f"supported: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    problems = []
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_config.hidden_act!r} (needs 'silu')")
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
        problems.append(f"rope_scaling={scaling!r} (needs none)")
    if getattr(hf_config, "mlp_bias", False):
        problems.append("mlp_bias=True (needs False)")
    if model_type == "llama" and getattr(hf_config, "attention_bias", False):
        problems.append("attention_bias=True (Megatron would add an output-projection bias too)")
    if getattr(hf_config, "use_sliding_window", False):
        problems.append("use_sliding_window=True (needs full attention)")
    if problems:
        raise UnsupportedModelError(
            f"{model_type} config differs from what the Megatron backend computes: "
            + "; ".join(problems)
        )


def head_dim(hf_config: Any) -> int:
    return int(
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )


def num_kv_heads(hf_config: Any) -> int:
    return int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)


def rope_theta(hf_config: Any) -> float:
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:  # transformers 5 keeps it in rope_parameters
        theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def transformer_config_kwargs(hf_config: Any) -> dict[str, Any]:
    """``TransformerConfig`` fields that describe the HF model's architecture.

    The caller adds parallel sizes and dtype. Fusions that need CUDA kernels are off;
    dropout is off (RL fine-tuning of a pretrained policy uses none).
    """
    check_supported(hf_config)
    return {
        "num_layers": int(hf_config.num_hidden_layers),
        "hidden_size": int(hf_config.hidden_size),
        "ffn_hidden_size": int(hf_config.intermediate_size),
        "num_attention_heads": int(hf_config.num_attention_heads),
        "num_query_groups": num_kv_heads(hf_config),
        "kv_channels": head_dim(hf_config),
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(hf_config.rms_norm_eps),
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": str(hf_config.model_type) == "qwen2",
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        "attention_softmax_in_fp32": True,
    }


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    """The vocabulary rounded up to a multiple of the tensor-parallel size.

    Megatron splits embedding and output rows evenly across tensor-parallel ranks; the
    padding rows are zero and their logits are cut off before any softmax.
    """
    return -(-vocab_size // tensor_parallel) * tensor_parallel


def gpt_model_kwargs(hf_config: Any, tensor_parallel: int = 1) -> dict[str, Any]:
    """``GPTModel`` arguments (besides config and layer spec) for the HF model."""
    return {
        "vocab_size": padded_vocab_size(int(hf_config.vocab_size), tensor_parallel),
        "max_sequence_length": int(hf_config.max_position_embeddings),
        "position_embedding_type": "rope",
        "rotary_percent": 1.0,
        "rotary_base": rope_theta(hf_config),
        "share_embeddings_and_output_weights": bool(
            getattr(hf_config, "tie_word_embeddings", False)
        ),
    }


def _layer_names(i: int) -> tuple[str, str]:
    return f"model.layers.{i}.", f"decoder.layers.{i}."


def hf_to_megatron(hf: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """A Megatron ``GPTModel`` state dict (tensor and pipeline parallel size 1) from HF weights."""
    check_supported(hf_config)
    groups, dim = num_kv_heads(hf_config), head_dim(hf_config)
    per_group = int(hf_config.num_attention_heads) // groups
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not getattr(hf_config, "tie_word_embeddings", False):
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(int(hf_config.num_hidden_layers)):
        h, m = _layer_names(i)
        attn = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        for suffix in ("weight", "bias"):
            if attn + "q_proj." + suffix not in hf:
                continue
            q = hf[attn + "q_proj." + suffix].reshape(groups, per_group * dim, -1)
            k = hf[attn + "k_proj." + suffix].reshape(groups, dim, -1)
            v = hf[attn + "v_proj." + suffix].reshape(groups, dim, -1)
            fused = torch.cat([q, k, v], dim=1).reshape(groups * (per_group + 2) * dim, -1)
            key = m + "self_attention.linear_qkv." + suffix
            out[key] = fused if suffix == "weight" else fused[:, 0]
        out[m + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        mlp = h + "mlp."
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]], dim=0
        )
        out[m + "mlp.linear_fc2.weight"] = hf[mlp + "down_proj.weight"]
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """HF weights from a Megatron ``GPTModel`` state dict (parallel sizes 1): the inverse
    of ``hf_to_megatron``. Megatron's ``_extra_state`` entries carry no weights."""
    check_supported(hf_config)
    groups, dim = num_kv_heads(hf_config), head_dim(hf_config)
    per_group = int(hf_config.num_attention_heads) // groups
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    out = {
        "model.embed_tokens.weight": mg["embedding.word_embeddings.weight"],
        "model.norm.weight": mg["decoder.final_layernorm.weight"],
    }
    if not tied:
        out["lm_head.weight"] = mg["output_layer.weight"]
    for i in range(int(hf_config.num_hidden_layers)):
        h, m = _layer_names(i)
        attn = h + "self_attn."
        out[h + "input_layernorm.weight"] = mg[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = mg[m + "pre_mlp_layernorm.weight"]
        for suffix in ("weight", "bias"):
            key = m + "self_attention.linear_qkv." + suffix
            if key not in mg:
                continue
            fused = mg[key].reshape(groups, (per_group + 2) * dim, -1)
            q, k, v = fused.split([per_group * dim, dim, dim], dim=1)
            parts = {"q_proj": q, "k_proj": k, "v_proj": v}
            for name, part in parts.items():
                flat = part.reshape(-1, part.shape[-1])
                out[attn + f"{name}.{suffix}"] = (
                    flat if suffix == "weight" else flat[:, 0]
                ).clone()
        out[attn + "o_proj.weight"] = mg[m + "self_attention.linear_proj.weight"]
        gate, up = mg[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"] = gate.clone()
        out[h + "mlp.up_proj.weight"] = up.clone()
        out[h + "mlp.down_proj.weight"] = mg[m + "mlp.linear_fc2.weight"]
    return out


# Which dimension of each Megatron weight is split across tensor-parallel ranks.
_COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")


def check_tensor_parallel(hf_config: Any, size: int) -> None:
    """Raise ``UnsupportedModelError`` unless every split tensor parallelism makes is even."""
    sizes = {
        "num_attention_heads": int(hf_config.num_attention_heads),
        "num_key_value_heads": num_kv_heads(hf_config),
        "intermediate_size": int(hf_config.intermediate_size),
    }
    uneven = [f"{name} ({value})" for name, value in sizes.items() if value % size]
    if uneven:
        raise UnsupportedModelError(
            f"trainer.tensor_parallel={size} must divide the policy's " + " and ".join(uneven)
        )


def tensor_parallel_shard(
    mg: dict[str, torch.Tensor], hf_config: Any, rank: int, size: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of a full (``hf_to_megatron``) state dict at tensor parallel ``size``.

    - q/k/v: whole query groups per rank (each keeps its query heads with their
      key/value head), which is why ``num_key_value_heads`` must divide by ``size``;
    - ``linear_fc1``: the rank's rows of the gate and of the up projection;
    - ``linear_proj`` and ``linear_fc2``: the rank's input columns;
    - embedding and output rows: the rank's slice of the padded vocabulary;
    - norms: whole on every rank.
    """
    check_tensor_parallel(hf_config, size)
    groups = num_kv_heads(hf_config)
    vocab = padded_vocab_size(int(hf_config.vocab_size), size)
    out = {}
    for name, tensor in mg.items():
        if name.endswith(_VOCAB_PARALLEL):
            padded = torch.zeros((vocab, *tensor.shape[1:]), dtype=tensor.dtype)
            padded[: tensor.shape[0]] = tensor
            out[name] = padded.chunk(size, dim=0)[rank].clone()
        elif name.endswith(_COLUMN_PARALLEL):
            by_group = tensor.reshape(groups, -1, *tensor.shape[1:])
            out[name] = by_group.chunk(size, dim=0)[rank].reshape(-1, *tensor.shape[1:]).clone()
        elif name.endswith("mlp.linear_fc1.weight"):
            gate, up = tensor.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]]).clone()
        elif name.endswith(_ROW_PARALLEL):
            out[name] = tensor.chunk(size, dim=1)[rank].clone()
        else:
            out[name] = tensor
    return out


def tensor_parallel_merge(
    shards: list[dict[str, torch.Tensor]], hf_config: Any
) -> dict[str, torch.Tensor]:
    """The full state dict from every rank's ``tensor_parallel_shard`` (rank order): its inverse."""
    size = len(shards)
    groups = num_kv_heads(hf_config)
    out = {}
    for name, first in shards[0].items():
        parts = [shard[name] for shard in shards]
        if name.endswith(_VOCAB_PARALLEL):
            out[name] = torch.cat(parts, dim=0)[: int(hf_config.vocab_size)]
        elif name.endswith(_COLUMN_PARALLEL):
            by_group = [p.reshape(groups // size, -1, *first.shape[1:]) for p in parts]
            out[name] = torch.cat(by_group, dim=0).reshape(-1, *first.shape[1:])
        elif name.endswith("mlp.linear_fc1.weight"):
            halves = [p.chunk(2, dim=0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        elif name.endswith(_ROW_PARALLEL):
            out[name] = torch.cat(parts, dim=1)
        else:
            out[name] = first
    return out


def check_pipeline_parallel(hf_config: Any, size: int) -> None:
    """Raise ``UnsupportedModelError`` unless the layers split evenly into ``size`` stages."""
    layers = int(hf_config.num_hidden_layers)
    if layers % size:
        raise UnsupportedModelError(
            f"trainer.pipeline_parallel={size} must divide the policy's "
            f"num_hidden_layers ({layers})"
        )


def _renumber_layers(mg: dict[str, torch.Tensor], shift: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in mg.items():
        if name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers.") :].split(".", 1)
            name = f"decoder.layers.{int(index) + shift}.{rest}"
        out[name] = tensor
    return out


def pipeline_stage(
    mg: dict[str, torch.Tensor], hf_config: Any, stage: int, stages: int
) -> dict[str, torch.Tensor]:
    """Stage ``stage``'s part of a full state dict at pipeline parallel ``stages``.

    A stage holds ``num_hidden_layers / stages`` consecutive layers, numbered from 0 as
    Megatron numbers a stage's own layers; the first stage adds the embedding, the last
    the final norm and the output layer. With tied embeddings and more than one stage,
    the last stage keeps its own copy of the embedding as its output layer (Megatron
    sums the two copies' gradients, so they stay equal).
    """
    check_pipeline_parallel(hf_config, stages)
    per_stage = int(hf_config.num_hidden_layers) // stages
    first, last = stage == 0, stage == stages - 1
    out = {}
    for name, tensor in _renumber_layers(mg, -stage * per_stage).items():
        if name.startswith("decoder.layers."):
            keep = 0 <= int(name.split(".")[2]) < per_stage
        elif name.startswith("embedding."):
            keep = first
        else:  # final_layernorm, output_layer
            keep = last
        if keep:
            out[name] = tensor
    if last and not first and getattr(hf_config, "tie_word_embeddings", False):
        out["output_layer.weight"] = mg["embedding.word_embeddings.weight"]
    return out


def pipeline_merge(
    stages: list[dict[str, torch.Tensor]], hf_config: Any
) -> dict[str, torch.Tensor]:
    """The full state dict from every stage's ``pipeline_stage`` (stage order): its inverse."""
    per_stage = int(hf_config.num_hidden_layers) // len(stages)
    out: dict[str, torch.Tensor] = {}
    for stage, weights in enumerate(stages):
        out.update(_renumber_layers(weights, stage * per_stage))
    if len(stages) > 1 and getattr(hf_config, "tie_word_embeddings", False):
        del out["output_layer.weight"]  # the last stage's copy of the embedding
    return out
