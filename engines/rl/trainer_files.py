"""The files a trainer saves, told apart: the policy that inference engines load, and
the trainer state that only a resuming trainer reads.

`PolicyTrainer.save` writes a Hugging Face directory (config, weights, tokenizer) and the
trainer state: the optimizer (AdamW moments, twice the weights; the Megatron backend
writes one file per model-parallel shard; the torch backend splits a large state into
parts), the minibatch RNG and ``trainer_state.json`` (steps done, backend, policy
version). Sluice publishes the two apart, so that readers of a version never fetch
optimizer bytes (tasks/run/versions.py).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

OPTIMIZER_FILE = "optimizer.pt"
OPTIMIZER_PART_BYTES = 256 << 20
"""The torch backend's optimizer state goes into parts of about this size
(``optimizer.pt``, then ``optimizer.part1.pt``, ...): written, hashed and made durable
side by side, a version's trainer state takes about as long as its largest part rather
than the sum (SmolLM2-135M's AdamW moments, 1.08 GB, are five parts)."""
PARTS_KEY = "sluice_parts"
"""In ``optimizer.pt`` of a state written in parts: how many parts there are."""
TRAINER_STATE_FILE = "trainer_state.json"
RNG_STATE_FILE = "trainer_rng.pt"
ADAPTER_DIR = "adapter"
"""Where a resuming LoRA trainer finds its adapter, inside the directory holding the base:
apart, because transformers would take an ``adapter_config.json`` beside ``config.json``
for a model to download."""


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
"""Files a Hugging Face tokenizer is saved as (BPE, SentencePiece, WordPiece, chat template)."""


def read_tokenizer_files(model_dir: str | Path) -> dict[str, bytes]:
    """The tokenizer files of `model_dir`, as bytes (a few MB), kept by the trainer so that
    every version it saves carries the tokenizer of version 0 byte for byte.

    Saving the loaded tokenizer again would not: transformers moves the chat template out
    of ``tokenizer_config.json`` and rewrites the config, so rollout, reward and a
    user's tools would read differently written files from version 1 on.
    """
    where = Path(model_dir)
    return {
        name: (where / name).read_bytes() for name in TOKENIZER_FILES if (where / name).is_file()
    }


def write_tokenizer_files(files: dict[str, bytes], tokenizer: Any, out: Path) -> None:
    """Write `files` into `out`; a tokenizer read from no such file is saved by transformers."""
    if not files:
        tokenizer.save_pretrained(out)
    for name, data in files.items():
        (out / name).write_bytes(data)


def is_trainer_state_file(name: str) -> bool:
    """Whether file `name` ('/'-separated) of a saved directory is trainer state: the
    optimizer (``optimizer.pt``, or ``optimizer.tp1.pp0.pt``-style shards), the minibatch
    RNG or ``trainer_state.json``."""
    base = name.rsplit("/", 1)[-1]
    stem = OPTIMIZER_FILE.removesuffix(".pt")
    optimizer = base == OPTIMIZER_FILE or (base.startswith(f"{stem}.") and base.endswith(".pt"))
    return optimizer or base in (RNG_STATE_FILE, TRAINER_STATE_FILE)


def _tensor_bytes(value: Any) -> int:
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.element_size()) * int(value.numel())
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


