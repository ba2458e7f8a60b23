"""The trainer's section of the run configuration (`trainer:`): optimisation, the policy
loss, rollout correction and the advantage estimator, and the Megatron backend's
parallelism. Part of `sluice.infra.config.RunConfig`; validated with it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sluice.infra.problem_config import Section as _Section


class LossConfig(_Section):
    """Decoupled PPO objective (AReaL eq. 3)."""

    decoupled: bool = True
    """Use pi_prox as the trust-region anchor (True) or standard PPO with pi_old = pi_behav (False)."""
    eps_clip_low: float = Field(0.2, ge=0, le=1)
    """Lower clip of the ratio: 1 - eps_clip_low."""
    eps_clip_high: float = Field(0.2, ge=0, le=10)
    """Upper clip of the ratio: 1 + eps_clip_high (DAPO clip-higher when > eps_clip_low)."""
    dual_clip_c: float | None = Field(None, gt=1)
    """Dual-clip bound for negative advantages (None = off)."""


class CorrectionConfig(_Section):
    """Rollout correction of the behaviour weight pi_prox / pi_behav."""

    mode: Literal[
        "none", "token_tis", "sequence_tis", "token_mis", "sequence_mis", "geometric_rs"
    ] = "token_tis"
    """Truncate (TIS) or mask (MIS, RS) importance weights that train-inference mismatch blows up."""
    threshold: float = Field(2.0, gt=0)
    """C: cap (TIS) or rejection bound (MIS) of the weight."""
    geometric_lower: float = Field(0.999, gt=0)
    """Lower bound of exp(mean log-ratio) for geometric rejection."""
    geometric_upper: float = Field(1.001, gt=0)
    """Upper bound of exp(mean log-ratio) for geometric rejection."""


class AdvantageConfig(_Section):
    """Group-relative advantages, broadcast to every response token."""

    mode: Literal["grpo", "drgrpo", "rloo", "batch"] = "grpo"
    """grpo: (r - mean) / std per group; drgrpo: no std; rloo: leave-one-out mean; batch: batch-level std."""
    eps: float = Field(1e-6, gt=0)
    """Added to the std to keep all-equal groups finite."""
    drop_zero_variance_groups: bool = False
    """Drop groups whose responses all got the same reward (they carry zero advantage)."""


class LoraConfig(_Section):
    """Low-rank adapters (LoRA, through peft) instead of full fine-tuning; off at rank 0."""

    rank: int = Field(0, ge=0, le=4096)
    """r: the adapters' rank; 0 = full fine-tuning. Only the adapters train (every base weight is frozen and out of the optimizer); each version is published as the merged weights, so serving is unchanged. Torch backend only."""
    alpha: int = Field(16, ge=1)
    """Scale of the adapters' update: W + (alpha / r) * B A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training."""
    target_modules: list[str] = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    """Names of the linear layers that get an adapter (the last part of their module name); a name the model lacks is refused naming the ones it has."""


class TrainerConfig(_Section):
    """Optimisation."""

    backend: Literal["torch", "megatron"] = "torch"
    """Who trains the policy: `torch` (the Hugging Face model and torch AdamW) or `megatron` (a Megatron-core GPTModel converted from the same HF weights, Megatron's DDP, Adam and forward-backward schedule; Llama and Qwen2 shapes). Same loss, micro-batching, streams and registry; every version is published as an HF directory either way. Megatron can split the trainer over `tensor_parallel × pipeline_parallel × data_parallel` processes."""
    tensor_parallel: int = Field(1, ge=1)
    """Tensor-parallel size of the Megatron backend: each rank holds a slice of every layer (so it must divide the key/value heads and the MLP width). Splits each layer's compute and memory; needs the fastest links (one node). Needs `backend: megatron`."""
    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline-parallel size of the Megatron backend: each stage holds consecutive layers (so it must divide the layer count). Splits memory with little communication, at the price of the pipeline bubble: each replica gets at least this many micro-batches per minibatch. Needs `backend: megatron`."""
    data_parallel: int = Field(1, ge=1)
    """Data-parallel replicas of the Megatron backend: each takes every k-th micro-batch of a minibatch and gradients are summed, so the update is the same. Splits compute, not memory; each replica gets at least one micro-batch. Needs `backend: megatron`."""
    distributed_optimizer: bool = False
    """Megatron backend: shard the fp32 main weights and Adam state across the `data_parallel` replicas (Megatron's distributed optimizer, ZeRO-1): optimizer memory per replica falls about `data_parallel`-fold, at a reduce-scatter and an all-gather per step instead of one all-reduce. No effect on the update."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training precision. `bfloat16` (Megatron backend): the model, activations and gradients in bf16, with fp32 main weights and Adam state in Megatron's mixed-precision optimizer. Versions are still published as float32 HF directories (the bf16 weights and float32 norms, exactly); the inference engine casts them to `rollout.dtype`. The torch backend trains in float32."""
    prompts_per_batch: int = Field(8, ge=1)
    """B: prompt groups per training step."""
    ppo_minibatches: int = Field(1, ge=1)
    """Optimizer steps per training batch (PPO minibatches)."""
    total_steps: int = Field(40, ge=1)
    """Training steps (policy versions) in the run."""
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    adam_eps: float = Field(1e-5, gt=0)
    """AdamW epsilon."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    max_tokens_per_micro_batch: int = Field(8192, ge=16)
    """Token budget of one packed micro-batch (dynamic micro-batching)."""
    min_micro_batches: int = Field(1, ge=1)
    """Lower bound on micro-batches per minibatch."""
    publish_every: int = Field(1, ge=1)
    """Commit a new policy version every K training steps."""
    time_budget_s: float | None = Field(None, gt=0)
    """Stop the run this many wall-clock seconds after the flow started (start-up included), whatever step it reached; None = run `total_steps`."""
    loss: LossConfig = LossConfig()
    """Policy loss."""
    correction: CorrectionConfig = CorrectionConfig()
    """Rollout correction of the behaviour importance weight."""
    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage estimator."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters instead of full fine-tuning (`rank` > 0)."""

    @property
    def world_size(self) -> int:
        """Trainer processes: the train role is rank 0 and starts the others on its machine."""
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    @model_validator(mode="after")
    def _megatron_only_settings(self) -> TrainerConfig:
        sizes = {
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "data_parallel": self.data_parallel,
        }
        asked = [f"{name}={size}" for name, size in sizes.items() if size > 1]
        asked += ["distributed_optimizer=true"] if self.distributed_optimizer else []
        asked += [f"dtype={self.dtype}"] if self.dtype != "float32" else []
        if self.lora.rank and self.backend != "torch":
            raise ValueError(
                "trainer.lora trains adapters with the torch backend only; set "
                "trainer.backend=torch or trainer.lora.rank=0"
            )
        if asked and self.backend != "megatron":
            raise ValueError(
                f"{' and '.join(asked)} {'need' if len(asked) > 1 else 'needs'} backend=megatron "
                f"(the {self.backend} backend trains in float32, in one process)"
            )
        return self
