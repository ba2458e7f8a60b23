"""Synthetic training samples on the shipped tiny policy, shared by the trainer tests."""

from __future__ import annotations

import numpy as np

from sluice.engines.policy.shipped_policy import SHIPPED_DIR
from sluice.engines.rl.train_batch import TrainingSample

SHIPPED = SHIPPED_DIR
"""The tiny policy Sluice ships (a 0.9M-parameter Llama, tied embeddings)."""


def random_samples(
    seed: int, n: int = 24, prompt_len: int = 12, max_response: int = 40
) -> list[TrainingSample]:
    """`n` seeded samples: token ids in 3..29, responses of 3..`max_response` - 1 tokens,
    behaviour log-probs near -2 and normal advantages."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        response = rng.integers(3, 30, int(rng.integers(3, max_response)))
        behaviour = (-2.0 + 0.1 * rng.normal(size=len(response))).astype(np.float32)
        out.append(
            TrainingSample(rng.integers(3, 30, prompt_len), response, behaviour, rng.normal())
        )
    return out
