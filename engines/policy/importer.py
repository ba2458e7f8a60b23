"""Turning a pretrained model into the directory Sluice trains (`sluice model import`).

The source is a GGUF file (llama.cpp's format, usually quantized) or a Hugging Face
model directory. The result is the plain layout every part of Sluice loads:

- ``model.safetensors`` (sharded with an index when large) in one float dtype,
  dequantized: training needs real-valued weights, and the trainer, the inference
  engine and SGLang all read safetensors;
- ``config.json`` without a ``quantization_config`` (a GGUF-loaded model carries
  one, and ``from_pretrained`` would then look for the GGUF again);
- ``generation_config.json`` whose ``eos_token_id`` lists every end token the
  config, the source's generation config and the tokenizer name (a chat model ends a
  turn with its own token, which a bare config may not list);
- the tokenizer: ``tokenizer.json`` and ``tokenizer_config.json``, the chat template
  inside the latter.

Every file's sha256 and one digest over them all (``directory_digest``) come back, so
a user can pin the exact weights a run started from.

The directory is built in a hidden sibling and renamed into place: a failed import
leaves nothing at the destination, and ``force`` replaces an old one only once the new
one is complete. torch, transformers and gguf are imported inside the functions that
convert, so ``check_paths`` (the cheap checks) runs before any of them, as the CLI
wants (docs/architecture.md: parse and validate first).

GGUF weights are read with transformers' own GGUF reader
(``load_gguf_checkpoint``, which undoes llama.cpp's q/k row permutation), into a model
built from the GGUF's config: ``from_pretrained(..., gguf_file=...)`` would do the same
but needs ``accelerate`` at load time, and keeps a quantization config to strip.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
GGUF_MAGIC = b"GGUF"
# A source directory holds a tokenizer if it has one of these (fast, SentencePiece,
# byte-level BPE or WordPiece vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


class ModelImportError(ValueError):
    """A source or destination that cannot be imported, with a one-line message."""


@dataclass(frozen=True)
class ImportedModel:
    """What ``import_model`` wrote."""

    path: Path
    source_format: str
    """``gguf`` or ``huggingface``."""
    architecture: str
    """The model class, e.g. ``LlamaForCausalLM``."""
    num_parameters: int
    """Distinct parameters (tied embeddings counted once)."""
    dtype: str
    files: tuple[tuple[str, str], ...]
    """(relative path, sha256) of every file, sorted by path."""

    @property
    def digest(self) -> str:
        return directory_digest(self.files)


def file_sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def manifest(directory: Path) -> tuple[tuple[str, str], ...]:
    """(relative path, sha256) of every file under ``directory``, sorted by path."""
    names = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    return tuple((name, file_sha256(directory / name)) for name in names)


def directory_digest(files: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> str:
    """sha256 over the sorted ``sha256sum`` lines (``"<sha256>  <name>\\n"``) of the files.

    In the directory, ``sha256sum $(LC_ALL=C ls) | sha256sum`` prints the same digest.
    """
    lines = "".join(f"{sha}  {name}\n" for name, sha in sorted(files))
    return hashlib.sha256(lines.encode()).hexdigest()


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError as exc:
        raise ModelImportError(f"cannot read '{path}': {_one_line(exc)}") from exc


def check_paths(src: str | Path, dest: str | Path, *, force: bool = False) -> str:
    """Raise ModelImportError unless ``src`` can be read and ``dest`` written.

    Returns the source format, ``gguf`` or ``huggingface``. Reads nothing but file
    names and a GGUF's first four bytes.
    """
    source, target = Path(src), Path(dest)
    if not source.exists():
        raise ModelImportError(f"source '{source}' does not exist")
    if source.is_file():
        if not _is_gguf(source):
            raise ModelImportError(
                f"source '{source}' is neither a GGUF file nor a Hugging Face model directory"
            )
        source_format = "gguf"
    else:
        if not (source / "config.json").is_file():
            raise ModelImportError(
                f"'{source}' is not a Hugging Face model directory (no config.json)"
            )
        if not any((source / name).is_file() for name in TOKENIZER_FILES):
            raise ModelImportError(
                f"'{source}' has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); Sluice "
                "needs the model's own tokenizer beside its weights"
            )
        source_format = "huggingface"
    if target.exists() or target.is_symlink():
        if not target.is_dir() or target.is_symlink():
            raise ModelImportError(f"destination '{target}' exists and is not a directory")
        resolved, source_resolved = target.resolve(), source.resolve()
        if resolved == source_resolved or resolved in source_resolved.parents:
            raise ModelImportError(f"destination '{target}' holds the source '{source}'")
        if any(target.iterdir()) and not force:
            raise ModelImportError(
                f"destination '{target}' exists and is not empty (choose another directory, "
                "or --force to replace it)"
            )
    return source_format


def import_model(
    src: str | Path, dest: str | Path, *, dtype: str = "float32", force: bool = False
) -> ImportedModel:
    """Write ``src`` (a GGUF file or Hugging Face directory) to ``dest`` as Sluice's layout.

    Raises ModelImportError, with nothing written at ``dest``, for a source that cannot
    be read as a causal LM with its tokenizer, or a destination that cannot be written.
    """
    if dtype not in DTYPES:
        raise ModelImportError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    source_format = check_paths(src, dest, force=force)
    source, target = Path(src), Path(dest)
    if source_format == "gguf":
        model, tokenizer, generation = _load_gguf(source)
    else:
        model, tokenizer, generation = _load_huggingface(source, dtype)
    # mkdir, not mkdtemp: the directory gets the umask's mode, as any other would.
    staging = target.parent / f".{target.name}.import-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as exc:
        raise ModelImportError(f"cannot write '{target}': {_one_line(exc)}") from exc
    try:
        _write(model, tokenizer, generation, staging, dtype)
        _match_directory_mode(staging)
        files = manifest(staging)
        _move_into_place(staging, target)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError):  # a full disk, a read-only or vanished directory
            raise ModelImportError(f"cannot write '{target}': {_one_line(exc)}") from exc
        raise
    return ImportedModel(
        path=target,
        source_format=source_format,
        architecture=type(model).__name__,
        num_parameters=sum(p.numel() for p in model.parameters()),
        dtype=dtype,
        files=files,
    )


def _match_directory_mode(directory: Path) -> None:
    """Give every file the mode a file created under the umask gets (some writers use 0600)."""
    mode = directory.stat().st_mode & 0o666
    for path in directory.rglob("*"):
        if path.is_file():
            path.chmod(mode)


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename the finished ``staging`` to ``target``; an old ``target`` goes only now."""
    if not target.exists():
        staging.rename(target)
        return
    old = staging.with_name(staging.name + ".old")
    target.rename(old)
    try:
        staging.rename(target)
    except BaseException:
        old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def gguf_architecture(path: Path) -> str:
    """The architecture a GGUF file declares (``general.architecture``)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
        return str(field.contents())
    except Exception as exc:  # a truncated or damaged file fails anywhere in the header
        raise ModelImportError(f"cannot read GGUF file '{path}': {_one_line(exc)}") from exc


def _load_gguf(path: Path) -> tuple[Any, Any, Any]:
    """(float32 model, tokenizer, generation config) from a GGUF file."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(path.parent), path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
        # On the meta device first: the config is the file's claim, and a small file
        # may claim a model of terabytes; nothing is allocated until the tensors agree.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as exc:  # an architecture transformers has no mapping or class for
        architecture = gguf_architecture(path)
        raise ModelImportError(
            f"transformers {transformers.__version__} cannot load GGUF architecture "
            f"'{architecture}' ({path}) as a causal LM: {_one_line(exc)}"
        ) from exc
    check_declared_size(path, skeleton, gguf_tensor_elements(path))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
        missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    except Exception as exc:  # e.g. an architecture only transformers' newer GGUF path reads
        raise ModelImportError(
            f"transformers {transformers.__version__} cannot read the weights of GGUF "
            f"architecture '{gguf_architecture(path)}' ({path}): {_one_line(exc)}"
        ) from exc
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelImportError(
            f"the tensors of '{path}' do not fit {type(model).__name__}: missing "
            f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as exc:
        raise ModelImportError(f"cannot read the tokenizer of '{path}': {_one_line(exc)}") from exc
    follow_special_tokens(tokenizer, gguf_special_token_ids(path))
    return model.eval(), tokenizer, None


def gguf_tensor_elements(path: Path) -> int:
    """How many weights the tensors of a GGUF file hold (the reader maps each tensor's
    bytes, so a file shorter than its tensors fails here)."""
    from gguf import GGUFReader

    try:
        return sum(int(tensor.n_elements) for tensor in GGUFReader(str(path)).tensors)
    except Exception as exc:  # a truncated or damaged file fails anywhere in the header
        raise ModelImportError(f"cannot read GGUF file '{path}': {_one_line(exc)}") from exc


def check_declared_size(source: Path, skeleton: Any, stored: int) -> None:
    """Refuse, in one line, a source whose config declares more parameters than its
    tensors hold (`skeleton`: the model built on the meta device; `stored`: the weights
    the files hold). Fewer declared is left to the load, which names what does not fit."""
    declared = sum(p.numel() for p in skeleton.parameters())
    if declared > stored:
        config = skeleton.config
        shape = ", ".join(
            f"{key} {getattr(config, key)}"
            for key in ("num_hidden_layers", "hidden_size", "vocab_size")
            if getattr(config, key, None) is not None
        )
        raise ModelImportError(
            f"'{source}' declares a model of {declared:,} parameters ({shape}) but its "
            f"tensors hold {stored:,}: its config does not match its weights"
        )


# The GGUF's own ids of the tokenizer's special tokens (llama.cpp's metadata keys).
GGUF_SPECIAL_TOKENS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
}


