"""The `model` section: the policy model (`model`, `model.tiny`, `model.supervised`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sluice.infra.config.section import Section


class SupervisedConfig(Section):
    """A supervised pass on the training prompts' reference answers before RL (SFT, then RL).

    Group-relative RL sharpens what the policy already samples: a prompt no sample of
    a group solves gives no gradient toward solving it. A short pass of teacher-forced
    cross-entropy on each training prompt, rendered exactly as the rollout renders it,
    with the row's reference answer and the end token as the response (the loss on
    those tokens only), moves the policy toward answers it never samples; its result is
    committed as policy version 0, so RL, the KL reference and LoRA's base start there.
    """

    minutes: float = Field(0.0, ge=0)
    """Wall-clock minutes of the pass, spent inside `trainer.time_budget_s` (which counts from the
    flow's start); 0 = no pass. For a user's model (`model.path`); the embedded tiny model has
    `model.warm_start`."""
    max_steps: int | None = Field(None, ge=1)
    """Stop the pass after this many optimizer steps if `minutes` has not run out first (TRL SFTTrainer's `max_steps`); None = the clock alone."""
    lr: float = Field(5e-5, gt=0)
    """AdamW learning rate of the pass, constant, no weight decay, gradient norm clipped at 1 (verl's SFT `optim.lr`, TRL's `learning_rate`)."""
    batch_size: int = Field(16, ge=1)
    """Rows per optimizer step (verl's SFT `data.train_batch_size`); each step is cut into micro-batches of at most `trainer.max_tokens_per_micro_batch` tokens, which does not change its gradient."""


class TinyModelConfig(Section):
    """Shape of the embedded tiny policy, built from a config when no model path is given."""

    arch: Literal["llama", "qwen2"] = "llama"
    """Hugging Face architecture of the tiny model."""
    hidden_size: int = Field(128, ge=8, le=4096)
    """Width of the residual stream."""
    num_layers: int = Field(4, ge=1, le=64)
    """Number of transformer blocks."""
    num_heads: int = Field(4, ge=1, le=64)
    """Attention heads; must divide hidden_size."""
    intermediate_size: int = Field(384, ge=8)
    """MLP width."""
    max_position_embeddings: int = Field(512, ge=32)
    """Longest prompt+response the model can see, in tokens."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})"
            )
        return self


class ModelConfig(Section):
    """The policy: a local Hugging Face directory, or the embedded tiny model."""

    path: str | None = None
    """Local Hugging Face causal-LM directory (config + safetensors + tokenizer). None builds the embedded tiny model."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the embedded tiny model (ignored when `path` is set)."""
    chat_template: Literal["auto", "always", "never"] = "auto"
    """How a prompt becomes tokens. `auto`: through the tokenizer's chat template when it has one (a
    chat model: the prompt is one user message, followed by the opening of the assistant's turn),
    else the plain text. `always`: the template, and a model without one fails at start. `never`:
    the plain text (a base model, or to measure what the template is worth)."""
    system_prompt: str | None = None
    """System message before the prompt when the chat template is used. None keeps the template's
    own default (SmolLM2's adds "You are a helpful AI assistant named SmolLM..."); "" sends an empty
    one."""
    shipped_policy: bool = True
    """Start from the warm-started policy that ships with Sluice when the tiny shape and task match
    it (the default's do), so no warm start runs on your clock. False, or any other shape or task,
    falls back to `warm_start`."""
    warm_start: bool = True
    """Run a short supervised pass on the built-in task when no warm checkpoint is cached (embedded model only, when the shipped policy does not apply)."""
    warm_start_max_steps: int = Field(2500, ge=1)
    """Optimizer steps of the warm start at most. Seeded, the warm start stops on accuracy at the
    same step on any machine; this caps a run that never gets there (the default reaches 30% at step
    2300, ~9 min on a quiet 2-core CPU)."""
    warm_start_eval_every: int = Field(100, ge=1)
    """Warm-start steps between greedy held-out checks of the stopping accuracy (each check costs ~3 s on 2 cores)."""
    warm_start_max_minutes: float = Field(15.0, gt=0)
    """Wall-clock safety cap of the warm start, in minutes (a busy machine can be 10x slower)."""
    warm_start_target_accuracy: float = Field(0.3, gt=0, lt=1)
    """Stop the warm start once greedy held-out accuracy reaches this (leave RL room to climb)."""
    supervised: SupervisedConfig = SupervisedConfig()
    """A supervised pass on the training prompts' reference answers before RL (off unless `supervised.minutes` > 0)."""

    @model_validator(mode="after")
    def _supervised_needs_a_model(self) -> ModelConfig:
        if self.supervised.minutes and self.path is None:
            raise ValueError(
                "model.supervised trains a model you give in model.path (--set "
                "model.path=DIR, a directory `sluice model import` wrote); the embedded tiny "
                "model has model.warm_start"
            )
        return self