def optimizer_parts(state: dict[str, Any], part_bytes: int | None = None) -> list[dict[str, Any]]:
    """An optimizer ``state_dict`` as the parts ``save_optimizer_state`` writes: its
    per-parameter states in order, in ceil(bytes / ``part_bytes``) parts of about equal
    bytes (a new part once one holds its share). The first part carries the rest of the
    dict (``param_groups``) and, if there are more, their number under ``PARTS_KEY``. A
    state under ``part_bytes`` (default ``OPTIMIZER_PART_BYTES``) is one part, unchanged."""
    limit = OPTIMIZER_PART_BYTES if part_bytes is None else part_bytes
    per_parameter = state.get("state", {})
    total = sum(_tensor_bytes(value) for value in per_parameter.values())
    target = total / max(1, -(-total // limit))  # as many parts as needed, evened out
    groups: list[dict[Any, Any]] = [{}]
    size = 0
    for key, value in per_parameter.items():
        if size >= target:
            groups.append({})
            size = 0
        groups[-1][key] = value
        size += _tensor_bytes(value)
    if len(groups) == 1:
        return [state]
    first = {**state, "state": groups[0], PARTS_KEY: len(groups)}
    return [first, *({"state": group} for group in groups[1:])]


def optimizer_part_file(index: int) -> str:
    return OPTIMIZER_FILE if index == 0 else OPTIMIZER_FILE.replace(".pt", f".part{index}.pt")


def save_optimizer_state(state: dict[str, Any], out: Path) -> None:
    """Write an optimizer ``state_dict`` into ``out`` in parts, several at a time."""
    import torch

    parts = optimizer_parts(state)
    with ThreadPoolExecutor(min(len(parts), 8), thread_name_prefix="optimizer-part") as pool:
        writes = [
            pool.submit(torch.save, part, out / optimizer_part_file(index))
            for index, part in enumerate(parts)
        ]
        for write in writes:
            write.result()


def load_optimizer_state(path: Path, map_location: Any) -> dict[str, Any]:
    """The ``state_dict`` that ``save_optimizer_state`` wrote to ``path`` (its
    ``optimizer.pt``) and the parts beside it; a missing part is an error, never a
    silently shorter state."""
    import torch

    # weights_only: tensors and plain values, never code (the files come from storage).
    state = torch.load(path, map_location=map_location, weights_only=True)
    count = int(state.pop(PARTS_KEY, 1))
    for index in range(1, count):
        part = path.parent / optimizer_part_file(index)
        if not part.is_file():
            raise FileNotFoundError(
                f"{str(path.parent)!r} holds optimizer state in {count} parts but not "
                f"{part.name}: the trainer state is incomplete"
            )
        part_state = torch.load(part, map_location=map_location, weights_only=True)
        state["state"].update(part_state["state"])
    return state


def move_trainer_state(saved: Path, state_dir: Path) -> None:
    """Move the trainer-state files of directory `saved` into `state_dir` (made if needed)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    for path in list(saved.iterdir()):
        if path.is_file() and is_trainer_state_file(path.name):
            path.replace(state_dir / path.name)


def host_copy(value: Any, copies: dict[tuple[int, int, tuple[int, ...]], Any] | None = None) -> Any:
    """``value`` (a state dict, an optimizer state: tensors in dicts, lists, tuples) with
    every tensor copied to host memory; tensors sharing storage (tied weights) stay
    shared in the copy, so ``save_pretrained`` still writes them once."""
    import torch

    copies = {} if copies is None else copies
    if isinstance(value, torch.Tensor):
        key = (
            int(value.untyped_storage().data_ptr()),
            int(value.storage_offset()),
            tuple(int(d) for d in value.shape),
        )
        if key not in copies:
            copies[key] = value.detach().to("cpu", copy=True)
        return copies[key]
    if isinstance(value, dict):
        return {k: host_copy(v, copies) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(host_copy(v, copies) for v in value)
    return value


def deferred_save(
    model: Any,
    optimizer: Any,
    rng_state: Any,
    saved_state: dict[str, Any],
    tokenizer: Any,
    tokenizer_files: dict[str, bytes],
    *,
    weights_only: bool = False,
) -> Any:
    """A copy of ``model``'s weights and ``optimizer``'s state in host memory (three
    times the float32 weights: the trainer's critical path pays this copy), and a
    function ``write(out_dir, *, state_dir=None, extra=None)`` that writes from it the
    files ``PolicyTrainer.save`` would have written at the time of the copy.

    `weights_only`: copy the weights alone (a third of it) and write the policy
    directory alone (a version that is servable, not durable)."""
    import torch

    with torch.no_grad():
        weights = host_copy(model.state_dict())
        optimizer_state = None if weights_only else host_copy(optimizer.state_dict())
    rng = rng_state.clone()

    def write(
        out_dir: str | Path,
        *,
        state_dir: str | Path | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if optimizer_state is None:
            model.save_pretrained(out, state_dict=weights, safe_serialization=True)
            write_tokenizer_files(tokenizer_files, tokenizer, out)
            return out
        with ThreadPoolExecutor(1, thread_name_prefix="weights") as pool:  # beside the parts
            written = pool.submit(
                model.save_pretrained, out, state_dict=weights, safe_serialization=True
            )
            save_optimizer_state(optimizer_state, out)
            written.result()
        state = out if state_dir is None else Path(state_dir)
        if state != out:
            move_trainer_state(out, state)
        write_tokenizer_files(tokenizer_files, tokenizer, out)
        torch.save(rng, state / RNG_STATE_FILE)
        (state / TRAINER_STATE_FILE).write_text(
            json.dumps({**saved_state, **(extra or {})}, indent=2)
        )
        return out

    write.weights = weights  # type: ignore[attr-defined]
    return write
