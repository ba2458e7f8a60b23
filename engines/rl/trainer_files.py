"""The files a trainer saves, told apart: the policy that inference engines load, and
the trainer state that only a resuming trainer reads.

`PolicyTrainer.save` writes a Hugging Face directory (config, weights, tokenizer) and the
trainer state: the optimizer (AdamW moments, twice the weights; the Megatron backend
writes one file per model-parallel shard), the minibatch RNG and ``trainer_state.json``
(steps done, backend, policy version). Sluice publishes the two apart, so that readers
of a version never fetch optimizer bytes (tasks/run/versions.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OPTIMIZER_FILE = "optimizer.pt"
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
) -> Any:
    """A copy of ``model``'s weights and ``optimizer``'s state in host memory (three
    times the float32 weights: the trainer's critical path pays this copy), and a
    function ``write(out_dir, *, state_dir=None, extra=None)`` that writes from it the
    files ``PolicyTrainer.save`` would have written at the time of the copy."""
    import torch

    with torch.no_grad():
        weights = host_copy(model.state_dict())
        optimizer_state = host_copy(optimizer.state_dict())
    rng = rng_state.clone()

    def write(
        out_dir: str | Path,
        *,
        state_dir: str | Path | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, state_dict=weights, safe_serialization=True)
        torch.save(optimizer_state, out / OPTIMIZER_FILE)
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