def gguf_special_token_ids(path: Path) -> dict[str, int]:
    """{"bos" | "eos" | "pad": id} as the GGUF file declares them (absent keys left out)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    return {
        role: int(fields[key].contents())
        for role, key in GGUF_SPECIAL_TOKENS.items()
        if key in fields
    }


def follow_special_tokens(tokenizer: Any, ids: dict[str, int]) -> None:
    """Name the special tokens the GGUF declares, where the tokenizer transformers built
    from it names others: transformers 5.17 makes SmolLM2's `<|im_start|>` (its bos) the
    eos token where the GGUF says `<|im_end|>`, and leaves pad unset; 5.23 follows the
    file. The end tokens a run stops on come from the eos token, so the file decides."""
    for role, token_id in ids.items():
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token is not None and getattr(tokenizer, f"{role}_token_id", None) != token_id:
            setattr(tokenizer, f"{role}_token", token)


def _load_huggingface(path: Path, dtype: str) -> tuple[Any, Any, Any]:
    """(model in ``dtype``, tokenizer, generation config or None) from a model directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        declared = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelImportError(f"cannot read '{path / 'config.json'}': {_one_line(exc)}") from exc
    quantization = declared.get("quantization_config") if isinstance(declared, dict) else None
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise ModelImportError(
            f"'{path}' holds quantized weights (quant_method '{method}'); import the "
            "unquantized checkpoint, or its GGUF file"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ModelImportError(f"cannot load the tokenizer of '{path}': {_one_line(exc)}") from exc
    _check_directory_size(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), local_files_only=True
        )
    except Exception as exc:
        raise ModelImportError(f"cannot load a causal LM from '{path}': {_one_line(exc)}") from exc
    generation = None
    if (path / "generation_config.json").is_file():
        try:
            generation = GenerationConfig.from_pretrained(path, local_files_only=True)
        except Exception as exc:
            raise ModelImportError(
                f"cannot read '{path / 'generation_config.json'}': {_one_line(exc)}"
            ) from exc
    return model.eval(), tokenizer, generation


