"""The engine's preallocated per-slot K/V cache and how decode attention reads it.

Resident sequences always occupy slots ``[0, b)`` with lengths falling from the
first to the last (the engine compacts on release), so a decode step reads views of
the cache, not gathers, and rows of similar length can attend together
(``decode_buckets``).
"""

from __future__ import annotations

from typing import Any

import torch


def decode_buckets(lengths: list[int]) -> list[tuple[int, int, int]]:
    """``(start, end, keys)`` ranges of rows that attend together in a decode step.

    One padded batch makes every row read the longest row's keys; decode attention
    on a CPU is bound by reading the K/V cache, so that padding is most of its cost
    when response lengths are long-tailed. Resident rows are kept in admission
    order (lengths fall from first to last, but for rows within a factor of two of
    each other, which never split a range), so contiguous ranges are views into
    the cache: a new range starts where a row needs under half the keys of its
    range's first row, at most four ranges, none under eight rows.
    """
    buckets: list[tuple[int, int, int]] = []
    start, widest = 0, 0
    for row, length in enumerate(lengths):
        if (
            row - start >= 8
            and 2 * length < widest
            and len(buckets) < 3
            and len(lengths) - row >= 8
        ):
            buckets.append((start, row, widest))
            start, widest = row, 0
        widest = max(widest, length)
    buckets.append((start, len(lengths), widest))
    return buckets


class SlotKVCache:
    """Preallocated K/V tensors ``[slots, kv_heads, max_seq_len, head_dim]`` per layer.

    Duck-types the one method Hugging Face attention calls (``update``). The
    engine sets a plan before each forward: a prefill writes rows
    ``[start, start + k)`` at positions ``[0, T)``; a decode writes one token
    per row ``r < b`` at that row's own position. Resident sequences always
    occupy slots ``[0, b)`` (the engine compacts on release), so the decode
    read is a view, not a gather.
    """

    def __init__(
        self,
        num_layers: int,
        slots: int,
        kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (slots, kv_heads, max_seq_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._mode = "prefill"
        self._start = 0
        self._length = 0
        self._rows = 0
        self._flat_index: torch.Tensor | None = None
        self._heads = torch.arange(kv_heads, device=device)
        self.decode_buckets: list[tuple[int, int, int]] = []
        """Set by ``plan_decode``: see ``decode_buckets``."""

    def plan_prefill(self, start: int, length: int) -> None:
        self._mode, self._start, self._length = "prefill", start, length

    def plan_decode(self, positions: list[int], kv_length: int) -> None:
        """Rows ``[0, len(positions))`` each write one token at their own position."""
        self._mode, self._length, self._rows = "decode", kv_length, len(positions)
        # Row r, head h, position p of a [slots, heads, seq, dim] tensor is row
        # (r * heads + h) * seq + p of its [-1, dim] view: one index_copy_ per tensor
        # writes every row's new K (or V), cheaper than a two-index advanced assignment.
        _, heads, seq, _ = self.keys[0].shape
        position_t = torch.tensor(positions, device=self._heads.device)
        rows = torch.arange(len(positions), device=self._heads.device)
        flat = (rows[:, None] * heads + self._heads) * seq + position_t[:, None]
        self._flat_index = flat.view(-1)
        self.decode_buckets = decode_buckets([p + 1 for p in positions])

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        rows = key_states.shape[0]
        if self._mode == "prefill":
            end, t = self._start + rows, key_states.shape[2]
            keys[self._start : end, :, :t] = key_states
            values[self._start : end, :, :t] = value_states
            return keys[self._start : end, :, :t], values[self._start : end, :, :t]
        assert self._flat_index is not None and rows == self._rows
        dim = keys.shape[-1]
        keys.view(-1, dim).index_copy_(0, self._flat_index, key_states.reshape(-1, dim))
        values.view(-1, dim).index_copy_(0, self._flat_index, value_states.reshape(-1, dim))
        return keys[:rows, :, : self._length], values[:rows, :, : self._length]

    def snapshot(self, slot: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of one slot's K/V over positions ``[0, length)``, per layer."""
        return (
            [k[slot, :, :length].clone() for k in self.keys],
            [v[slot, :, :length].clone() for v in self.values],
        )

    def load(
        self, slot: int, keys: list[torch.Tensor], values: list[torch.Tensor], copies: int = 1
    ) -> None:
        """Write stored per-layer K/V (``[kv_heads, P, head_dim]``) at ``[0, P)`` of slots
        ``[slot, slot + copies)``."""
        length = keys[0].shape[1]
        end = slot + copies
        for dst, src in zip(self.keys, keys, strict=True):
            dst[slot:end, :, :length] = src
        for dst, src in zip(self.values, values, strict=True):
            dst[slot:end, :, :length] = src

    @torch.inference_mode()
    def move(self, sources: list[int], targets: list[int], length: int) -> None:
        """Copy slot ``sources[i]`` to ``targets[i]`` over positions ``[0, length)``.

        The two lists must not share a slot (nothing is read after it is written).
        """
        if len(sources) == 1:
            (source,), (target,) = sources, targets
            for tensor in (*self.keys, *self.values):
                tensor[target, :, :length] = tensor[source, :, :length]
            return
        device = self.keys[0].device
        source_t = torch.tensor(sources, device=device)
        target_t = torch.tensor(targets, device=device)
        for tensor in (*self.keys, *self.values):
            window = tensor[:, :, :length]
            window.index_copy_(0, target_t, window.index_select(0, source_t))

    @torch.inference_mode()
    def shift(self, source: int, target: int, rows: int, length: int) -> None:
        """Move slots ``[source, source + rows)`` to ``[target, ...)`` over positions ``[0, length)``."""
        overlap = source - target < rows  # then the block must be read before it is written
        for tensor in (*self.keys, *self.values):
            block = tensor[source : source + rows, :, :length]
            tensor[target : target + rows, :, :length] = block.clone() if overlap else block
