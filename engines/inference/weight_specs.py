"""Whether tensors a peer offers fit the served model, checked before any byte moves.

A weight route allocates receive buffers (``/update_weights_from_distributed``) or reads
another process's memory (``/update_weights_from_tensor``) at the sizes a request
states. Checked first against the served architecture, a request can only ask for what
an honest update would: tensors the model has, each at most once, in its shape, in a
floating dtype (or the served tensor's own), and in total no more bytes than the model
holds in float32 or its own dtype, whichever is larger (a trainer may send float32 to a
bfloat16 server).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


class SpecMismatch(ValueError):
    """Tensors that do not fit the served model; the message names the first few."""


def served_bytes_bound(served: Mapping[str, torch.Tensor]) -> int:
    """The most bytes an update of ``served`` may declare (see the module notes)."""
    seen: set[int] = set()
    total = 0
    for tensor in served.values():
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen:  # tied weights share a storage
            continue
        seen.add(storage)
        total += tensor.untyped_storage().nbytes() * max(1, 4 // tensor.element_size())
    return total


def check_specs(
    specs: Sequence[tuple[str, str, tuple[int, ...]]],
    declared_bytes: int,
    served: Mapping[str, torch.Tensor],
) -> None:
    """SpecMismatch unless every ``(name, dtype, shape)`` of ``specs`` names a distinct
    served tensor of that shape, in a floating dtype or the served one, and
    ``declared_bytes`` (what the request would allocate or read) is within bound."""
    if not specs:
        raise SpecMismatch("an update needs at least one tensor")
    problems: list[str] = []
    seen: set[str] = set()
    for name, dtype, shape in specs:
        target = served.get(name)
        if name in seen:
            problems.append(f"{name[:80]} twice")
        elif target is None:
            problems.append(f"{name[:80]} is not a tensor of the served model")
        elif tuple(target.shape) != tuple(shape):
            problems.append(f"{name} {list(shape)[:8]} != {list(target.shape)}")
        elif dtype not in FLOAT_DTYPES and dtype != str(target.dtype).removeprefix("torch."):
            problems.append(f"{name} as {dtype[:20]}, not a floating dtype")
        seen.add(name)
        if len(problems) >= 3:
            break
    if problems:
        raise SpecMismatch(
            "the tensors sent do not fit the served architecture: " + "; ".join(problems)
        )
    bound = served_bytes_bound(served)
    if declared_bytes > bound:
        raise SpecMismatch(
            f"the update declares {declared_bytes} bytes, more than the served model's {bound}"
        )
