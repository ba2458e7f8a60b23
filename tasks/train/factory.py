"""How a training process builds its trainer: one rank's, whether the trainer is split
over processes or not (the rank's place in the group comes from torch.distributed's
environment)."""

from __future__ import annotations

from pathlib import Path

import torch

from sluice.engines.policy.model import resolve_device
from sluice.engines.rl.advantages import make_advantage_fn
from sluice.engines.rl.lora import LoraSettings
from sluice.engines.rl.loss import make_policy_loss
from sluice.engines.rl.rollout_correction import make_rollout_correction
from sluice.engines.rl.train_batch import TrainerSettings
from sluice.engines.rl.trainer import PolicyTrainer
from sluice.infra.config.run import RunConfig


def trainer_settings(config: RunConfig) -> TrainerSettings:
    t = config.trainer
    return TrainerSettings(
        lr=t.lr,
        adam_betas=t.adam_betas,
        adam_eps=t.adam_eps,
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        temperature=config.rollout.temperature,
        ppo_minibatches=t.ppo_minibatches,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
        shared_prompt=t.shared_prompt,
        min_micro_batches=t.min_micro_batches,
        seed=config.seed,
        ppo_epochs=t.ppo_epochs,
        proximal=t.loss.proximal,
        loss_agg_mode=t.loss.loss_agg_mode,
        entropy_coef=t.loss.entropy_coef,
        kl_coef=t.kl.coef,
        kl_estimator=t.kl.estimator,
        kl_in_reward=t.kl.in_reward,
        lr_warmup_steps=t.lr_warmup_steps,
        lr_decay=t.lr_decay,
        lr_min_ratio=t.lr_min_ratio,
        total_steps=t.total_steps,
    )


def build_rank_trainer(
    config: RunConfig, model_dir: Path, reference_dir: Path | None = None
) -> PolicyTrainer:
    """This process's trainer (one rank's, when the trainer is split over processes).
    ``reference_dir``: version 0, the reference policy of a KL penalty (full
    fine-tuning; a LoRA trainer's reference is its own base)."""
    t = config.trainer
    correction = make_rollout_correction(**t.correction.model_dump()) if t.loss.decoupled else None
    device = resolve_device(config.device)
    args = (
        model_dir,
        trainer_settings(config),
        make_policy_loss(
            t.loss.objective,
            decoupled=t.loss.decoupled,
            eps_clip_low=t.loss.eps_clip_low,
            eps_clip_high=t.loss.eps_clip_high,
            dual_clip_c=t.loss.dual_clip_c,
        ),
        correction,
    )
    if t.backend == "megatron":
        from sluice.engines.megatron.trainer import MegatronPolicyTrainer

        return MegatronPolicyTrainer(
            *args,
            device=device,
            decoupled=t.loss.decoupled,
            tensor_parallel=t.tensor_parallel,
            pipeline_parallel=t.pipeline_parallel,
            data_parallel=t.data_parallel,
            distributed_optimizer=t.distributed_optimizer,
            dtype=getattr(torch, t.dtype),
        )
    lora = LoraSettings(**t.lora.model_dump()) if t.lora.rank else None
    return PolicyTrainer(
        *args,
        device=device,
        decoupled=t.loss.decoupled,
        lora=lora,
        reference_dir=reference_dir,
        advantage_fn=make_advantage_fn(**t.advantage.model_dump()),
    )
