"""The loss of one micro-batch in the trainer step, and where its log π_prox comes from.

:func:`minibatch_loss` assembles, per micro-batch, what the configured functions
take: log π_θ (with grad), log π_prox (known, or had from this very forward pass:
`sluice.engines.rl.proximal`), the rollout-corrected behaviour weights, the
aggregation scale (`sluice.engines.rl.aggregation`), and optionally the KL penalty to
the reference policy and the entropy bonus (`sluice.engines.rl.regularizers`). The
trainer never branches on an algorithm name: the policy loss and the correction are
functions bound from config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from sluice.engines.rl.advantages import AdvantageFn
from sluice.engines.rl.aggregation import aggregation_scale
from sluice.engines.rl.batching import PackedBatch
from sluice.engines.rl.loss_inputs import LossInputs, PolicyLoss
from sluice.engines.rl.metrics import mismatch_metrics
from sluice.engines.rl.proximal import loglinear_proximal
from sluice.engines.rl.regularizers import (
    entropy_bonus_loss,
    kl_penalty_loss,
    kl_reward_penalty,
)
from sluice.engines.rl.rollout_correction import RolloutCorrectionFn
from sluice.engines.rl.train_batch import TrainBatch, TrainerSettings

MicroBatchLossFn = Callable[[int, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``(micro-batch index, its logits) -> (its loss, its metrics)``; the loss is the
micro-batch's share of the minibatch's aggregated loss."""


class StepTrainer(Protocol):
    """What the step's loss reads of its trainer (``PolicyTrainer`` and the backends built
    on it): its settings and device, the functions bound from config, and one log-prob
    pass over a packed micro-batch. Named here so this module needs no trainer class."""

    @property
    def settings(self) -> TrainerSettings: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def decoupled(self) -> bool: ...
    @property
    def loss_fn(self) -> PolicyLoss: ...
    @property
    def correction_fn(self) -> RolloutCorrectionFn | None: ...
    @property
    def advantage_fn(self) -> AdvantageFn | None: ...

    def packed_logprobs(
        self,
        batch: TrainBatch,
        indices: Sequence[int],
        packed: PackedBatch,
        entropy_out: list[torch.Tensor] | None = None,
        logits: torch.Tensor | None = None,
        entropy_grad: bool = False,
    ) -> torch.Tensor:
        """log π of the response tokens of the samples in `indices` (see
        ``sluice.engines.rl.logprob_pass.LogprobPasses.packed_logprobs``)."""
        ...


@dataclass
class ProximalState:
    """log π_prox of a step's tokens as it becomes known, and what is derived from it."""

    values: torch.Tensor
    """log π_prox per response token (flat); meaningful where `known`."""
    known: torch.Tensor
    """Bool per token: `values` holds the exact log π_prox."""
    corrected: torch.Tensor
    """The loss mask after rollout correction, where `known` tokens were settled."""
    has_entropy: torch.Tensor
    """Bool per token: its entropy under π_prox (or the step's first forward) is recorded."""
    weights: torch.Tensor | None = None
    """Corrected behaviour weights of settled tokens (None: no correction)."""
    entropies: list[torch.Tensor] = field(default_factory=list)
    """Per-token entropies, in the order they were recorded."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Mismatch metrics of the settled tokens (`sluice.engines.rl.metrics`)."""

    @classmethod
    def empty(cls, batch: TrainBatch) -> ProximalState:
        total = batch.response_offsets[-1]
        return cls(
            values=torch.zeros(total, dtype=torch.float32),
            known=torch.zeros(total, dtype=torch.bool),
            corrected=batch.loss_mask.clone(),
            has_entropy=torch.zeros(total, dtype=torch.bool),
        )


def cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """``[0, l0, l0+l1, ...]`` of responses of these token counts."""
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.to(torch.int64).cumsum(0)])


