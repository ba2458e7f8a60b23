"""What the trainer step takes in: scored samples, its settings, and the flat batch.

`make_batch` turns a step's `TrainingSample`s into one `TrainBatch`: each sequence is
prompt + response token ids, and the per-response-token tensors (behaviour log-probs,
advantages, loss mask) are concatenated in sample order, with `response_offsets`
locating each sample's slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class TrainingSample:
    """One scored response, as the trainer needs it."""

    prompt_token_ids: Sequence[int] | np.ndarray
    """Prompt tokens (context only, never in the loss)."""
    response_token_ids: Sequence[int] | np.ndarray
    """Sampled response tokens."""
    behaviour_logprobs: Sequence[float] | np.ndarray
    """log π_behav of each response token, recorded by the inference engine."""
    advantage: float
    """The sample's advantage, broadcast to every response token."""
    loss_mask: Sequence[int] | np.ndarray | None = None
    """Per response token, 1 = trained and 0 = context only (a tool's observation in a
    multi-turn episode: in the sequence the policy reads, never in the loss, the
    importance ratio or the token count). None: every response token is trained."""
    version_lag: Sequence[int] | np.ndarray | None = None
    """Per response token, how many policy versions the weights that sampled it were
    behind the weights this step starts from (v − v_behav, >= 0): what the log-linear
    π_prox approximation interpolates by. None: 0 for every token (on-policy)."""
    reward: float | None = None
    """The (shaped) reward `advantage` was computed from; what a KL penalty in the
    reward is taken from before the advantages are computed again."""
    group: int | None = None
    """The sample's prompt group (any int, the same for its group), for that recomputation."""


@dataclass(frozen=True)
class TrainerSettings:
    """Optimisation settings of the trainer step (bound from `trainer.*` config)."""

    lr: float = 1e-4
    """AdamW learning rate."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    adam_eps: float = 1e-5
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    temperature: float = 1.0
    """Sampling temperature: log-probs are log_softmax(logits / temperature)."""
    ppo_minibatches: int = 1
    """Optimizer steps per train_step."""
    max_tokens_per_micro_batch: int = 8192
    """Token budget of one packed micro-batch (prompt + response tokens)."""
    shared_prompt: bool = False
    """Pack each distinct prompt once with its responses on top (`sluice.engines.rl.prompt_sharing`)."""
    min_micro_batches: int = 1
    """Lower bound on micro-batches per minibatch."""
    seed: int = 0
    """Seeds the minibatch split."""
    ppo_epochs: int = 1
    """Passes over the batch per train_step, each split into `ppo_minibatches` afresh."""
    proximal: str = "exact"
    """How log π_prox is had beyond the first minibatch (`sluice.engines.rl.proximal`)."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses aggregate (`sluice.engines.rl.aggregation`)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus in the loss (0 = off)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy in the loss (0 = off)."""
    kl_estimator: str = "k3"
    """Estimator of KL(π_θ ‖ π_ref) per token (`sluice.engines.rl.regularizers`)."""
    kl_in_reward: bool = False
    """Take the KL penalty from each response's reward (then the advantages again)
    instead of adding it to the loss."""
    lr_warmup_steps: int = 0
    """Steps of linear learning-rate warm-up (`sluice.engines.rl.schedules`)."""
    lr_decay: str = "constant"
    """Learning-rate decay after warm-up: constant, linear or cosine."""
    lr_min_ratio: float = 0.0
    """Decay ends at lr × this."""
    total_steps: int = 1
    """Steps the schedule decays over (the run's policy versions)."""


@dataclass
class TrainBatch:
    """Samples of a step, flattened once."""

    sequences: list[torch.Tensor]
    prompt_lens: list[int]
    response_lens: list[int]
    behaviour_logprobs: torch.Tensor  # flat over response tokens, in sample order
    advantages: torch.Tensor  # flat over response tokens
    loss_mask: torch.Tensor  # flat over response tokens: which are trained
    version_lag: torch.Tensor | None = None  # flat over response tokens: v − v_behav
    rewards: list[float | None] = field(default_factory=list)  # per sample
    groups: list[int | None] = field(default_factory=list)  # per sample
    response_offsets: list[int] = field(default_factory=list)  # start of each sample's tokens

    def __post_init__(self) -> None:
        self.response_offsets = [0, *np.cumsum(self.response_lens).tolist()]

    def tokens_of(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.response_offsets[index] : self.response_offsets[index + 1]]

    def token_index(self, indices: Sequence[int]) -> torch.Tensor:
        """Positions in the flat per-token tensors of the samples in `indices`, in order."""
        offsets = self.response_offsets
        return torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in indices])


def make_batch(samples: Sequence[TrainingSample]) -> TrainBatch:
    """The samples of a step flattened once: sequences, lengths and per-token tensors.

    Samples without response tokens are left out; a mismatched length is a ValueError.
    """
    kept = [s for s in samples if len(s.response_token_ids) > 0]
    if not kept:
        raise ValueError("train_step got no sample with response tokens")
    sequences, prompt_lens, response_lens, behaviour, advantages = [], [], [], [], []
    masks, lags = [], []
    for s in kept:
        prompt = torch.as_tensor(np.asarray(s.prompt_token_ids), dtype=torch.int64)
        response = torch.as_tensor(np.asarray(s.response_token_ids), dtype=torch.int64)
        logprobs = torch.as_tensor(np.asarray(s.behaviour_logprobs), dtype=torch.float32)
        if logprobs.numel() != response.numel():
            raise ValueError(
                f"a sample has {response.numel()} response tokens but {logprobs.numel()} behaviour log-probs"
            )
        if prompt.numel() == 0:
            raise ValueError("a sample has an empty prompt; the first response token needs context")
        sequences.append(torch.cat([prompt, response]))
        prompt_lens.append(prompt.numel())
        response_lens.append(response.numel())
        behaviour.append(logprobs)
        advantages.append(torch.full((response.numel(),), float(s.advantage)))
        if s.loss_mask is None:
            masks.append(torch.ones(response.numel(), dtype=torch.bool))
        else:
            mask = torch.as_tensor(np.asarray(s.loss_mask), dtype=torch.bool)
            if mask.numel() != response.numel():
                raise ValueError(
                    f"a sample has {response.numel()} response tokens but a loss mask "
                    f"of {mask.numel()}"
                )
            masks.append(mask)
        lag = np.zeros(response.numel()) if s.version_lag is None else np.asarray(s.version_lag)
        if lag.size != response.numel():
            raise ValueError(
                f"a sample has {response.numel()} response tokens but a version lag of {lag.size}"
            )
        lags.append(torch.as_tensor(lag, dtype=torch.int64))
    return TrainBatch(
        sequences,
        prompt_lens,
        response_lens,
        torch.cat(behaviour),
        torch.cat(advantages),
        torch.cat(masks),
        torch.cat(lags),
        [s.reward for s in kept],
        [s.group for s in kept],
    )
