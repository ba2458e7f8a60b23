"""The policy model: the embedded tiny causal LM, its character tokenizer, and loading.

Sluice trains any local Hugging Face causal-LM directory. When no model path is
configured, it builds one here: a ~1M-parameter Llama (or Qwen2) with random weights
and a character-level tokenizer made with `tokenizers`, saved in the ordinary Hugging
Face layout (``config.json``, ``model.safetensors``, ``tokenizer.json``), so every
other part loads the tiny model through exactly the same code path as a real one.

Conventions of the embedded tokenizer (they match Llama-family tokenizers):
- one token per character; characters outside the alphabet become ``<unk>``;
- ``tokenizer(text)`` prepends ``<bos>``, so encode a *prompt* with the default and a
  *response* with ``add_special_tokens=False``, then append ``<eos>``;
- ``decode(ids, skip_special_tokens=True)`` returns the exact text (round-trip).
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

# Printable ASCII plus newline and tab: covers the built-in task and most English/LaTeX
# dataset text, while keeping the embedding table tiny (~100 rows).
DEFAULT_ALPHABET = string.printable.replace("\x0b", "").replace("\x0c", "").replace("\r", "")

# Written into a directory built here, so a cache hit can tell "ours, finished" from
# "half-written" or "someone else's model".
TINY_POLICY_MARKER = "sluice_tiny_policy.json"


class PolicyLoadError(ValueError):
    """A model directory that cannot be loaded, with a message naming the directory."""


@dataclass(frozen=True)
class TinyPolicySpec:
    """Shape of the embedded tiny policy (defaults give ~0.85M parameters)."""

    arch: Literal["llama", "qwen2"] = "llama"
    """Hugging Face architecture: Llama (no attention bias) or Qwen2 (q/k/v bias)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads; must divide hidden_size. Key/value heads equal query heads (no GQA)."""
    intermediate_size: int = 384
    """Width of the gated MLP."""
    max_position_embeddings: int = 512
    """Longest prompt+response in tokens (characters + bos/eos)."""
    rope_theta: float = 10000.0
    """RoPE base; the default suits sequences of a few hundred tokens."""
    seed: int = 0
    """Seeds the random initialisation; the same spec and seed give identical weights."""

    def validate(self) -> None:
        """Raise ValueError naming the field when the shape cannot build a model."""
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"tiny policy: {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"tiny policy: num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"tiny policy: head size hidden_size/num_heads = {self.hidden_size // self.num_heads} "
                "must be even for rotary embeddings"
            )
        if self.max_position_embeddings < 8:
            raise ValueError("tiny policy: max_position_embeddings must be >= 8")
        if self.arch not in ("llama", "qwen2"):
            raise ValueError(f"tiny policy: arch must be 'llama' or 'qwen2', got {self.arch!r}")


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over `alphabet` with <pad>=0, <bos>=1, <eos>=2, <unk>=3.

    Saveable with ``save_pretrained`` and loadable with ``AutoTokenizer``.
    """
    if not isinstance(alphabet, str) or not alphabet:
        raise ValueError("build_char_tokenizer: alphabet must be a non-empty string")
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        if ch not in vocab:
            vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    # Oniguruma's (?m) is "dot matches newline": every character, newline included,
    # becomes its own pre-token, so no merge or whitespace rule can join characters.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m)."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="right",
    )


def _tiny_config(spec: TinyPolicySpec, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=spec.rope_theta,
        # Tied input/output embeddings: a third fewer parameters in the vocab tables,
        # and the usual choice for models this small.
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
        use_cache=True,
    )
    if spec.arch == "llama":
        return LlamaConfig(**common)
    return Qwen2Config(**common)


def build_tiny_policy(
    out_dir: str | Path,
    *,
    arch: Literal["llama", "qwen2"] = "llama",
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 384,
    max_position_embeddings: int = 512,
    seed: int = 0,
    alphabet: str = DEFAULT_ALPHABET,
) -> Path:
    """Save a randomly initialised tiny causal LM + char tokenizer as an HF directory.

    Deterministic: the same arguments write the same weights. Returns `out_dir`.
    Files are written into a sibling temp directory and renamed into place, so a
    crash never leaves a half-written model at `out_dir`.
    """
    spec = TinyPolicySpec(
        arch=arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
    )
    spec.validate()
    out = Path(out_dir)
    tokenizer = build_char_tokenizer(alphabet)
    config = _tiny_config(spec, tokenizer)
    # Seed a private generator state: building a model must not disturb the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    staging = out.parent / f".{out.name}.staging"
    if staging.exists():
        _remove_tree(staging)
    staging.mkdir(parents=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    marker = {"spec": spec.__dict__, "num_parameters": count_parameters(model)}
    (staging / TINY_POLICY_MARKER).write_text(json.dumps(marker, indent=2))
    if out.exists():
        _remove_tree(out)
    staging.rename(out)
    return out


def resolve_device(name: str) -> str:
    """`cpu`, `cuda[:i]` as given; `auto` = `cuda` when a GPU is visible, else `cpu`."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def load_policy_dir(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    attn_implementation: Literal["sdpa", "eager"] = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load any local HF causal-LM directory as (model in eval mode, tokenizer).

    Never touches the network (``local_files_only=True``). A tokenizer without a pad
    token gets its eos token as pad, as most decoder-only checkpoints expect.
    Raises PolicyLoadError naming the directory when it is missing or not a model.
    """
    where = Path(path)
    if not where.exists():
        raise PolicyLoadError(f"model directory '{where}' does not exist")
    if not where.is_dir():
        raise PolicyLoadError(
            f"model path '{where}' is a file, expected a Hugging Face model directory"
        )
    if not (where / "config.json").is_file():
        raise PolicyLoadError(
            f"'{where}' is not a Hugging Face model directory (no config.json; "
            "expected config.json, *.safetensors and tokenizer files)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError variously
        raise PolicyLoadError(f"cannot load tokenizer from '{where}': {exc}") from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(
            where,
            local_files_only=True,
            dtype=dtype,
            attn_implementation=attn_implementation,
        )
    except Exception as exc:
        raise PolicyLoadError(f"cannot load causal LM weights from '{where}': {exc}") from exc
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    # transformers' stub for .to() mis-types its first argument; the call is ordinary nn.Module.to.
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    return model, tokenizer


def is_tiny_policy_dir(path: str | Path) -> bool:
    """True when `path` holds a complete tiny policy written by build_tiny_policy."""
    return (Path(path) / TINY_POLICY_MARKER).is_file()


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)
