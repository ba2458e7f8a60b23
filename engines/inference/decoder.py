"""A lean forward pass for Llama-shaped decoders, over the engine's slot KV cache.

Hugging Face's module tree costs a fixed amount of Python per layer and per call
(seven projections, module dispatch, rotary embeddings recomputed in every layer).
For the small policies Sluice trains on a CPU that fixed cost is most of a decode
step. This forward does the same arithmetic with fewer, larger calls:

- q/k/v are one matmul and gate/up another: the fused weight tensors are allocated
  here and the model's own ``q_proj.weight`` etc. are rebound to views into them, so
  a weight update that copies into the model's parameters updates the fused
  tensors too, and the Hugging Face forward (still used by anything else that holds
  the model) computes with the same numbers;
- on a CPU every projection weight is stored column-major (the transpose is the
  contiguous tensor, the ``[out, in]`` parameter a view of it): ``F.linear`` then
  runs a plain GEMM instead of one with a transposed operand, which at decode sizes
  (8-64 rows, 128-768 wide) is 15-50% faster per projection;
- the rotary cos/sin are gathered once per forward, not computed once per layer, and
  rotating half the head is one ``roll`` against a sign-folded sin table;
- RMSNorm is ``torch.nn.functional.rms_norm``.

The result matches the Hugging Face forward up to float rounding (see
tests/unit/test_inference.py). Only model types whose layer is exactly
"RMSNorm → attention (optional q/k/v bias) → RMSNorm → SiLU-gated MLP" take it;
anything else keeps the Hugging Face forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from sluice.engines.inference.kv_cache import SlotKVCache

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})


@dataclass
class _Layer:
    ln_in: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    ln_post: torch.Tensor
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor


def supports(model: Any) -> bool:
    """True if ``model``'s decoder layers have the shape this forward computes."""
    config = model.config
    if str(getattr(config, "model_type", "")) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return False
    layers = model.get_decoder().layers
    expected = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
    for layer in layers:
        children = {name for name, _ in layer.named_children()}
        attention = {name for name, _ in layer.self_attn.named_children()}
        if children != expected or attention != {"q_proj", "k_proj", "v_proj", "o_proj"}:
            return False
    return True


def _fuse(
    modules: list[torch.nn.Linear], attr: str, *, column_major: bool = False
) -> torch.Tensor | None:
    """One tensor holding ``attr`` of every module, each module's own rebound to a view.

    ``column_major`` (weights only): the ``[in, sum(out)]`` transpose is what is
    allocated, and the returned ``[sum(out), in]`` tensor is a view of it.
    """
    parts = [getattr(m, attr) for m in modules]
    if any(p is None for p in parts):
        if not all(p is None for p in parts):
            raise ValueError(f"some projections have a {attr} and some do not")
        return None
    if column_major:
        fused = torch.cat([p.detach().t() for p in parts], dim=1).contiguous().t()
    else:
        fused = torch.cat([p.detach() for p in parts], dim=0)
    offset = 0
    for module, part in zip(modules, parts, strict=True):
        rows = part.shape[0]
        getattr(module, attr).data = fused[offset : offset + rows]
        offset += rows
    return fused


