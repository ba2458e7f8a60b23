"""The trainer step: decoupled PPO over dynamic micro-batches, π_prox from the step's own
forward pass where that is exact.

One call of :meth:`PolicyTrainer.train_step` is one policy version (AReaL §4):

1. The batch is split into ``ppo_epochs × ppo_minibatches`` optimizer steps (each epoch
   a fresh seeded split); each minibatch splits into dynamic micro-batches (AReaL
   Algorithm 1), packed without padding, and its loss is aggregated over the whole
   minibatch, so gradient accumulation equals the full-minibatch gradient exactly.
2. π_prox, the weights before this update, at the sampling temperature. Before the
   first optimizer step the weights are π_prox, so the first minibatch's own forward
   pass gives its log π_prox exactly (`sluice.engines.rl.proximal`); the other
   minibatches' come from one no-grad pass (``proximal: exact``) or the log-linear
   approximation (``loglinear``). A backend without that place (Megatron) or a model
   with dropout runs the no-grad pass over the whole batch first, as before.
3. Rollout correction of the behaviour weight π_prox/π_behav
   (sluice.engines.rl.rollout_correction) and the mismatch metrics
   (sluice.engines.rl.metrics). The watchdog's guard sees them before any weight
   changes: with the pass, before the first forward; without it, after the first
   minibatch's backward and before its optimizer step.
4. Optional terms (`sluice.engines.rl.step_loss`): a KL penalty to the reference policy
   (version 0; one no-grad pass per step, reported) and an entropy bonus.

The trainer never branches on an algorithm name: the loss and correction arrive as
functions bound from config (`make_policy_loss`, `make_rollout_correction`).
Departure: the full-vocabulary logits are materialised, at the positions that predict a
response token only (prompt positions train nothing, and with a 49k vocabulary the LM
head is a large share of a small model's work); very large vocabularies want a chunked
log-softmax as well.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sluice.engines.policy.model import load_policy_dir
from sluice.engines.rl.advantages import AdvantageFn
from sluice.engines.rl.batching import PackedBatch, register_packed_attention
from sluice.engines.rl.logprob_pass import LogprobPasses
from sluice.engines.rl.lora import LoraSettings, load_adapter, save_adapter
from sluice.engines.rl.loss import SUMMED_LOSSES, merge_micro_batch_metrics
from sluice.engines.rl.loss_inputs import PolicyLoss
from sluice.engines.rl.rollout_correction import RolloutCorrectionFn
from sluice.engines.rl.schedules import lr_multiplier
from sluice.engines.rl.step_loss import (
    MicroBatchLossFn,
    ProximalState,
    kl_reward_advantages,
    minibatch_loss,
    settle,
)
from sluice.engines.rl.train_batch import TrainBatch, TrainerSettings, TrainingSample
from sluice.engines.rl.trainer_files import (
    ADAPTER_DIR,
    OPTIMIZER_FILE,
    RNG_STATE_FILE,
    TRAINER_STATE_FILE,
    deferred_save,
    load_optimizer_state,
    move_trainer_state,
    read_tokenizer_files,
    save_optimizer_state,
    write_tokenizer_files,
)

StepGuard = Callable[[dict[str, float]], bool]
"""Asked during `train_step` whether the update may go on: once with the mismatch
metrics of π_prox, before any weight changes, and (torch backend) before each optimizer
step with ``{"train/grad_norm": its pre-clip norm}``. False leaves the rest of the step
unapplied (``train/applied_minibatches`` says how many were)."""

__all__ = ["MicroBatchLossFn", "PolicyTrainer", "StepGuard", "OPTIMIZER_FILE", "TRAINER_STATE_FILE"]


class PolicyTrainer(LogprobPasses):
    """Holds the policy being optimised and its AdamW state."""

    backend = "torch"
    """``trainer.backend`` value of this class; recorded with every saved version."""
    free_proximal = True
    """Whether the first minibatch's forward may stand in for the π_prox pass (see
    `_proximal_is_free`)."""
    reference: Any = None
    """The frozen reference policy of the KL penalty (full fine-tuning only)."""
    _guard: StepGuard | None = None
    _refused = False
    supports_update_fence = True
    """Whether `update_fence` is honoured (the torch backend's own optimizer step)."""
    update_fence: Callable[[], object] | None = None
    """Called, then cleared, before the next optimizer step, the only place the weights
    and optimizer state change: a copy of them that reads the live tensors while the
    next step's pi_prox, forward and backward run holds training there until it is done
    (tasks/train/publisher.py). Seconds waited: ``train/update_fence_wait_s``."""
    _fence_wait_s = 0.0

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
        reference_dir: str | Path | None = None,
        advantage_fn: AdvantageFn | None = None,
    ):
        self.settings = settings
        self.advantage_fn = advantage_fn
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
        if settings.kl_coef > 0 and self.lora is None:
            if reference_dir is None:
                raise ValueError(
                    "a KL penalty needs the reference policy: pass reference_dir (version 0)"
                )
            self.reference, _ = load_policy_dir(reference_dir, device=device, dtype=dtype)
            self.reference.set_attn_implementation(register_packed_attention())
            self.reference.eval().requires_grad_(False)
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
            self._generator.set_state(torch.load(rng_path, weights_only=True))

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
        self.optimizer.load_state_dict(load_optimizer_state(path, self.device))

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
        self,
        micro_batches: list[PackedBatch],
        token_counts: list[int],
        loss_of: MicroBatchLossFn,
        check: Callable[[], bool] | None = None,
    ) -> tuple[float, list[dict[str, torch.Tensor]]]:
        """One optimizer step over a minibatch's micro-batches: ``(pre-clip grad norm,
        every micro-batch's loss metrics)``.

        ``loss_of(i, logits)`` is micro-batch i's loss: its share of the minibatch's
        aggregated loss (``token_counts``: each micro-batch's trained tokens), so the
        accumulated gradient is the whole minibatch's. ``check()``, asked after the
        backward passes and before the step, may refuse the update (the watchdog,
        when π_prox came from this minibatch's forward).
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
        refused = check is not None and not check()
        if not refused and self._guard is not None:
            refused = not self._guard({"train/grad_norm": grad_norm})
        if refused:
            self.optimizer.zero_grad(set_to_none=True)
            self._refused = True
        elif math.isfinite(grad_norm):
            self._pass_update_fence()
            self.optimizer.step()
        return grad_norm, parts

    def _pass_update_fence(self) -> None:
        fence, self.update_fence = self.update_fence, None
        if fence is not None:
            waited = time.perf_counter()
            fence()
            self._fence_wait_s += time.perf_counter() - waited

    # ------------------------------------------------------------ the step

    def _proximal_is_free(self) -> bool:
        """Whether the first minibatch's own forward gives log π_prox exactly: the torch
        backend (Megatron takes its optimizer step inside its schedule, with no place
        to settle the correction between backward and step) and no dropout anywhere
        (else a training forward is not the function π_prox is)."""
        return self.free_proximal and not any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules()
        )

    def _scheduled_lr(self) -> float:
        s = self.settings
        lr = s.lr * lr_multiplier(
            self.steps_done,
            warmup_steps=s.lr_warmup_steps,
            total_steps=s.total_steps,
            decay=s.lr_decay,
            min_ratio=s.lr_min_ratio,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """log π_ref of every response token: version 0's weights (a LoRA trainer's base
        with its adapters off; else the frozen copy loaded at start)."""
        if self.lora is not None:
            peft_model: Any = self.model
            with peft_model.disable_adapter():
                return self.compute_logprobs(batch)
        assert self.reference is not None
        policy, self.model = self.model, self.reference
        try:
            return self.compute_logprobs(batch)
        finally:
            self.model = policy
            self.reference.eval()

    def _minibatches(self, n: int) -> list[list[int]]:
        """Every optimizer step's samples: `ppo_epochs` passes, each a fresh seeded split."""
        k = self.settings.ppo_minibatches
        steps = []
        for _ in range(self.settings.ppo_epochs):
            order = torch.randperm(n, generator=self._generator).tolist()
            steps += [order[j::k] for j in range(k)]
        return [mb for mb in steps if mb]

    def train_step(
        self, samples: Sequence[TrainingSample], guard: StepGuard | None = None
    ) -> dict[str, float]:
        """One policy update over `samples`; returns plain-float metrics. `guard` may
        refuse the update (see `StepGuard`)."""
        started = time.perf_counter()
        self._fence_wait_s = 0.0
        s = self.settings
        batch = self.make_batch(samples)
        n = len(batch.sequences)
        lr = self._scheduled_lr()
        reference = None
        reference_time = 0.0
        reference_tokens = 0
        reward_metrics: dict[str, float] = {}
        if s.kl_coef > 0:
            reference_started = time.perf_counter()
            reference = self._reference_logprobs(batch)
            reference_time = time.perf_counter() - reference_started
            reference_tokens = batch.response_offsets[-1]
            if s.kl_in_reward:  # the penalty is in the advantages, not the loss
                batch.advantages, reward_metrics = kl_reward_advantages(self, batch, reference)
                reference = None
        steps = self._minibatches(n)
        prox = ProximalState.empty(batch)
        prox_started = time.perf_counter()
        free = self._proximal_is_free()
        exact_first = steps[0]
        pass_tokens = 0
        if free:
            # The first minibatch's forward gives its tokens' π_prox; the rest need the
            # pass only when π_prox is to be exact there.
            first = set(exact_first)
            rest = [i for i in range(n) if i not in first]
            if s.proximal == "exact" and rest:
                tokens = batch.token_index(rest)
                pass_tokens = int(tokens.numel())
                self.compute_logprobs(batch, prox.entropies, indices=rest, out=prox.values)
                prox.known[tokens] = prox.has_entropy[tokens] = True
                exact_first = list(range(n))
            self._guard, self._refused = guard, False
        else:
            self.compute_logprobs(batch, prox.entropies, out=prox.values)
            prox.known[:] = prox.has_entropy[:] = True
            pass_tokens = batch.response_offsets[-1]
            settle(self, batch, prox, list(range(n)))
            self._guard, self._refused = guard, guard is not None and not guard(dict(prox.metrics))
        prox_time = time.perf_counter() - prox_started

        def settled() -> bool:
            """After the first minibatch's backward, before its step: what the guard
            sees when π_prox came from that forward."""
            settle(self, batch, prox, sorted(exact_first))
            return guard is None or guard(dict(prox.metrics))

        loss_parts: list[dict[str, torch.Tensor]] = []
        grad_norms = []
        micro_batch_count = 0
        packed_tokens = 0
        applied = 0
        for j, minibatch in enumerate(steps):
            if self._refused:
                break
            plan = self._micro_batches(batch, minibatch)
            packed = [self._pack(batch, mb) for mb in plan]
            micro_batch_count += len(plan)
            packed_tokens += sum(p.total_tokens for p in packed)
            loss_of = minibatch_loss(self, batch, plan, packed, prox, j / len(steps), reference)
            # Trained tokens only: a tool's observation tokens are not in the mean.
            token_counts = [int(self._gather(batch, batch.loss_mask, mb).sum()) for mb in plan]
            check = settled if free and j == 0 else None
            grad_norm, parts = self._optimizer_step(packed, token_counts, loss_of, check)
            grad_norms.append(grad_norm)
            loss_parts.extend(parts)
            applied += not self._refused
        self._guard = None
        self.steps_done += applied > 0
        metrics = {**prox.metrics, **reward_metrics}
        if loss_parts:  # none when the guard refused the update before any gradient
            metrics.update(merge_micro_batch_metrics(loss_parts))
        # Each minibatch's loss sums to its own mean: report the mean over optimizer steps.
        nominal_steps = s.ppo_epochs * s.ppo_minibatches
        for key in SUMMED_LOSSES:
            if key in metrics or key == "loss/policy_loss":
                metrics[key] = metrics.get(key, 0.0) / nominal_steps
        elapsed = time.perf_counter() - started
        trained_tokens = int(sum(len(seq) for seq in batch.sequences))
        metrics.update(
            {
                "policy/entropy": float(torch.cat(prox.entropies).mean()),
                "train/grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
                "train/grad_norm_max": float(np.max(grad_norms)) if grad_norms else 0.0,
                "train/samples": float(n),
                "train/response_tokens": float(batch.response_offsets[-1]),
                "train/trained_tokens": float(trained_tokens),
                "train/micro_batches": float(micro_batch_count),
                "train/packed_tokens": float(packed_tokens),
                "train/applied_minibatches": float(applied),
                "train/optimizer_steps": float(len(steps)),
                "train/lr": lr,
                "train/step_time_s": elapsed,
                "train/proximal_time_s": prox_time,
                "train/update_fence_wait_s": self._fence_wait_s,
                "train/proximal_pass_tokens": float(pass_tokens),
                "train/reference_time_s": reference_time,
                "train/reference_pass_tokens": float(reference_tokens),
                "train/trained_tokens_per_s": trained_tokens / elapsed if elapsed > 0 else 0.0,
            }
        )
        return metrics

    def close(self) -> None:
        """Release what the trainer holds beyond this process (nothing, for this backend)."""

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

    def small_state(self) -> tuple[Any, dict[str, Any]]:
        """The minibatch RNG's state and ``trainer_state.json``'s record as of now:
        what `save_later` on another thread must take from before the next step moves
        them (the tensors wait for it behind `update_fence`)."""
        return self._generator.get_state().clone(), self._saved_state()

    def save_later(
        self, *, weights_only: bool = False, small: tuple[Any, dict[str, Any]] | None = None
    ) -> Callable[..., Path] | None:
        """What ``save`` would write now, copied to host memory, and a function that
        writes it later (same arguments as ``save``, same files; its ``weights`` is the
        copied state dict): the trainer goes on training while the checkpoint of the
        step before is written (``trainer_files.deferred_save``). None when this trainer
        saves only now (a LoRA adapter is megabytes; a backend with its own save).
        `weights_only`: the policy directory alone, no trainer state; `small`: the RNG
        and record `small_state` took (default: now)."""
        if self.lora is not None or (
            type(self)._save_weights_and_optimizer is not PolicyTrainer._save_weights_and_optimizer
        ):
            return None
        rng, saved = self.small_state() if small is None else small
        return deferred_save(
            self.model,
            self.optimizer,
            rng,
            saved,
            self.tokenizer,
            self._tokenizer_files,
            weights_only=weights_only,
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
            save_optimizer_state(self.optimizer.state_dict(), out)
        return True
