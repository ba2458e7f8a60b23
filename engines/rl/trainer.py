"""The trainer step: π_prox recompute, then decoupled PPO over dynamic micro-batches.

One call of :meth:`PolicyTrainer.train_step` is one policy version (AReaL §4):

1. π_prox: one no-grad forward pass over the whole batch with the weights as they are
   before this update, at the sampling temperature, so proximal and behaviour
   log-probs are comparable token for token.
2. Rollout correction of the behaviour weight π_prox/π_behav (sluice.engines.rl.rollout_correction)
   and the mismatch metrics (sluice.engines.rl.metrics), once over the whole batch.
3. PPO minibatches: each splits into dynamic micro-batches (AReaL Algorithm 1), packed
   without padding; every micro-batch loss is divided by the minibatch's valid-token
   count, so gradient accumulation equals the full-minibatch gradient exactly.

The trainer never branches on an algorithm name: the loss and correction arrive as
functions bound from config (`make_policy_loss`, `make_rollout_correction`).
Departure: the full-vocabulary logits are materialised, at the positions that predict a
response token only (prompt positions train nothing, and with a 49k vocabulary the LM
head is a large share of a small model's work); very large vocabularies want a chunked
log-softmax as well.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sluice.engines.policy.model import load_policy_dir
from sluice.engines.rl.batching import (
    PackedBatch,
    dynamic_micro_batches,
    pack_sequences,
    register_packed_attention,
)
from sluice.engines.rl.lora import LoraSettings, load_adapter, save_adapter
from sluice.engines.rl.loss import PolicyLoss, merge_micro_batch_metrics
from sluice.engines.rl.metrics import mismatch_metrics
from sluice.engines.rl.rollout_correction import RolloutCorrectionFn
from sluice.engines.rl.train_batch import (
    TrainBatch,
    TrainerSettings,
    TrainingSample,
    make_batch,
)
from sluice.engines.rl.trainer_files import (
    ADAPTER_DIR,
    OPTIMIZER_FILE,
    RNG_STATE_FILE,
    TRAINER_STATE_FILE,
    deferred_save,
    move_trainer_state,
    read_tokenizer_files,
    write_tokenizer_files,
)

StepGuard = Callable[[dict[str, float]], bool]
"""Asked during `train_step` whether the update may go on: once with the π_prox pass's
mismatch metrics, before any weight changes, and (torch backend) before each optimizer
step with ``{"train/grad_norm": its pre-clip norm}``. False leaves the rest of the step
unapplied (``train/applied_minibatches`` says how many were)."""

MicroBatchLossFn = Callable[[int, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``(micro-batch index, its logits) -> (its loss, its metrics)``; the loss is the
micro-batch's token sum over the minibatch's token count."""