class FastDecoder:
    """``decode`` one token per resident row and ``prefill_packed`` whole sequences."""

    def __init__(self, model: Any) -> None:
        if not supports(model):
            raise ValueError(f"model type {model.config.model_type!r} has no fast forward")
        config = model.config
        decoder = model.get_decoder()
        self.embed = decoder.embed_tokens.weight
        self.rotary = decoder.rotary_emb
        self.final_norm = decoder.norm.weight
        self.eps = float(config.rms_norm_eps)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        )
        self.scaling = self.head_dim**-0.5
        # cos/sin of every position, computed once by the model's own rotary module
        # (whatever its scaling type); a forward gathers its rows.
        positions = torch.arange(int(config.max_position_embeddings))[None]
        probe = torch.zeros((), dtype=self.embed.dtype, device=self.embed.device)
        with torch.no_grad():
            cos, sin = self.rotary(probe, positions.to(self.embed.device))
        # rotate_half(x) = (-x2, x1) = roll(x, half) * (-1, ..., -1, 1, ..., 1): the sign
        # goes into the sin table once (negation is exact, so the numbers do not change).
        half = self.head_dim // 2
        sign = torch.ones(self.head_dim, dtype=sin.dtype, device=sin.device)
        sign[:half] = -1
        self.cos, self.sin_signed = cos[0], sin[0] * sign
        # Only on a CPU: a GPU's GEMM takes either layout at the same speed.
        column_major = self.embed.device.type == "cpu"
        self.layers: list[_Layer] = []
        with torch.no_grad():
            for layer in decoder.layers:
                attn, mlp = layer.self_attn, layer.mlp
                qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
                qkv_weight = _fuse(qkv, "weight", column_major=column_major)
                o_weight = _fuse([attn.o_proj], "weight", column_major=column_major)
                gate_up = [mlp.gate_proj, mlp.up_proj]
                gate_up_weight = _fuse(gate_up, "weight", column_major=column_major)
                down_weight = _fuse([mlp.down_proj], "weight", column_major=column_major)
                assert qkv_weight is not None and gate_up_weight is not None
                assert o_weight is not None and down_weight is not None
                self.layers.append(
                    _Layer(
                        ln_in=layer.input_layernorm.weight,
                        qkv_weight=qkv_weight,
                        qkv_bias=_fuse(qkv, "bias"),
                        o_weight=o_weight,
                        o_bias=attn.o_proj.bias,
                        ln_post=layer.post_attention_layernorm.weight,
                        gate_up_weight=gate_up_weight,
                        down_weight=down_weight,
                    )
                )

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: SlotKVCache,
    ) -> torch.Tensor:
        """One token per row: ``[rows]`` ids at ``[rows]`` positions -> ``[rows, hidden]``.

        ``cache`` holds a decode plan (``plan_decode``) for these rows; each layer writes
        its new K/V there and attends over the rows' cached keys under
        ``attention_mask`` (``[rows, 1, 1, keys]``, additive).
        """
        rows = input_ids.shape[0]
        hidden = F.embedding(input_ids, self.embed)
        # [rows, 1, head_dim]: broadcast over the q and k heads together.
        cos = self.cos[positions][:, None]
        sin = self.sin_signed[positions][:, None]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk_size, q_size = (heads + kv_heads) * head_dim, heads * head_dim
        size, half, buckets = hidden.shape[-1], head_dim // 2, cache.decode_buckets
        for index, layer in enumerate(self.layers):
            normed = F.rms_norm(hidden, (size,), layer.ln_in, self.eps)
            qkv = F.linear(normed, layer.qkv_weight, layer.qkv_bias)
            # One rotary pass over the q and k heads side by side.
            qk = qkv[:, :qk_size].view(rows, heads + kv_heads, head_dim)
            qk = qk * cos + qk.roll(half, -1) * sin
            v = qkv[:, qk_size:].view(rows, kv_heads, 1, head_dim)
            keys, values = cache.update(qk[:, heads:, None], v, index)
            attended = self._bucketed_decode_attention(
                qk[:, :heads, None], keys, values, attention_mask, buckets
            )
            hidden = hidden + F.linear(attended.view(rows, q_size), layer.o_weight, layer.o_bias)
            normed = F.rms_norm(hidden, (size,), layer.ln_post, self.eps)
            gate, up = F.linear(normed, layer.gate_up_weight).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer.down_weight)
        return F.rms_norm(hidden, (size,), self.final_norm, self.eps)

    def prefill_packed(
        self, tokens: list[list[int]], slots: list[int], cache: SlotKVCache
    ) -> torch.Tensor:
        """Prefill whole sequences without padding; returns each one's last hidden state.

        The projections and the MLP run over all sequences' tokens packed into one
        matrix (no pad token costs a multiply); attention runs per sequence, causal,
        over its own keys; each sequence's K/V is written into its slot at ``[0, n)``.
        """
        device = self.embed.device
        lengths = [len(t) for t in tokens]
        ids = torch.tensor([t for seq in tokens for t in seq], device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        total = ids.shape[0]
        hidden = F.embedding(ids, self.embed)
        cos, sin = self.cos[positions][:, None], self.sin_signed[positions][:, None]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        size = hidden.shape[-1]
        gqa = heads != kv_heads
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        for index, layer in enumerate(self.layers):
            normed = F.rms_norm(hidden, (size,), layer.ln_in, self.eps)
            qkv = F.linear(normed, layer.qkv_weight, layer.qkv_bias)
            qk = qkv[:, : q_size + kv_size].view(total, heads + kv_heads, head_dim)
            qk = (qk * cos + qk.roll(head_dim // 2, -1) * sin).transpose(0, 1)  # [heads+kv, N, d]
            v = qkv[:, q_size + kv_size :].view(total, kv_heads, head_dim).transpose(0, 1)
            key_buffer, value_buffer = cache.keys[index], cache.values[index]
            attended = torch.empty((heads, total, head_dim), dtype=hidden.dtype, device=device)
            for r, slot in enumerate(slots):
                lo, hi = bounds[r], bounds[r + 1]
                k, v_r = qk[heads:, lo:hi], v[:, lo:hi]
                key_buffer[slot, :, : hi - lo] = k
                value_buffer[slot, :, : hi - lo] = v_r
                attended[:, lo:hi] = F.scaled_dot_product_attention(
                    qk[None, :heads, lo:hi],
                    k[None],
                    v_r[None],
                    is_causal=True,
                    scale=self.scaling,
                    enable_gqa=gqa,
                )[0]
            attended = attended.transpose(0, 1).reshape(total, q_size)
            hidden = hidden + F.linear(attended, layer.o_weight, layer.o_bias)
            normed = F.rms_norm(hidden, (size,), layer.ln_post, self.eps)
            gate, up = F.linear(normed, layer.gate_up_weight).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer.down_weight)
        last = torch.tensor([b - 1 for b in bounds[1:]], device=device)
        return F.rms_norm(hidden[last], (size,), self.final_norm, self.eps)

    def _bucketed_decode_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        buckets: list[tuple[int, int, int]],
    ) -> torch.Tensor:
        """Decode attention per range of rows, each over its own longest row's keys."""
        if len(buckets) <= 1:
            return self._decode_attention(q, keys, values, mask)
        out = torch.empty_like(q)
        for start, end, width in buckets:
            out[start:end] = self._decode_attention(
                q[start:end],
                keys[start:end, :, :width],
                values[start:end, :, :width],
                mask[start:end, ..., :width],
            )
        return out

    def _decode_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """One query per row: two batched matmuls beat SDPA's CPU kernel at this size.

        Query heads that share a K/V head (GQA) are stacked in the matmul's row
        dimension, so K/V are never repeated.
        """
        rows = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        q = q.reshape(rows, self.num_kv_heads, group, self.head_dim)
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(self.scaling).add_(mask)
        out = torch.matmul(scores.softmax(dim=-1), values)
        return out.reshape(rows, self.num_heads, 1, self.head_dim)
