"""The sequences resident in the KV slots and the compute of one scheduler step.

The scheduler decides what runs (queues, pauses, aborts, weight updates);
``SlotBatch`` runs it: it prefills admitted sequences into free slots, decodes one
token for every resident sequence, samples, and releases finished sequences while
keeping the others in slot order.

Speed on small models (where a step's fixed costs, not its arithmetic, decide):

- a prompt cache keeps each prefilled prompt's K/V and last logits under the
  served weights, so the G samples of a GRPO group prefill their prompt once;
- Llama-shaped models run through ``sluice.engines.inference.decoder`` (fused
  projections, one rotary table) instead of the Hugging Face module tree;
- prefill packs whole sequences without padding, in chunks of
  ``max_prefill_tokens`` sized to stay in a CPU's cache; after a weight update
  every in-flight sequence is recomputed in these packed chunks;
- resident sequences keep their admission order in the slots (up to a shuffle
  among rows within a factor of two of each other's length, see ``release``), so
  decode attention runs over ranges of rows of similar length (``decode_buckets``)
  instead of padding every row to the longest;
- a decode step writes each layer's new K and V with one ``index_copy_`` each, and
  a GRPO group's samples copy their cached prompt K/V into their slots in one copy;
- sampling takes scalar fast paths when the batch shares one temperature.

Prefill and decode run as separate forward passes of one scheduler step (SGLang
can mix them in one).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from sluice.engines.inference.decoder import FastDecoder
from sluice.engines.inference.decoder import supports as supports_fast
from sluice.engines.inference.kv_cache import SlotKVCache
from sluice.engines.inference.prompt_cache import PromptCache, PromptEntry
from sluice.engines.inference.sampling import sample_tokens
from sluice.engines.inference.types import FinishReason, GenerationOutput, SamplingParams


@dataclass(eq=False)  # identity comparison: deque membership/removal must not compare fields
class RequestState:
    """One submitted request while it waits or runs: its prompt and what it sampled so far."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    future: Future[GenerationOutput]
    submitted_at: float
    arrival: int
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    admitted_step: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output_token_ids)

    def all_tokens(self) -> list[int]:
        return [*self.prompt, *self.output_token_ids]


Finished = tuple[RequestState, FinishReason, int | None]
"""A sequence that ended in a step: the sequence, why, and the stop token that ended it."""


