"""Prefilled prompts kept for reuse under the weights being served.

The cache matches whole prompts, not shared prefixes (no radix tree, unlike
SGLang): enough for GRPO, whose G samples of a group share their whole prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PromptEntry:
    """A prefilled prompt: its K/V per layer (``[kv_heads, P, head_dim]``) and last logits."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor


def _entry_bytes(entry: PromptEntry) -> int:
    tensors = [*entry.keys, *entry.values, entry.logits]
    return sum(t.numel() * t.element_size() for t in tensors)


class PromptCache:
    """Prefilled prompts under the current weights, least recently used evicted first.

    RL samples G responses per prompt, so most admissions repeat a prompt already
    prefilled: a hit copies the prompt's K/V into the new slot and samples the first
    token from the stored logits, with no forward pass. Cleared whenever the weights
    change, so a hit is always what a fresh prefill under the served weights gives
    (up to float rounding of the batch it was computed in).
    """

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._entries: dict[tuple[int, ...], PromptEntry] = {}
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, prompt: tuple[int, ...]) -> PromptEntry | None:
        entry = self._entries.pop(prompt, None)
        if entry is not None:
            self._entries[prompt] = entry  # most recently used last
        return entry

    def put(self, prompt: tuple[int, ...], entry: PromptEntry) -> None:
        size = _entry_bytes(entry)
        if self.capacity <= 0 or size > self.max_bytes:
            return
        old = self._entries.pop(prompt, None)
        if old is not None:
            self._bytes -= _entry_bytes(old)
        self._entries[prompt] = entry
        self._bytes += size
        while len(self._entries) > self.capacity or self._bytes > self.max_bytes:
            self._bytes -= _entry_bytes(self._entries.pop(next(iter(self._entries))))

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
