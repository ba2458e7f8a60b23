"""What a policy loss reads, named: one frozen :class:`LossInputs` per micro-batch, and the
:class:`PolicyLoss` contract every objective meets (``inputs`` in, ``(loss, metrics)`` out).

Five of the inputs are per-token tensors of one layout, and two of them
(``proximal_logprobs`` and ``behaviour_logprobs``) have the same shape and dtype: passed by
position, a swap would train on the wrong ratio without a word. Here each is named where
it is made (keywords only), and the shapes are checked once, when the inputs are built,
so every objective gets the same checks and none can skip them. The loss's own config
(clip bounds, dual clip, ``decoupled``) is not an input: the objectives take it as
keywords, bound once from ``trainer.loss`` by
:func:`sluice.engines.rl.loss.make_policy_loss`.

Tensor convention (see :mod:`sluice.engines.rl.loss`): every per-token tensor is flat,
over the tokens of one padding-free packed micro-batch, all of one shape; a ``[B, T]``
layout works as well, since only GSPO and the aggregation read sequence boundaries, and
they take them from ``sequence_ids`` and ``token_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

Tensor = torch.Tensor


def check_same_shape(reference_name: str, reference: Tensor, **others: Tensor | None) -> None:
    """Raise one ValueError naming the first input whose shape differs from ``reference``."""
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {reference_name} has "
                f"{tuple(reference.shape)}; every per-token input must share one layout"
            )


def check_num_global_tokens(num_global_tokens: int | float | Tensor) -> None:
    """Raise one ValueError unless the loss denominator is a positive number (or a scalar)."""
    if isinstance(num_global_tokens, Tensor):
        if num_global_tokens.numel() != 1:
            raise ValueError("num_global_tokens must be a scalar")
    elif num_global_tokens <= 0:
        raise ValueError(
            f"num_global_tokens must be positive, got {num_global_tokens}; "
            "a global batch without response tokens has no loss"
        )


@dataclass(frozen=True, kw_only=True)
class LossInputs:
    """The tensors of one micro-batch's policy loss, by name; shapes checked on construction.

    Raises ValueError (one line naming the input) when a per-token tensor's shape differs
    from ``logprobs``' or ``num_global_tokens`` is not a positive number or a scalar.
    """

    logprobs: Tensor
    """log π_θ of each token (nats) under the weights being optimised, from the trainer's
    forward pass; carries the gradient. Shape: the micro-batch's token layout (flat
    ``[T]`` packed), the reference every other per-token input is checked against."""
    proximal_logprobs: Tensor | None
    """log π_prox of each token (nats): the trainer's weights just before this update,
    recomputed by the trainer (or taken from the step's first forward; see
    :mod:`sluice.engines.rl.proximal`); treated as a constant. Same shape as
    ``logprobs``. None only for a loss configured with ``decoupled=False``."""
    behaviour_logprobs: Tensor
    """log π_behav of each token (nats), recorded by the inference engine when it sampled
    the token; treated as a constant. Same shape as ``logprobs``."""
    advantages: Tensor
    """Advantage of each token (reward units, after the advantage estimator), the
    sample's advantage broadcast over its response tokens; treated as a constant. Same
    shape as ``logprobs``."""
    loss_mask: Tensor
    """1/True for a token that enters the loss, 0/False for prompt, padding, tool
    observation and tokens rejected by rollout correction (bool or float). Same shape
    as ``logprobs``."""
    num_global_tokens: int | float | Tensor
    """The loss's denominator: valid tokens (a count) in the whole minibatch, over all
    its micro-batches, counted before rollout correction, so the micro-batch losses sum
    to the minibatch's token mean. Positive (or a one-element tensor)."""
    behaviour_weights: Tensor | None = None
    """Behaviour weight of each token (dimensionless, ≥ 0) from rollout correction
    (:mod:`sluice.engines.rl.rollout_correction`), used instead of
    exp(proximal − behaviour); treated as a constant. Same shape as ``logprobs``. None:
    no correction. Only with ``decoupled=True``."""
    token_scale: Tensor | None = None
    """Per-token aggregation factor (dimensionless) from
    :func:`sluice.engines.rl.aggregation.aggregation_scale`: the loss becomes
    ``Σ_t mask_t w_t l_t token_scale_t``. Same shape as ``logprobs``. None: the token
    mean over ``num_global_tokens``."""
    sequence_ids: Tensor | None = None
    """Integer index (from 0) of each token's sequence within the micro-batch, whole
    sequences only. Same shape as ``logprobs``. Required by GSPO (its ratio is a mean
    over a sequence), ignored by the others."""

    def __post_init__(self) -> None:
        check_same_shape(
            "logprobs",
            self.logprobs,
            proximal_logprobs=self.proximal_logprobs,
            behaviour_logprobs=self.behaviour_logprobs,
            advantages=self.advantages,
            loss_mask=self.loss_mask,
            behaviour_weights=self.behaviour_weights,
            token_scale=self.token_scale,
            sequence_ids=self.sequence_ids,
        )
        check_num_global_tokens(self.num_global_tokens)


class PolicyLoss(Protocol):
    """A policy loss as the trainer calls it, once per micro-batch: named inputs in,
    ``(loss, metrics)`` out.

    The loss is the micro-batch's share of its minibatch's loss (a scalar to call
    ``backward()`` on); the metrics are detached scalar tensors named ``loss/*``
    (reading them would sync the device;
    :func:`sluice.engines.rl.loss.merge_micro_batch_metrics` turns them into floats once
    per minibatch). A registered objective also takes its config as keywords;
    :func:`sluice.engines.rl.loss.make_policy_loss` binds them, leaving this.
    """

    def __call__(self, inputs: LossInputs, /) -> tuple[Tensor, dict[str, Tensor]]: ...