# Bytes per element of the safetensors dtypes Sluice meets (others are not checked).
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2}
_SAFETENSORS_BYTES |= {"I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


def safetensors_elements(model_dir: str | Path) -> int | None:
    """How many weights the directory's ``*.safetensors`` files hold, read from their
    headers alone (None when there are none). ModelImportError, in one line, for a header
    whose tensors do not fit the file's bytes: the count is what a model's declared
    size is checked against before anything is allocated (`check_declared_size`).
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        try:
            with file.open("rb") as handle:
                length = int.from_bytes(handle.read(8), "little")
                room = file.stat().st_size - 8 - length
                if length > _MAX_HEADER_BYTES or room < 0:
                    raise ModelImportError(f"'{file}' is not a safetensors file (bad header)")
                header = json.loads(handle.read(length))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelImportError(f"cannot read '{file}': {exc}") from exc
        if not isinstance(header, dict):
            raise ModelImportError(f"'{file}' is not a safetensors file (bad header)")
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                count = 1
                for dim in entry["shape"]:
                    count *= int(dim)
                start, end = (int(offset) for offset in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ModelImportError(
                    f"'{file}': tensor {name!r} has no shape or offsets"
                ) from exc
            width = _SAFETENSORS_BYTES.get(str(entry.get("dtype")))
            if not 0 <= start <= end <= room or (width and (end - start) != count * width):
                raise ModelImportError(
                    f"'{file}': tensor {name!r} declares {count:,} elements that its bytes "
                    f"[{start}, {end}) of {room} do not hold"
                )
            total += count
    return total


def _check_directory_size(path: Path) -> None:
    """A model directory's declared size against its safetensors (as for a GGUF)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    stored = safetensors_elements(path)
    if stored is None:
        return  # pytorch_model.bin: its sizes are known only by loading it
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception as exc:
        raise ModelImportError(f"cannot load a causal LM from '{path}': {_one_line(exc)}") from exc
    check_declared_size(path, skeleton, stored)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def end_token_ids(config: Any, generation: Any, tokenizer: Any) -> list[int]:
    """Every end token the config, the generation config and the tokenizer name, sorted."""
    ids = {
        *_ids(getattr(config, "eos_token_id", None)),
        *_ids(getattr(generation, "eos_token_id", None)),
        *_ids(getattr(tokenizer, "eos_token_id", None)),
    }
    return sorted(ids)


def _write(model: Any, tokenizer: Any, generation: Any, out: Path, dtype: str) -> None:
    import torch
    from transformers import GenerationConfig

    model.to(getattr(torch, dtype))
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if generation is None:
        generation = GenerationConfig(
            bos_token_id=getattr(config, "bos_token_id", None),
            pad_token_id=getattr(config, "pad_token_id", None),
        )
    end_ids = end_token_ids(config, generation, tokenizer)
    if end_ids:
        generation.eos_token_id = end_ids[0] if len(end_ids) == 1 else end_ids
    if generation.pad_token_id is None and tokenizer.pad_token_id is not None:
        generation.pad_token_id = tokenizer.pad_token_id
    model.generation_config = generation
    model.save_pretrained(out)
    # The chat template inside tokenizer_config.json, where every reader (SGLang's
    # included) looks, rather than in a separate chat_template.jinja.
    tokenizer.save_pretrained(out, save_jinja_files=False)
