"""π_prox without its own forward pass: exact where the step already has it, log-linear
where it does not.

Decoupled PPO anchors its trust region at π_prox, the trainer's weights just before
the update (docs/design.md §1). Recomputing log π_prox costs a no-grad forward pass
over the whole batch. Two facts make most of it free:

- **Exact.** Before the first optimizer step of a version the weights *are* π_prox, so
  the log-probs of the first minibatch's own forward pass (which the gradient needs
  anyway) are log π_prox exactly, once detached. Without dropout that forward computes
  the same function as a no-grad one. Only the other minibatches still need the pass,
  and with one minibatch (the default) there is none.
- **Log-linear** (AReaL's ``prox_logp_method: loglinear``): for a token sampled at
  version v_behav, trained at optimizer step j of version v (k optimizer steps per
  version, so the weights are at v_θ = v + j/k), interpolate in log space between the
  behaviour and the current log-probs by version::

      log π_prox ≈ log π_behav + α (log π_θ − log π_behav),
      α = (v − v_behav) / (v_θ − v_behav) = lag / (lag + j/k)

  with lag = v − v_behav ≥ 0. At j = 0, α = 1 and the formula is the exact case
  (v_θ = v). On fresh data (lag = 0) at j > 0, α = 0: π_prox is taken to be π_behav,
  which drops the train–inference mismatch correction for those tokens (their
  behaviour weight is 1).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

PROXIMAL_METHODS = ("exact", "loglinear")
"""``trainer.loss.proximal``: `exact` computes log π_prox for the minibatches after the
first in one no-grad pass; `loglinear` approximates it there instead."""


def loglinear_proximal(
    behaviour_logprobs: Tensor, logprobs: Tensor, lag: Tensor, step_fraction: float
) -> Tensor:
    """log π_prox ≈ log π_behav + α (log π_θ − log π_behav), α = lag / (lag + step_fraction).

    Args:
        behaviour_logprobs: log π_behav per token (flat).
        logprobs: log π_θ per token under the weights being trained (detached here).
        lag: versions between each token's behaviour policy and π_prox (v − v_behav, >= 0).
        step_fraction: j / k, the share of this version's optimizer steps already taken
            (0 for the first minibatch, where π_θ is π_prox and the result is exact).

    Returns:
        The approximate log π_prox per token (no grad).
    """
    if step_fraction < 0:
        raise ValueError(f"step_fraction must be >= 0, got {step_fraction}")
    behaviour = behaviour_logprobs.detach().to(torch.float32)
    current = logprobs.detach().to(torch.float32)
    lag = lag.to(torch.float32)
    if bool((lag < 0).any()):
        raise ValueError("lag must be >= 0: a token cannot come from a version after π_prox")
    if step_fraction == 0:
        return current.clone()
    alpha = lag / (lag + step_fraction)
    return behaviour + alpha * (current - behaviour)
