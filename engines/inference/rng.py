"""The counter-based random generator behind every sampled token.

Each request draws its uniforms from a generator keyed by ``(seed, output token
index)``, not from one stateful generator: a request's tokens then do not depend
on which other requests share its batch, nor on retraction or re-prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

U64_MASK = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def counter_uniforms(seeds: Sequence[int], counters: Sequence[int]) -> np.ndarray:
    """Uniforms in [0, 1) that depend only on (seed, counter) of each row.

    A counter-based generator rather than one stateful generator per request:
    row r's draw for its n-th token is the same whatever else is batched with
    it, and after a retract/re-prefill the sequence picks up its stream
    exactly where it left off.
    """
    seed_arr = np.array([s & U64_MASK for s in seeds], dtype=np.uint64)
    counter_arr = np.array(counters, dtype=np.uint64)
    with np.errstate(over="ignore"):
        keyed = _mix64(seed_arr + np.uint64(0x9E3779B97F4A7C15))
        mixed = _mix64(keyed ^ (counter_arr * np.uint64(0xD1B54A32D192ED03)))
    return (mixed >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
