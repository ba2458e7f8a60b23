"""Drawing one token per row from a batch of logits, and its behaviour logprob.

Conventions the trainer relies on:

- ``behaviour_logprobs`` are ``log_softmax(logits / temperature)`` of the
  sampled token over the *full* vocabulary. top-p / top-k only restrict which
  token may be drawn; the logprob is still taken under the unrestricted
  tempered distribution, which is what the trainer recomputes (and what SGLang
  returns by default).
- temperature below ``GREEDY_BELOW`` (0 included) is greedy decoding; its logprobs are
  ``log_softmax(logits)``. Dividing by a temperature that small overflows float32
  (below ~1e-38 the logits become inf and the logprobs NaN), and at 1e-5 the tempered
  distribution is already one-hot for any logit gap float32 can resolve.
- Each row draws its uniform from ``rng.counter_uniforms`` keyed by
  ``(seed, output token index)``, so a request's tokens do not depend on which
  other requests share its batch, nor on retraction or re-prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sluice.engines.inference.rng import counter_uniforms
from sluice.engines.inference.types import GREEDY_BELOW, SamplingParams


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    counters: Sequence[int],
) -> tuple[list[int], list[float]]:
    """Draw one token per row of ``logits`` (``[rows, vocab]``, float32).

    Row r samples under ``params[r]`` with the uniform keyed by ``(seeds[r],
    counters[r])``; returns the tokens and their behaviour logprobs.
    """
    device = logits.device
    temps = [p.temperature for p in params]
    greedy_rows = [t < GREEDY_BELOW for t in temps]
    if all(t == temps[0] for t in temps):
        # One temperature for the whole batch (the usual case): a scalar divide, and
        # none at 1.0 (x / 1.0 == x exactly), instead of a per-row tensor.
        scaled = logits if greedy_rows[0] or temps[0] == 1.0 else logits / temps[0]
    else:
        temperature = torch.tensor(
            [1.0 if greedy else t for t, greedy in zip(temps, greedy_rows, strict=True)],
            device=device,
        )
        scaled = logits / temperature[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    probs = logp.exp()
    if any(p.top_p < 1.0 or p.top_k_active for p in params):
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if p.top_k_active else vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep = (ranks[None, :] < top_k[:, None]) & (mass_before < top_p[:, None])
        keep[:, 0] = True
        # Scatter back to vocabulary order so rows without a filter sample
        # exactly as they would in a batch where no row sorts.
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
    uniforms = counter_uniforms(seeds, counters)
    cdf = probs.double().cumsum(dim=-1)
    targets = torch.as_tensor(uniforms, device=device)[:, None] * cdf[:, -1:]
    chosen = torch.searchsorted(cdf, targets, right=True).clamp_(max=probs.shape[-1] - 1)
    landed_on_zero = probs.gather(1, chosen) <= 0
    if bool(landed_on_zero.any()):
        # Rounding at the top end of the cdf can land on a zero-probability token:
        # take the last token with mass instead.
        last_nonzero = (probs > 0).long().cumsum(dim=-1).argmax(dim=-1, keepdim=True)
        chosen = torch.where(landed_on_zero, last_nonzero, chosen)
    if any(greedy_rows):
        greedy = torch.tensor(greedy_rows, device=device)
        chosen = torch.where(greedy[:, None], logits.argmax(dim=-1, keepdim=True), chosen)
    chosen_logp = logp.gather(1, chosen)
    return chosen[:, 0].tolist(), chosen_logp[:, 0].tolist()