class PolicyTrainer:
    """Holds the policy being optimised and its AdamW state."""

    backend = "torch"
    """``trainer.backend`` value of this class; recorded with every saved version."""
    _guard: StepGuard | None = None
    _refused = False

    def __init__(
        self,
        model_dir: str | Path,
        settings: TrainerSettings,
        loss_fn: PolicyLoss,
        correction_fn: RolloutCorrectionFn | None,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        decoupled: bool = True,
        lora: LoraSettings | None = None,
    ):
        self.settings = settings
        self.lora = lora if lora is not None and lora.enabled else None
        self.loss_fn = loss_fn
        self.correction_fn = correction_fn
        self.decoupled = decoupled
        self.device = torch.device(device)
        self.model, self.tokenizer = load_policy_dir(model_dir, device=device, dtype=dtype)
        self._tokenizer_files = read_tokenizer_files(model_dir)
        # Varlen attention over packed rows: Σ l² instead of T², no cross-sequence leakage.
        self.model.set_attn_implementation(register_packed_attention())
        if self.lora is not None:  # adapters only, on the base; a resume loads its adapter
            self.model = load_adapter(self.model, Path(model_dir) / ADAPTER_DIR, self.lora)
        self.model.train()
        self.optimizer = self._make_optimizer()
        self.steps_done = 0
        self._generator = torch.Generator().manual_seed(settings.seed)
        state_path = Path(model_dir) / TRAINER_STATE_FILE
        saved_state = json.loads(state_path.read_text()) if state_path.exists() else {}
        optimizer_path = Path(model_dir) / OPTIMIZER_FILE
        if optimizer_path.exists():
            # Versions written before backends were recorded are the torch backend's.
            written_by = saved_state.get("backend", "torch")
            if written_by != self.backend:
                raise ValueError(
                    f"{str(model_dir)!r} holds the {written_by} backend's optimizer state; "
                    f"resume it with trainer.backend={written_by}"
                )
            self._load_optimizer_state(optimizer_path)
        self.steps_done = int(saved_state.get("steps_done", 0))
        rng_path = Path(model_dir) / RNG_STATE_FILE
        if rng_path.exists():
            # Re-seeding on load would replay step 1's minibatch split after every restart
            # (or Prefect retry), so a resumed seeded run would leave the uninterrupted one.
            self._generator.set_state(torch.load(rng_path))

    # ------------------------------------------------ what another backend replaces

    def _make_optimizer(self) -> Any:
        return torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.settings.lr,
            betas=self.settings.adam_betas,
            eps=self.settings.adam_eps,
            weight_decay=self.settings.weight_decay,
        )

    def _load_optimizer_state(self, path: Path) -> None:
        self.optimizer.load_state_dict(torch.load(path, map_location=self.device))

    def _logits(self, packed: PackedBatch) -> torch.Tensor:
        """Logits of a packed row under the current weights: ``[rows, vocab]`` at
        ``packed.logit_rows`` (the LM head runs at those rows only), else at every token."""
        keep = {} if packed.logit_rows is None else {"logits_to_keep": packed.logit_rows}
        out = self.model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            use_cache=False,
            **packed.attention_kwargs(),
            **keep,
        )
        logits: torch.Tensor = out.logits[0]
        return logits

    def _set_training(self, training: bool) -> None:
        self.model.train(training)

    def _map_logits(
        self, micro_batches: list[PackedBatch], read: Callable[[int, torch.Tensor], Any]
    ) -> list[Any]:
        """``[read(i, logits of micro-batch i)]`` without gradients, for every micro-batch.

        Another backend may compute the logits elsewhere (the last pipeline stage) and
        split the micro-batches across data-parallel replicas; every caller still gets
        the whole list, so ``read`` must return plain, picklable values.
        """
        return [read(index, self._logits(packed)) for index, packed in enumerate(micro_batches)]

    def _optimizer_step(
        self, micro_batches: list[PackedBatch], token_counts: list[int], loss_of: MicroBatchLossFn
    ) -> tuple[float, list[dict[str, torch.Tensor]]]:
        """One optimizer step over a minibatch's micro-batches: ``(pre-clip grad norm,
        every micro-batch's loss metrics)``.

        ``loss_of(i, logits)`` is micro-batch i's loss: its token sum over the minibatch's
        token count (``sum(token_counts)``), so the accumulated gradient is the whole
        minibatch's.
        """
        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        for index, packed in enumerate(micro_batches):
            loss, metrics = loss_of(index, self._logits(packed))
            loss.backward()
            parts.append(metrics)
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        )
        if self._guard is not None and not self._guard({"train/grad_norm": grad_norm}):
            self.optimizer.zero_grad(set_to_none=True)
            self._refused = True
        elif math.isfinite(grad_norm):
            self.optimizer.step()
        return grad_norm, parts

    # ------------------------------------------------------------ log-probs

    def _packed_logprobs(
        self,
        batch: TrainBatch,
        indices: Sequence[int],
        packed: PackedBatch,
        entropy_out: list[torch.Tensor] | None = None,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """log π(response tokens) of the samples in `indices`, flat and in that order.

        With `entropy_out`, also appends the entropy of π at each response position
        (how undecided the policy still is where it samples). ``logits``: the packed
        row's, if already computed.
        """
        if logits is None:
            logits = self._logits(packed)
        positions = self._response_positions(batch, indices, packed).to(logits.device)
        if logits.shape[0] == packed.total_tokens:  # every row: keep those that predict
            logits = logits[positions - 1]  # the token at p is predicted at p - 1
        logits = logits.float() / self.settings.temperature
        targets = packed.input_ids[0, positions]
        log_norm = torch.logsumexp(logits, dim=-1)
        if entropy_out is not None:
            log_p = logits - log_norm[:, None]
            entropy_out.append(-(log_p.exp() * log_p).sum(-1))
        return logits.gather(-1, targets[:, None]).squeeze(-1) - log_norm

    @staticmethod
    def _response_positions(
        batch: TrainBatch, indices: Sequence[int], packed: PackedBatch
    ) -> torch.Tensor:
        """Where the response tokens of the samples in `indices` sit in their packed row."""
        starts = packed.cu_seqlens[:-1].to(torch.int64).cpu()
        return torch.cat(
            [
                torch.arange(batch.prompt_lens[i], batch.prompt_lens[i] + batch.response_lens[i])
                + int(starts[k])
                for k, i in enumerate(indices)
            ]
        )

    def _pack(self, batch: TrainBatch, indices: Sequence[int]) -> PackedBatch:
        """The samples in `indices` packed into one row, their logit rows marked."""
        packed = pack_sequences([batch.sequences[i] for i in indices])
        rows = self._response_positions(batch, indices, packed) - 1
        return dataclasses.replace(packed, logit_rows=rows).to(self.device)

    def _micro_batches(self, batch: TrainBatch, indices: Sequence[int]) -> list[list[int]]:
        lengths = [batch.prompt_lens[i] + batch.response_lens[i] for i in indices]
        plan = dynamic_micro_batches(
            lengths, self.settings.max_tokens_per_micro_batch, self.settings.min_micro_batches
        )
        return [[indices[j] for j in mb] for mb in plan]

    def _gather(
        self, batch: TrainBatch, flat: torch.Tensor, indices: Sequence[int]
    ) -> torch.Tensor:
        return torch.cat([batch.tokens_of(i, flat) for i in indices])

    @torch.no_grad()
    def compute_logprobs(
        self, batch: TrainBatch, entropy_out: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """log π of every response token under the current weights (flat, sample order)."""
        self._set_training(False)
        plan = self._micro_batches(batch, list(range(len(batch.sequences))))
        packed = [self._pack(batch, mb) for mb in plan]

        def read(index: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            entropy: list[torch.Tensor] | None = [] if entropy_out is not None else None
            values = self._packed_logprobs(batch, plan[index], packed[index], entropy, logits)
            return values.cpu(), entropy[0].cpu() if entropy else None

        result = torch.empty(batch.response_offsets[-1], dtype=torch.float32)
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

    # ------------------------------------------------------------ the step

    make_batch = staticmethod(make_batch)

    def _minibatch_loss(
        self,
        batch: TrainBatch,
        plan: list[list[int]],
        packed: list[PackedBatch],
        num_global_tokens: int,
        proximal: torch.Tensor,
        weights: torch.Tensor | None,
        loss_mask: torch.Tensor,
    ) -> MicroBatchLossFn:
        """The loss (and metrics) of micro-batch i of a minibatch given its logits."""

        def loss_of(
            index: int, logits: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            mb = plan[index]
            mb_weights = (
                self._gather(batch, weights, mb).to(self.device) if weights is not None else None
            )
            loss, parts = self.loss_fn(
                self._packed_logprobs(batch, mb, packed[index], logits=logits),
                self._gather(batch, proximal, mb).to(self.device),
                self._gather(batch, batch.behaviour_logprobs, mb).to(self.device),
                self._gather(batch, batch.advantages, mb).to(self.device),
                self._gather(batch, loss_mask, mb).to(self.device),
                num_global_tokens,
                behaviour_weights=mb_weights,
            )
            return loss, parts

        return loss_of

    def train_step(
        self, samples: Sequence[TrainingSample], guard: StepGuard | None = None
    ) -> dict[str, float]:
        """One policy update over `samples`; returns plain-float metrics. `guard` may
        refuse the update (see `StepGuard`)."""
        started = time.perf_counter()
        batch = self.make_batch(samples)
        n = len(batch.sequences)
        response_cu = torch.tensor(batch.response_offsets, dtype=torch.int64)
        loss_mask = batch.loss_mask

        entropies: list[torch.Tensor] = []
        proximal = self.compute_logprobs(batch, entropies)
        prox_time = time.perf_counter() - started
        weights: torch.Tensor | None = None
        corrected_mask = loss_mask
        if self.decoupled and self.correction_fn is not None:
            correction = self.correction_fn(
                proximal, batch.behaviour_logprobs, loss_mask, cu_seqlens=response_cu
            )
            weights, corrected_mask = correction.behaviour_weights, correction.loss_mask
        metrics = mismatch_metrics(
            proximal,
            batch.behaviour_logprobs,
            loss_mask,
            cu_seqlens=response_cu,
            behaviour_weights=weights,
            corrected_loss_mask=corrected_mask,
        )

        self._guard, self._refused = guard, guard is not None and not guard(dict(metrics))
        order = torch.randperm(n, generator=self._generator).tolist()
        minibatches = [
            order[k :: self.settings.ppo_minibatches] for k in range(self.settings.ppo_minibatches)
        ]
        loss_parts: list[dict[str, torch.Tensor]] = []
        grad_norms = []
        micro_batch_count = 0
        applied = 0
        for minibatch in minibatches:
            if self._refused:
                break
            if not minibatch:
                continue
            plan = self._micro_batches(batch, minibatch)
            packed = [self._pack(batch, mb) for mb in plan]
            # Trained tokens only: a tool's observation tokens are not in the mean.
            token_counts = [int(self._gather(batch, loss_mask, mb).sum()) for mb in plan]
            micro_batch_count += len(plan)
            loss_of = self._minibatch_loss(
                batch,
                plan,
                packed,
                sum(token_counts),
                proximal,
                weights,
                corrected_mask,
            )
            grad_norm, parts = self._optimizer_step(packed, token_counts, loss_of)
            grad_norms.append(grad_norm)
            loss_parts.extend(parts)
            applied += not self._refused
        self._guard = None
        self.steps_done += applied > 0
        if loss_parts:  # none when the guard refused the update before any gradient
            metrics.update(merge_micro_batch_metrics(loss_parts))
        # Each minibatch's loss sums to its own token mean: report the mean over minibatches.
        metrics["loss/policy_loss"] = metrics.get("loss/policy_loss", 0.0) / max(
            1, len(minibatches)
        )
        elapsed = time.perf_counter() - started
        trained_tokens = int(sum(len(s) for s in batch.sequences))
        metrics.update(
            {
                "policy/entropy": float(torch.cat(entropies).mean()),
                "train/grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
                "train/grad_norm_max": float(np.max(grad_norms)) if grad_norms else 0.0,
                "train/samples": float(n),
                "train/response_tokens": float(batch.response_offsets[-1]),
                "train/trained_tokens": float(trained_tokens),
                "train/micro_batches": float(micro_batch_count),
                "train/applied_minibatches": float(applied),
                "train/step_time_s": elapsed,
                "train/proximal_time_s": prox_time,
                "train/trained_tokens_per_s": trained_tokens / elapsed if elapsed > 0 else 0.0,
            }
        )
        return metrics

    def close(self) -> None:
        """Release what the trainer holds beyond this process (nothing, for this backend)."""

    def response_logprobs(self, samples: Sequence[TrainingSample]) -> list[np.ndarray]:
        """log π of each sample's response tokens under the current weights (no grad)."""
        batch = self.make_batch(samples)
        flat = self.compute_logprobs(batch)
        return [batch.tokens_of(i, flat).numpy() for i in range(len(batch.sequences))]

    def save(
        self,
        out_dir: str | Path,
        *,
        include_optimizer: bool = True,
        state_dir: str | Path | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Write an HF model directory that inference engines load; the trainer state (optimizer,
        RNG, trainer_state.json with `extra`) goes to `state_dir` if given, else beside it."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if not self._save_weights_and_optimizer(out, include_optimizer):
            return out
        state = out if state_dir is None else Path(state_dir)
        if state != out:  # every rank's optimizer shard is on disk by now
            move_trainer_state(out, state)
        if self.lora is None:  # an adapter version reads the tokenizer of its base
            write_tokenizer_files(self._tokenizer_files, self.tokenizer, out)
        if include_optimizer:
            torch.save(self._generator.get_state(), state / RNG_STATE_FILE)
        saved = {**self._saved_state(), **(extra or {})}
        (state / TRAINER_STATE_FILE).write_text(json.dumps(saved, indent=2))
        return out

    def save_later(self) -> Callable[..., Path] | None:
        """What ``save`` would write now, copied to host memory, and a function that
        writes it later (same arguments as ``save``, same files; its ``weights`` is the
        copied state dict): the trainer goes on training while the checkpoint of the
        step before is written (``trainer_files.deferred_save``). None when this trainer
        saves only now (a LoRA adapter is megabytes; a backend with its own save)."""
        if self.lora is not None or (
            type(self)._save_weights_and_optimizer is not PolicyTrainer._save_weights_and_optimizer
        ):
            return None
        return deferred_save(
            self.model,
            self.optimizer,
            self._generator.get_state(),
            self._saved_state(),
            self.tokenizer,
            self._tokenizer_files,
        )

    def _saved_state(self) -> dict[str, Any]:
        """What ``trainer_state.json`` records about this trainer."""
        saved: dict[str, Any] = {"steps_done": self.steps_done, "backend": self.backend}
        if self.lora is not None:
            saved["lora"] = self.lora.as_dict()
        return saved

    def _save_weights_and_optimizer(self, out: Path, include_optimizer: bool) -> bool:
        """Write the HF weights (and optimizer state); False if another process writes the rest."""
        if self.lora is not None:  # the adapter alone: its base is version 0
            save_adapter(self.model, out)
        else:
            self.model.save_pretrained(out, safe_serialization=True)
        if include_optimizer:
            torch.save(self.optimizer.state_dict(), out / OPTIMIZER_FILE)
        return True
