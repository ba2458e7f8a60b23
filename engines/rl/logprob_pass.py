"""Log-probs of response tokens over packed micro-batches: what every pass of the trainer
step reads (π_prox, the reference policy, π_θ with grad).

A mixin of :class:`sluice.engines.rl.trainer.PolicyTrainer`, kept apart so the step
itself reads as the algorithm. A backend (Megatron) replaces ``_logits``,
``_set_training`` and ``_map_logits``; everything here works through them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from sluice.engines.rl.batching import PackedBatch, dynamic_micro_batches, pack_sequences
from sluice.engines.rl.prompt_sharing import pack_shared_prompts, shared_prompt_micro_batches
from sluice.engines.rl.train_batch import TrainBatch, TrainerSettings, TrainingSample, make_batch


class LogprobPasses:
    """Packing, micro-batch plans and log-prob passes over a :class:`TrainBatch`."""

    settings: TrainerSettings
    device: torch.device
    make_batch = staticmethod(make_batch)

    def _logits(self, packed: PackedBatch) -> torch.Tensor:
        raise NotImplementedError

    def _set_training(self, training: bool) -> None:
        raise NotImplementedError

    def _map_logits(
        self, micro_batches: list[PackedBatch], read: Callable[[int, torch.Tensor], Any]
    ) -> list[Any]:
        raise NotImplementedError

    def packed_logprobs(
        self,
        batch: TrainBatch,
        indices: Sequence[int],
        packed: PackedBatch,
        entropy_out: list[torch.Tensor] | None = None,
        logits: torch.Tensor | None = None,
        entropy_grad: bool = False,
    ) -> torch.Tensor:
        """log π(response tokens) of the samples in `indices`, flat and in that order.

        With `entropy_out`, also appends the entropy of π at each response position
        (how undecided the policy still is where it samples); with `entropy_grad` it
        carries grad (the entropy bonus trains on it). ``logits``: the packed row's, if
        already computed.
        """
        if logits is None:
            logits = self._logits(packed)
        positions = self._response_positions(batch, indices, packed).to(logits.device)
        if logits.shape[0] == packed.total_tokens:  # every row: keep those that predict
            rows = positions - 1 if packed.logit_rows is None else packed.logit_rows
            logits = logits[rows.to(logits.device)]
        logits = logits.float() / self.settings.temperature
        targets = packed.input_ids[0, positions]
        log_norm = torch.logsumexp(logits, dim=-1)
        if entropy_out is not None:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                log_p = logits - log_norm[:, None]
                entropy_out.append(-(log_p.exp() * log_p).sum(-1))
        return logits.gather(-1, targets[:, None]).squeeze(-1) - log_norm

    @staticmethod
    def _response_positions(
        batch: TrainBatch, indices: Sequence[int], packed: PackedBatch
    ) -> torch.Tensor:
        """Where the response tokens of the samples in `indices` sit in their packed row."""
        if packed.target_positions is not None:
            return packed.target_positions
        starts = packed.cu_seqlens[:-1].to(torch.int64).cpu()
        return torch.cat(
            [
                torch.arange(batch.prompt_lens[i], batch.prompt_lens[i] + batch.response_lens[i])
                + int(starts[k])
                for k, i in enumerate(indices)
            ]
        )

    def _pack(self, batch: TrainBatch, indices: Sequence[int]) -> PackedBatch:
        """The samples in `indices` packed into one row, their logit rows marked; with
        `shared_prompt`, each distinct prompt once and its responses on top of it."""
        if self.settings.shared_prompt:
            prompts = [batch.sequences[i][: batch.prompt_lens[i]] for i in indices]
            responses = [batch.sequences[i][batch.prompt_lens[i] :] for i in indices]
            return pack_shared_prompts(prompts, responses).to(self.device)
        packed = pack_sequences([batch.sequences[i] for i in indices])
        rows = self._response_positions(batch, indices, packed) - 1
        return dataclasses.replace(packed, logit_rows=rows).to(self.device)

    def _micro_batches(self, batch: TrainBatch, indices: Sequence[int]) -> list[list[int]]:
        if self.settings.shared_prompt:
            plan = shared_prompt_micro_batches(
                [batch.sequences[i][: batch.prompt_lens[i]] for i in indices],
                [batch.response_lens[i] for i in indices],
                self.settings.max_tokens_per_micro_batch,
                self.settings.min_micro_batches,
            )
            return [[indices[j] for j in mb] for mb in plan]
        lengths = [batch.prompt_lens[i] + batch.response_lens[i] for i in indices]
        plan = dynamic_micro_batches(
            lengths, self.settings.max_tokens_per_micro_batch, self.settings.min_micro_batches
        )
        return [[indices[j] for j in mb] for mb in plan]

    @staticmethod
    def _gather(batch: TrainBatch, flat: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
        return torch.cat([batch.tokens_of(i, flat) for i in indices])

    @torch.no_grad()
    def compute_logprobs(
        self,
        batch: TrainBatch,
        entropy_out: list[torch.Tensor] | None = None,
        indices: Sequence[int] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """log π of the response tokens of the samples in `indices` (default: all) under
        the current weights, written at their places in a flat tensor (`out`, or a new one)."""
        self._set_training(False)
        chosen = list(range(len(batch.sequences))) if indices is None else list(indices)
        plan = self._micro_batches(batch, chosen)
        packed = [self._pack(batch, mb) for mb in plan]

        def read(index: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            entropy: list[torch.Tensor] | None = [] if entropy_out is not None else None
            values = self.packed_logprobs(batch, plan[index], packed[index], entropy, logits)
            return values.cpu(), entropy[0].cpu() if entropy else None

        result = (
            torch.empty(batch.response_offsets[-1], dtype=torch.float32) if out is None else out
        )
        for mb, (values, entropy) in zip(plan, self._map_logits(packed, read), strict=True):
            if entropy_out is not None:
                entropy_out.append(entropy)
            offset = 0
            for i in mb:
                n = batch.response_lens[i]
                result[batch.response_offsets[i] : batch.response_offsets[i] + n] = values[
                    offset : offset + n
                ]
                offset += n
        self._set_training(True)
        return result

    def response_logprobs(self, samples: Sequence[TrainingSample]) -> list[np.ndarray]:
        """log π of each sample's response tokens under the current weights (no grad)."""
        batch = self.make_batch(samples)
        flat = self.compute_logprobs(batch)
        return [batch.tokens_of(i, flat).numpy() for i in range(len(batch.sequences))]