class SlotBatch:
    """Resident sequences in slots ``[0, len(running))`` of a preallocated KV cache.

    ``admit`` and ``decode`` return the sequences that finished (already out of
    their slots); resolving their requests is the scheduler's business. Not
    thread-safe: the scheduler calls it under its lock.
    """

    def __init__(
        self,
        model: Any,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_batch_size: int,
        max_seq_len: int,
        max_prefill_tokens: int,
        prompt_cache_size: int | None,
        fast_forward: bool,
    ) -> None:
        config = model.config
        self.device = device
        self.dtype = dtype
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self._decoder = model.get_decoder()
        self._lm_head = model.get_output_embeddings()
        self.fast = FastDecoder(model) if fast_forward and supports_fast(model) else None
        head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        with torch.inference_mode():
            self.cache = SlotKVCache(
                int(config.num_hidden_layers),
                max_batch_size,
                kv_heads,
                max_seq_len,
                head_dim,
                dtype,
                device,
            )
        self._mask_min = torch.finfo(dtype).min
        if prompt_cache_size is not None and prompt_cache_size < 0:
            raise ValueError(f"prompt_cache_size must be >= 0, got {prompt_cache_size}")
        # At most a quarter of the slot cache's own size, whatever the entry count.
        kv_bytes = sum(t.numel() * t.element_size() for t in (*self.cache.keys, *self.cache.values))
        self.prompts = PromptCache(
            max_batch_size if prompt_cache_size is None else prompt_cache_size,
            max_bytes=kv_bytes // 4,
        )
        self.running: list[RequestState] = []
        """Resident sequences; ``running[i]`` occupies slot i (see ``release`` for the order)."""
        self.decode_forwards = 0
        self.prefill_forwards = 0
        self.generated_tokens = 0
        self.recomputed_tokens = 0
        self.prefilled_tokens = 0
        self.last_decode_context = 0
        """Context tokens (prompt + generated) the last decode step attended over, all rows."""

    def drop_all(self) -> list[RequestState]:
        """Empty the slots (their KV is forgotten) and return the sequences in slot order."""
        dropped = list(self.running)
        self.running.clear()
        return dropped

    def admit(self, seqs: list[RequestState], *, step: int, version: int) -> list[Finished]:
        """Admit new or retracted sequences into fresh slots and sample their next token.

        A new sequence whose prompt is in the prompt cache (or is prefilled earlier in
        this same admission) copies that prompt's K/V instead of running a forward.
        """
        finished: list[Finished] = []
        to_prefill: list[RequestState] = []
        reuse: list[RequestState] = []
        first_of: set[tuple[int, ...]] = set()
        for seq in seqs:
            if seq.output_token_ids:  # retracted: recompute prompt + response under new weights
                to_prefill.append(seq)
            elif seq.prompt in first_of or self.prompts.get(seq.prompt) is not None:
                reuse.append(seq)
            else:
                first_of.add(seq.prompt)
                to_prefill.append(seq)
        chunk: list[RequestState] = []
        longest = total = 0
        # Longest first, so each padded chunk holds sequences of similar length
        # (a recompute after a weight update re-prefills very uneven lengths). The
        # packed path pays for real tokens only; the padded one for rows x longest.
        packed = self.fast is not None
        for seq in sorted(to_prefill, key=lambda s: s.num_tokens, reverse=True):
            longest_if_added = max(longest, seq.num_tokens)
            cost = total + seq.num_tokens if packed else longest_if_added * (len(chunk) + 1)
            if chunk and cost > self.max_prefill_tokens:
                finished += self._prefill_chunk(chunk, step, version)
                chunk, longest_if_added, total = [], seq.num_tokens, 0
            chunk.append(seq)
            longest = longest_if_added
            total += seq.num_tokens
        if chunk:
            finished += self._prefill_chunk(chunk, step, version)
        if reuse:
            finished += self._admit_from_cache(reuse, step, version)
        return finished

    def _admit_from_cache(
        self, seqs: list[RequestState], step: int, version: int
    ) -> list[Finished]:
        finished: list[Finished] = []
        entries: list[tuple[RequestState, PromptEntry]] = []
        first_slot = len(self.running)  # of the run of slots that share entries[-1]
        for seq in seqs:
            entry = self.prompts.get(seq.prompt)
            if entry is None:  # evicted within this admission (cache smaller than it)
                finished += self._prefill_chunk([seq], step, version)
                continue
            if seq.admitted_step is None:
                seq.admitted_step = step
            if not entries or entries[-1][1] is not entry:
                # A GRPO group's samples arrive together: one copy per group, not per sample.
                self._load_run(entries, first_slot)
                first_slot = len(self.running)
            self.running.append(seq)
            entries.append((seq, entry))
        self._load_run(entries, first_slot)
        self.prompts.hits += len(entries)
        if entries:
            finished += self._sample_and_advance(
                [seq for seq, _ in entries], torch.stack([e.logits for _, e in entries]), version
            )
        return finished

    def _load_run(self, entries: list[tuple[RequestState, PromptEntry]], first_slot: int) -> None:
        """Copy the last entry's K/V into the slots from ``first_slot`` to the end."""
        copies = len(self.running) - first_slot
        if entries and copies:
            entry = entries[-1][1]
            self.cache.load(first_slot, entry.keys, entry.values, copies=copies)

    def _prefill_chunk(self, seqs: list[RequestState], step: int, version: int) -> list[Finished]:
        start = len(self.running)
        lengths = [s.num_tokens for s in seqs]
        for r, seq in enumerate(seqs):
            if seq.admitted_step is None:
                seq.admitted_step = step
            elif seq.output_token_ids:
                self.recomputed_tokens += lengths[r]
        if self.fast is not None:
            tokens = [seq.all_tokens() for seq in seqs]
            slots = list(range(start, start + len(seqs)))
            last = self.fast.prefill_packed(tokens, slots, self.cache)
        else:
            last = self._padded_prefill(seqs, lengths, start)
        logits = self._lm_head(last).float()
        self.prefill_forwards += 1
        self.prefilled_tokens += sum(lengths)
        for r, seq in enumerate(seqs):
            if not seq.output_token_ids:
                self.prompts.misses += 1
                keys, values = self.cache.snapshot(start + r, lengths[r])
                self.prompts.put(seq.prompt, PromptEntry(keys, values, logits[r].clone()))
        self.running.extend(seqs)
        return self._sample_and_advance(seqs, logits, version)

    def _padded_prefill(
        self, seqs: list[RequestState], lengths: list[int], start: int
    ) -> torch.Tensor:
        """Prefill through the Hugging Face decoder: one right-padded batch, explicit mask."""
        width, rows = max(lengths), len(seqs)
        input_ids = torch.zeros((rows, width), dtype=torch.long)
        for r, seq in enumerate(seqs):
            input_ids[r, : lengths[r]] = torch.tensor(seq.all_tokens(), dtype=torch.long)
        lengths_t = torch.tensor(lengths, device=self.device)
        positions = torch.arange(width, device=self.device)
        causal = positions[None, :] <= positions[:, None]
        allowed = causal[None] & (positions[None, None, :] < lengths_t[:, None, None])
        mask = torch.zeros((rows, 1, width, width), dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed[:, None], self._mask_min)
        self.cache.plan_prefill(start, width)
        hidden = self._forward(input_ids.to(self.device), positions[None, :].expand(rows, -1), mask)
        return hidden[torch.arange(rows, device=self.device), lengths_t - 1]

    def _forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Hugging Face decoder's hidden states over the slot cache (plan set by the caller)."""
        hidden: torch.Tensor = self._decoder(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
        ).last_hidden_state
        return hidden

    def decode(self, *, version: int) -> list[Finished]:
        """One decode step over every resident sequence."""
        seqs = list(self.running)
        position_list = [s.num_tokens - 1 for s in seqs]
        positions = torch.tensor(position_list, device=self.device)
        input_ids = torch.tensor([s.output_token_ids[-1] for s in seqs], device=self.device)
        kv_length = max(position_list) + 1
        self.last_decode_context = sum(position_list) + len(position_list)
        keys = torch.arange(kv_length, device=self.device)
        mask = torch.zeros((len(seqs), 1, 1, kv_length), dtype=self.dtype, device=self.device)
        mask.masked_fill_((keys[None, :] > positions[:, None])[:, None, None, :], self._mask_min)
        self.cache.plan_decode(position_list, kv_length)
        if self.fast is not None:
            hidden = self.fast.decode(input_ids, positions, mask, self.cache)
        else:
            hidden = self._forward(input_ids[:, None], positions[:, None], mask)[:, -1]
        logits = self._lm_head(hidden).float()
        self.decode_forwards += 1
        return self._sample_and_advance(seqs, logits, version)

    def _sample_and_advance(
        self, seqs: list[RequestState], logits: torch.Tensor, version: int
    ) -> list[Finished]:
        tokens, logprobs = sample_tokens(
            logits,
            [s.params for s in seqs],
            [s.seed for s in seqs],
            [len(s.output_token_ids) for s in seqs],
        )
        finished: list[Finished] = []
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            seq.output_token_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            if token in seq.stop_ids:
                finished.append((seq, "stop", token))
            elif (
                len(seq.output_token_ids) >= seq.params.max_new_tokens
                or seq.num_tokens >= self.max_seq_len
            ):
                finished.append((seq, "length", None))
        self.generated_tokens += len(seqs)
        if finished:
            self.release([seq for seq, _, _ in finished])
        return finished

    def release(self, seqs: list[RequestState]) -> None:
        """Take sequences out of their slots and close the gaps.

        Resident K/V lengths fall from the first slot to the last (new sequences are
        admitted behind the old ones, and a decode step lengthens every row by one),
        and the decode attention buckets rows by that order (``decode_buckets``).
        Two ways to close the gaps keep that good enough:

        - when every survivor is within a factor of two of the longest, they attend
          as one range whatever their order (and stay so: lengths that grow together
          grow closer in ratio), so each gap takes one survivor from the tail, the
          fewest rows moved, and no copy overlaps its source;
        - otherwise every survivor behind a gap moves up, once, keeping the order.
        """
        leaving = {id(s) for s in seqs}
        survivors = [s for s in self.running if id(s) not in leaving]
        if survivors and 2 * min(s.num_tokens for s in survivors) >= max(
            s.num_tokens for s in survivors
        ):
            self._fill_gaps_from_tail(leaving, len(survivors))
        else:
            self._shift_survivors_up(leaving)

    def _fill_gaps_from_tail(self, leaving: set[int], keep: int) -> None:
        gaps = [slot for slot, s in enumerate(self.running[:keep]) if id(s) in leaving]
        movers = [slot for slot, s in enumerate(self.running[keep:], keep) if id(s) not in leaving]
        if movers:
            # A resident sequence's KV covers all its tokens but the newest.
            length = max(self.running[slot].num_tokens for slot in movers) - 1
            self.cache.move(movers, gaps, length)
        survivors = self.running[:keep]
        for gap, mover in zip(gaps, movers, strict=True):
            survivors[gap] = self.running[mover]
        self.running[:] = survivors

    def _shift_survivors_up(self, leaving: set[int]) -> None:
        survivors: list[RequestState] = []
        run: list[int] = []  # consecutive survivors that move up by the same gap

        def flush() -> None:
            if run:
                # The run's first row is its longest (slot order).
                length = max(self.running[slot].num_tokens for slot in run) - 1
                self.cache.shift(run[0], run[0] - gap, len(run), length)
                run.clear()

        gap = 0
        for slot, seq in enumerate(self.running):
            if id(seq) in leaving:
                flush()
                gap += 1
                continue
            if gap:
                run.append(slot)
            survivors.append(seq)
        flush()
        self.running[:] = survivors