def correct(
    trainer: StepTrainer,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Rollout correction of these tokens: (behaviour weights or None, corrected mask)."""
    if not (trainer.decoupled and trainer.correction_fn is not None):
        return None, mask
    correction = trainer.correction_fn(proximal, behaviour, mask, cu_seqlens=cu_seqlens)
    return correction.behaviour_weights, correction.loss_mask


def settle(
    trainer: StepTrainer, batch: TrainBatch, prox: ProximalState, indices: list[int]
) -> None:
    """Rollout correction and mismatch metrics over the samples in `indices`, whose
    log π_prox is known: the correction every later minibatch reuses for them, and
    what the watchdog judges."""
    tokens = batch.token_index(indices)
    lengths = [batch.response_lens[i] for i in indices]
    cu = cu_seqlens(torch.tensor(lengths, dtype=torch.int64))
    proximal, behaviour = prox.values[tokens], batch.behaviour_logprobs[tokens]
    mask = batch.loss_mask[tokens]
    weights, corrected = correct(trainer, proximal, behaviour, mask, cu)
    if weights is not None:
        if prox.weights is None:
            prox.weights = torch.zeros_like(prox.values)
        prox.weights[tokens] = weights
        prox.corrected[tokens] = corrected
    prox.metrics = mismatch_metrics(
        proximal,
        behaviour,
        mask,
        cu_seqlens=cu,
        behaviour_weights=weights,
        corrected_loss_mask=corrected,
    )


def minibatch_loss(
    trainer: StepTrainer,
    batch: TrainBatch,
    plan: list[list[int]],
    packed: list[PackedBatch],
    prox: ProximalState,
    step_fraction: float,
    reference: torch.Tensor | None,
) -> MicroBatchLossFn:
    """The loss (and metrics) of micro-batch i of a minibatch given its logits.

    A token whose log π_prox is not known yet gets it here: its own detached
    log-prob at the first optimizer step of the version (exact), the log-linear
    approximation after it; its rollout correction is then computed over its
    micro-batch (sequences never span micro-batches, and every correction mode
    is per token or per sequence).
    """
    s = trainer.settings
    minibatch = [i for mb in plan for i in mb]
    token_mask = batch.loss_mask[batch.token_index(minibatch)]
    num_tokens = int(token_mask.sum())
    num_sequences = sum(int(batch.tokens_of(i, batch.loss_mask).any()) for i in minibatch)

    lag = batch.version_lag
    if lag is None:
        lag = torch.zeros(batch.response_offsets[-1], dtype=torch.int64)

    def loss_of(index: int, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mb = plan[index]
        tokens = batch.token_index(mb)
        fresh = ~prox.has_entropy[tokens]
        want_entropy = s.entropy_coef > 0 or bool(fresh.any())
        entropy: list[torch.Tensor] | None = [] if want_entropy else None
        logprobs = trainer.packed_logprobs(
            batch, mb, packed[index], entropy, logits, entropy_grad=s.entropy_coef > 0
        )
        if entropy is not None and bool(fresh.any()):
            prox.entropies.append(entropy[0].detach().cpu()[fresh])
            prox.has_entropy[tokens] = True
        lengths = torch.tensor([batch.response_lens[i] for i in mb])
        behaviour = batch.behaviour_logprobs[tokens]
        mask = batch.loss_mask[tokens]
        known = prox.known[tokens]
        if bool(known.all()):
            proximal = prox.values[tokens]
            weights = None if prox.weights is None else prox.weights[tokens]
            corrected = prox.corrected[tokens]
        else:
            current = logprobs.detach().cpu()
            if step_fraction == 0:  # π_θ is π_prox: exact
                prox.values[tokens], prox.known[tokens] = current, True
                proximal = current
            else:
                approx = loglinear_proximal(behaviour, current, lag[tokens], step_fraction)
                proximal = torch.where(known, prox.values[tokens], approx)
            cu = cu_seqlens(lengths)
            weights, corrected = correct(trainer, proximal, behaviour, mask, cu)
        sequence_ids = torch.repeat_interleave(torch.arange(len(mb)), lengths)
        scale = aggregation_scale(mask, sequence_ids, s.loss_agg_mode, num_sequences)
        device = trainer.device
        moved = None if scale is None else scale.to(device)
        inputs = LossInputs(
            logprobs=logprobs,
            proximal_logprobs=proximal.to(device),
            behaviour_logprobs=behaviour.to(device),
            advantages=batch.advantages[tokens].to(device),
            loss_mask=corrected.to(device),
            num_global_tokens=num_tokens,
            behaviour_weights=None if weights is None else weights.to(device),
            token_scale=moved,
            sequence_ids=sequence_ids.to(device),
        )
        loss, parts = trainer.loss_fn(inputs)
        parts = dict(parts)
        if reference is not None:
            kl_loss, kl_parts = kl_penalty_loss(
                logprobs,
                reference[tokens].to(device),
                mask.to(device),
                num_tokens,
                kind=s.kl_estimator,
                coef=s.kl_coef,
                token_scale=moved,
            )
            loss = loss + kl_loss
            parts.update(kl_parts)
        if s.entropy_coef > 0:
            assert entropy is not None
            bonus, bonus_parts = entropy_bonus_loss(
                entropy[0], mask.to(device), num_tokens, coef=s.entropy_coef, token_scale=moved
            )
            loss = loss + bonus
            parts.update(bonus_parts)
        return loss, parts

    return loss_of


def kl_reward_advantages(
    trainer: StepTrainer, batch: TrainBatch, reference: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token advantages after a KL penalty in the reward (verl's ``use_kl_in_reward``):
    r_i − β Σ_t k_t for each response, the estimate taken between the policy that
    sampled (its recorded log-probs: no forward pass) and the reference, then the
    configured advantage estimator again over the batch's groups."""
    s = trainer.settings
    if trainer.advantage_fn is None:
        raise ValueError("a KL penalty in the reward needs the trainer's advantage_fn")
    if any(r is None for r in batch.rewards) or any(g is None for g in batch.groups):
        raise ValueError(
            "a KL penalty in the reward needs every sample's reward and group "
            "(samples_from_table records them)"
        )
    n = len(batch.sequences)
    lengths = torch.tensor(batch.response_lens)
    penalty = kl_reward_penalty(
        batch.behaviour_logprobs,
        reference,
        batch.loss_mask,
        torch.repeat_interleave(torch.arange(n), lengths),
        n,
        kind=s.kl_estimator,
        coef=s.kl_coef,
    )
    rewards = torch.tensor(batch.rewards, dtype=torch.float64) - penalty
    codes = {g: i for i, g in enumerate(dict.fromkeys(batch.groups))}
    result = trainer.advantage_fn(rewards, group_ids=torch.tensor([codes[g] for g in batch.groups]))
    advantages = torch.repeat_interleave(result.advantages.to(torch.float32), lengths)
    return advantages, {"reward/kl_penalty_mean": float(penalty.mean())}
