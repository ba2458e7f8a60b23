"""Continuous-batching inference engine with interruptible weight updates.

This is the rollout side's generator. It keeps up to ``max_batch_size``
sequences resident in a preallocated per-slot KV cache and runs one decode
step over all of them at a time; a sequence that finishes frees its slot at
once and the next waiting prompt is prefilled into it, so a short answer never
waits for the longest one in its batch (what ``transformers``' ``generate()``
does).

Every sampled token records the policy version of the weights that produced
it. ``update_weights_from_disk`` loads a new Hugging Face checkpoint between
two decode steps; the KV cache of every in-flight sequence is then recomputed
with the new weights (prompt plus the tokens generated so far), so the tokens
that follow are scored by the new policy and carry its version (AReaL §3,
interruptible generation). ``drain=True`` gives the ablation baseline instead:
admission stops, in-flight sequences finish under the old weights, then the
new weights load.

Sampling conventions (the trainer relies on them):

- ``behaviour_logprobs`` are ``log_softmax(logits / temperature)`` of the
  sampled token over the *full* vocabulary. top-p / top-k only restrict which
  token may be drawn; the logprob is still taken under the unrestricted
  tempered distribution, which is what the trainer recomputes (and what SGLang
  returns by default).
- temperature 0 is greedy decoding; its logprobs are ``log_softmax(logits)``.
- Each request draws its uniforms from a counter-based generator keyed by
  ``(seed, output token index)``, so a request's tokens do not depend on which
  other requests share its batch, nor on retraction or re-prefill.

Mismatch injection (studies only): with ``weight_noise_std`` σ > 0 every weight the
engine loads (the initial checkpoint and each ``update_weights_from_disk``) becomes
w + σ·std(w)·N(0, 1), drawn from a generator keyed by ``(seed, weight version, tensor
name)``. The trainer keeps clean weights, so π_behav ≠ π_prox by construction and a
rollout-correction study has a known, reproducible mismatch to correct.

Speed on small models (where a step's fixed costs, not its arithmetic, decide):

- a prompt cache keeps each prefilled prompt's K/V and last logits under the
  served weights, so the G samples of a GRPO group prefill their prompt once;
- Llama-shaped models run through ``engines.fast_decoder`` (fused projections, one
  rotary table) instead of the Hugging Face module tree;
- prefill packs whole sequences without padding, in chunks of
  ``max_prefill_tokens`` sized to stay in a CPU's cache; after a weight update
  every in-flight sequence is recomputed in these packed chunks;
- resident sequences keep their admission order in the slots, so decode attention
  runs over ranges of rows of similar length (``decode_buckets``) instead of
  padding every row to the longest.

Departures from SGLang/AReaL worth knowing: the prompt cache matches whole prompts,
not shared prefixes (no radix tree); prefill and decode run as separate forward
passes of one scheduler step; and models whose attention uses an active sliding
window shorter than ``max_seq_len`` are refused rather than windowed.
"""

from __future__ import annotations

import enum
import json
import math
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from engines.fast_decoder import FastDecoder
from engines.fast_decoder import supports as supports_fast

FinishReason = Literal["stop", "length", "abort"]

# top_k values at or above this are "off" (SGLang's default is 1 << 30).
_TOP_K_OFF = 1 << 30
_U64_MASK = (1 << 64) - 1


class WeightLoadError(ValueError):
    """A weight directory could not be loaded; the engine keeps its old weights."""


class EngineShutdownError(RuntimeError):
    """The engine was shut down before the request finished."""


class PauseMode(enum.StrEnum):
    """How ``pause`` treats in-flight requests (SGLang ``/pause_generation`` modes)."""

    ABORT = "abort"
    """Abort every running and waiting request; they return partial outputs."""
    RETRACT = "retract"
    """Keep the requests but drop their KV; they are re-prefilled after continue."""
    IN_PLACE = "in_place"
    """Stop scheduling and keep the KV cache as it is."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response."""

    max_new_tokens: int = 128
    """Upper bound on generated tokens (also bounded by ``max_seq_len``)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = -1
    """Keep only the k most likely tokens; <= 0 or >= 2**30 disables it."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the response (the model's EOS ids always do)."""
    ignore_eos: bool = False
    """If true, EOS ids do not end the response (stop_token_ids still do)."""
    seed: int | None = None
    """Per-request sampling seed; None draws one from the engine's seeded RNG."""

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first bad field."""
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not isinstance(self.temperature, int | float) or not self.temperature >= 0.0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise ValueError(f"stop_token_ids must be integers, got {token_id!r}")
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"stop_token_ids entry {token_id} is outside the vocabulary [0, {vocab_size})"
                )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def top_k_active(self) -> bool:
        return 0 < self.top_k < _TOP_K_OFF


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete."""

    prompt_token_ids: Sequence[int]
    """Token ids of the prompt (at least one, each inside the vocabulary)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling parameters of this request."""
    request_id: str | None = None
    """Caller-chosen id (unique among in-flight requests); None generates one."""


@dataclass(frozen=True)
class GenerationOutput:
    """A finished (or aborted) response, token-aligned."""

    request_id: str
    """Id the request was submitted under."""
    prompt_token_ids: tuple[int, ...]
    """The prompt as submitted."""
    output_token_ids: list[int]
    """Generated tokens, including a final stop/EOS token if one ended the response."""
    behaviour_logprobs: list[float]
    """log_softmax(logits / temperature) of each generated token (see module docstring)."""
    token_versions: list[int]
    """Policy version of the weights that generated each token."""
    finish_reason: FinishReason
    """``stop`` (EOS/stop token), ``length`` (max_new_tokens or max_seq_len), ``abort``."""
    matched_stop_token_id: int | None = None
    """The stop/EOS token that ended the response, when finish_reason is ``stop``."""
    abort_message: str | None = None
    """Why the request was aborted, when finish_reason is ``abort``."""
    admitted_step: int | None = None
    """Scheduler step at which the request was first prefilled (None if never)."""
    finished_step: int = 0
    """Scheduler step at which the request finished."""
    e2e_latency_s: float = 0.0
    """Seconds from submit to finish."""

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def version_start(self) -> int | None:
        return min(self.token_versions) if self.token_versions else None

    @property
    def version_end(self) -> int | None:
        return max(self.token_versions) if self.token_versions else None


@dataclass(frozen=True)
class WeightUpdateReport:
    """What a weight update did."""

    weight_version: int
    """Policy version now being served."""
    num_recomputed_requests: int
    """In-flight requests whose KV cache is recomputed under the new weights."""
    num_aborted_requests: int
    """Requests aborted because ``abort_all_requests`` was set."""
    read_s: float
    """Seconds spent reading the checkpoint from disk (generation kept running)."""
    drain_wait_s: float
    """Seconds spent waiting for in-flight requests to finish (drain mode only)."""
    apply_s: float
    """Seconds generation was stopped while the weights were copied in."""


@dataclass(eq=False)  # identity comparison: deque membership/removal must not compare fields
class _Sequence:
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    future: Future[GenerationOutput]
    submitted_at: float
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    admitted_step: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output_ids)

    def all_tokens(self) -> list[int]:
        return [*self.prompt, *self.output_ids]


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
    seed_arr = np.array([s & _U64_MASK for s in seeds], dtype=np.uint64)
    counter_arr = np.array(counters, dtype=np.uint64)
    with np.errstate(over="ignore"):
        keyed = _mix64(seed_arr + np.uint64(0x9E3779B97F4A7C15))
        mixed = _mix64(keyed ^ (counter_arr * np.uint64(0xD1B54A32D192ED03)))
    return (mixed >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def decode_buckets(lengths: list[int]) -> list[tuple[int, int, int]]:
    """``(start, end, keys)`` ranges of rows that attend together in a decode step.

    One padded batch makes every row read the longest row's keys; decode attention
    on a CPU is bound by reading the K/V cache, so that padding is most of its cost
    when response lengths are long-tailed. Resident rows are kept in admission
    order (lengths fall from first to last), so contiguous ranges are views into
    the cache: a new range starts where a row needs under half the keys of its
    range's first row, at most four ranges, none under eight rows.
    """
    buckets: list[tuple[int, int, int]] = []
    start, widest = 0, 0
    for row, length in enumerate(lengths):
        if (
            row - start >= 8
            and 2 * length < widest
            and len(buckets) < 3
            and len(lengths) - row >= 8
        ):
            buckets.append((start, row, widest))
            start, widest = row, 0
        widest = max(widest, length)
    buckets.append((start, len(lengths), widest))
    return buckets


class _SlotKVCache:
    """Preallocated K/V tensors ``[slots, kv_heads, max_seq_len, head_dim]`` per layer.

    Duck-types the one method Hugging Face attention calls (``update``). The
    engine sets a plan before each forward: a prefill writes rows
    ``[start, start + k)`` at positions ``[0, T)``; a decode writes one token
    per row ``r < b`` at that row's own position. Resident sequences always
    occupy slots ``[0, b)`` (the engine compacts on release), so the decode
    read is a view, not a gather.
    """

    def __init__(
        self,
        num_layers: int,
        slots: int,
        kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (slots, kv_heads, max_seq_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._mode = "prefill"
        self._start = 0
        self._length = 0
        self._rows: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self.decode_buckets: list[tuple[int, int, int]] = []
        """Set by ``plan_decode``: see ``decode_buckets``."""

    def plan_prefill(self, start: int, length: int) -> None:
        self._mode, self._start, self._length = "prefill", start, length

    def plan_decode(self, positions: torch.Tensor, kv_length: int) -> None:
        self._mode, self._length = "decode", kv_length
        self._positions = positions
        self._rows = torch.arange(positions.shape[0], device=positions.device)
        self.decode_buckets = decode_buckets((positions + 1).tolist())

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        rows = key_states.shape[0]
        if self._mode == "prefill":
            end, t = self._start + rows, key_states.shape[2]
            keys[self._start : end, :, :t] = key_states
            values[self._start : end, :, :t] = value_states
            return keys[self._start : end, :, :t], values[self._start : end, :, :t]
        assert self._rows is not None and self._positions is not None
        keys[self._rows, :, self._positions] = key_states[:, :, 0]
        values[self._rows, :, self._positions] = value_states[:, :, 0]
        return keys[:rows, :, : self._length], values[:rows, :, : self._length]

    def snapshot(self, slot: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of one slot's K/V over positions ``[0, length)``, per layer."""
        return (
            [k[slot, :, :length].clone() for k in self.keys],
            [v[slot, :, :length].clone() for v in self.values],
        )

    def load(self, slot: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write stored per-layer K/V (``[kv_heads, P, head_dim]``) into a slot at ``[0, P)``."""
        length = keys[0].shape[1]
        for dst, src in zip(self.keys, keys, strict=True):
            dst[slot, :, :length] = src
        for dst, src in zip(self.values, values, strict=True):
            dst[slot, :, :length] = src

    @torch.inference_mode()
    def shift(self, source: int, target: int, rows: int, length: int) -> None:
        """Move slots ``[source, source + rows)`` to ``[target, ...)`` over positions ``[0, length)``."""
        overlap = source - target < rows  # then the block must be read before it is written
        for tensor in (*self.keys, *self.values):
            block = tensor[source : source + rows, :, :length]
            tensor[target : target + rows, :, :length] = block.clone() if overlap else block


@dataclass
class _PromptEntry:
    """A prefilled prompt: its K/V per layer (``[kv_heads, P, head_dim]``) and last logits."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor


def _entry_bytes(entry: _PromptEntry) -> int:
    tensors = [*entry.keys, *entry.values, entry.logits]
    return sum(t.numel() * t.element_size() for t in tensors)


class _PromptCache:
    """Prefilled prompts under the current weights, least recently used evicted first.

    RL samples G responses per prompt, so most admissions repeat a prompt already
    prefilled: a hit copies the prompt's K/V into the new slot and samples the first
    token from the stored logits, with no forward pass. Cleared whenever the weights
    change, so a hit is always what a fresh prefill under the served weights gives
    (up to float rounding of the batch it was computed in).
    """

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._entries: dict[tuple[int, ...], _PromptEntry] = {}
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, prompt: tuple[int, ...]) -> _PromptEntry | None:
        entry = self._entries.pop(prompt, None)
        if entry is not None:
            self._entries[prompt] = entry  # most recently used last
        return entry

    def put(self, prompt: tuple[int, ...], entry: _PromptEntry) -> None:
        size = _entry_bytes(entry)
        if self.capacity <= 0 or size > self.max_bytes:
            return
        old = self._entries.pop(prompt, None)
        if old is not None:
            self._bytes -= _entry_bytes(old)
        self._entries[prompt] = entry
        self._bytes += size
        while len(self._entries) > self.capacity or self._bytes > self.max_bytes:
            self._bytes -= _entry_bytes(self._entries.pop(next(iter(self._entries))))

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")
    return _DTYPES[dtype]


def read_weight_files(model_path: str | Path) -> dict[str, torch.Tensor]:
    """Read every tensor of a Hugging Face checkpoint directory onto the CPU.

    Supports single and sharded safetensors and ``pytorch_model.bin``.
    """
    from safetensors.torch import load_file

    directory = Path(model_path)
    if not directory.is_dir():
        raise WeightLoadError(f"weight directory {str(model_path)!r} does not exist")
    index = directory / "model.safetensors.index.json"
    try:
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            tensors: dict[str, torch.Tensor] = {}
            for shard in shards:
                tensors.update(load_file(str(directory / shard), device="cpu"))
            return tensors
        files = sorted(directory.glob("*.safetensors"))
        if files:
            tensors = {}
            for path in files:
                tensors.update(load_file(str(path), device="cpu"))
            return tensors
        bin_file = directory / "pytorch_model.bin"
        if bin_file.is_file():
            loaded = torch.load(bin_file, map_location="cpu", weights_only=True)
            return dict(loaded)
    except Exception as exc:  # safetensors raises its own error type for corrupt files
        raise WeightLoadError(f"cannot read weights from {str(model_path)!r}: {exc}") from exc
    raise WeightLoadError(
        f"no weights in {str(model_path)!r}: expected model.safetensors, sharded safetensors "
        "with model.safetensors.index.json, or pytorch_model.bin"
    )


def _noise_generator(seed: int, weight_version: int, name: str) -> torch.Generator:
    # Keyed by the tensor's name, not its position: the noise of one tensor never depends
    # on which other tensors a checkpoint holds or the order they were read in.
    key = np.random.SeedSequence(
        [seed & _U64_MASK, weight_version & _U64_MASK, zlib.crc32(name.encode())]
    )
    return torch.Generator().manual_seed(int(key.generate_state(1, np.uint64)[0]))


def perturb_weights(
    tensors: dict[str, torch.Tensor], noise_std: float, *, seed: int, weight_version: int
) -> dict[str, torch.Tensor]:
    """``w + noise_std · std(w) · N(0, 1)`` for every floating tensor (integer buffers kept).

    The noise is relative to each tensor's own spread, so one σ perturbs embeddings, norms
    and projections alike; a constant tensor (an all-ones norm) stays exact. Drawn on the
    CPU in float32 from a generator keyed by ``(seed, weight_version, name)``: the same
    checkpoint served as the same version gets the same noise on any machine, and every
    new version gets fresh noise, as a real kernel or precision mismatch would.
    """
    if not noise_std:
        return tensors
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            out[name] = tensor
            continue
        clean = tensor.detach().to(device="cpu", dtype=torch.float32)
        noise = torch.randn(
            clean.shape,
            generator=_noise_generator(seed, weight_version, name),
            dtype=torch.float32,
        )
        scale = noise_std * clean.std(correction=0) if clean.numel() else 0.0
        out[name] = (clean + scale * noise).to(tensor.dtype)
    return out


class InferenceEngine:
    """Continuous-batching generator over a local Hugging Face causal LM.

    Thread-safe: ``submit``/``abort``/``pause``/``update_weights_from_disk``
    may be called from any thread; they take effect between scheduler steps.
    Drive it either with ``start()`` (a background scheduler thread) or by
    calling ``step()`` yourself; ``result()`` and ``generate()`` step inline
    when no background thread runs.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype | str = "float32",
        max_batch_size: int = 64,
        max_seq_len: int | None = None,
        seed: int = 0,
        weight_version: int = 0,
        max_prefill_tokens: int | None = None,
        num_threads: int | None = None,
        weight_noise_std: float = 0.0,
        prompt_cache_size: int | None = None,
        fast_forward: bool = True,
    ) -> None:
        """Load ``model_dir`` (local files only) and allocate the KV cache.

        Args:
            model_dir: Hugging Face model directory (config + weights).
            device: ``cpu`` or ``cuda[:i]``.
            dtype: parameter and KV cache dtype (``float32``, ``bfloat16``, ``float16``).
            max_batch_size: number of KV slots, i.e. sequences decoded together.
            max_seq_len: prompt + response token budget per slot; default
                ``min(max_position_embeddings, 2048)``.
            seed: seeds the per-request sampling seeds of requests without one.
            weight_version: policy version of the weights in ``model_dir``.
            max_prefill_tokens: tokens per prefill forward (padded ones included on the
                Hugging Face path). Default 512 on a CPU, where a chunk whose
                activations stay in cache runs ~2.4x faster per token than one of
                8192, and 8192 on a GPU.
            num_threads: if set, torch intra-op threads for this process (a
                process-wide setting). Small models decode fastest on 1: their
                matmuls are too small to split, and on a shared CPU extra
                threads mostly spin against each other.
            weight_noise_std: relative std of Gaussian noise added to every weight
                loaded, keyed by ``(seed, weight version)`` (see ``perturb_weights``);
                injects train–inference mismatch on purpose. 0 = off.
            prompt_cache_size: prefilled prompts kept for reuse (see ``_PromptCache``);
                default ``max_batch_size``, 0 turns the cache off. Whatever the count,
                the cache holds at most a quarter of the KV cache's bytes.
            fast_forward: run Llama-shaped models through ``engines.fast_decoder``
                (same arithmetic, fewer calls); False, or any other model type, runs
                the Hugging Face decoder.
        """
        from transformers import AutoModelForCausalLM

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_prefill_tokens is None:
            max_prefill_tokens = 512 if device == "cpu" else 8192
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        if not Path(model_dir).is_dir():
            raise ValueError(f"model directory {str(model_dir)!r} does not exist")
        if not (math.isfinite(weight_noise_std) and weight_noise_std >= 0):
            raise ValueError(f"weight_noise_std must be finite and >= 0, got {weight_noise_std}")
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)
        self.model_dir = str(model_dir)
        self.device = torch.device(device)
        self.dtype = _resolve_dtype(dtype)
        try:
            model: Any = AutoModelForCausalLM.from_pretrained(
                self.model_dir,
                dtype=self.dtype,
                local_files_only=True,
                attn_implementation="sdpa",
            )
        except Exception as exc:  # transformers raises OSError/ValueError/KeyError by case
            raise ValueError(
                f"cannot load a causal LM from {self.model_dir!r}: {type(exc).__name__}: {exc}"
            ) from exc
        self.model: Any = model.to(self.device).eval()
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.model_type = str(getattr(config, "model_type", ""))
        max_positions = int(getattr(config, "max_position_embeddings", 2048) or 2048)
        self.max_seq_len = int(max_seq_len) if max_seq_len is not None else min(max_positions, 2048)
        if not 2 <= self.max_seq_len <= max_positions:
            raise ValueError(
                f"max_seq_len must be in [2, max_position_embeddings={max_positions}], "
                f"got {self.max_seq_len}"
            )
        self._check_attention_is_full(config)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = self._eos_ids()
        self._decoder = self.model.get_decoder()
        self._lm_head = self.model.get_output_embeddings()
        self._fast = FastDecoder(self.model) if fast_forward and supports_fast(self.model) else None
        head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        with torch.inference_mode():
            self._cache = _SlotKVCache(
                int(config.num_hidden_layers),
                max_batch_size,
                kv_heads,
                self.max_seq_len,
                head_dim,
                self.dtype,
                self.device,
            )
        self._mask_min = torch.finfo(self.dtype).min
        if prompt_cache_size is not None and prompt_cache_size < 0:
            raise ValueError(f"prompt_cache_size must be >= 0, got {prompt_cache_size}")
        # At most a quarter of the slot cache's own size, whatever the entry count.
        kv_bytes = sum(
            t.numel() * t.element_size() for t in (*self._cache.keys, *self._cache.values)
        )
        self._prompts = _PromptCache(
            max_batch_size if prompt_cache_size is None else prompt_cache_size,
            max_bytes=kv_bytes // 4,
        )

        self._weight_version = int(weight_version)
        self._seed_rng = np.random.default_rng(seed)
        self.weight_noise_std = float(weight_noise_std)
        self._noise_seed = int(seed)
        if self.weight_noise_std:
            # from_pretrained loaded clean weights; overwrite them exactly as an update
            # would, so version 0 is perturbed like every later version.
            tensors = read_weight_files(self.model_dir)
            targets = self._match_state_dict(tensors, self.model_dir)
            with torch.no_grad():
                for name, tensor in self._perturb(tensors, self._weight_version).items():
                    targets[name].copy_(tensor)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._update_lock = threading.Lock()
        self._waiters_lock = threading.Lock()
        self._control_waiters = 0
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._in_flight: dict[str, _Sequence] = {}
        self._futures: dict[str, Future[GenerationOutput]] = {}
        self._paused = False
        self._admitting = True
        self._arrivals = 0
        self._thread: threading.Thread | None = None
        self._stop_thread = False
        self._closed = False
        self.step_count = 0
        self.decode_forwards = 0
        self.prefill_forwards = 0
        self.generated_tokens = 0
        self.recomputed_tokens = 0
        self.prefilled_tokens = 0

    # ------------------------------------------------------------------ setup

    def _check_attention_is_full(self, config: Any) -> None:
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if layer_types is not None:
            unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
            if unknown:
                raise ValueError(f"model layer types {unknown} are not supported by the engine")
            windowed = "sliding_attention" in layer_types
        else:
            windowed = (
                window is not None and getattr(config, "use_sliding_window", True) is not False
            )
        if windowed and window is not None and int(window) < self.max_seq_len:
            raise ValueError(
                f"model uses a sliding attention window of {window} tokens; the engine only "
                f"implements full attention, so set max_seq_len <= {window}"
            )

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        sources = [getattr(self.model, "generation_config", None), self.model.config]
        for source in sources:
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if value is None:
                continue
            ids.update([value] if isinstance(value, int) else list(value))
        return frozenset(int(i) for i in ids)

    # ------------------------------------------------------------ properties

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def is_serving(self) -> bool:
        """True while the background scheduler thread runs."""
        return self._thread_alive() and not self._closed

    @property
    def draining(self) -> bool:
        """True while a drain update holds back admission of waiting requests."""
        return not self._admitting

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # --------------------------------------------------------------- control

    class _Control:
        """Takes the engine lock ahead of the scheduler loop (which otherwise re-grabs it)."""

        def __init__(self, engine: InferenceEngine) -> None:
            self.engine = engine

        def __enter__(self) -> None:
            with self.engine._waiters_lock:
                self.engine._control_waiters += 1
            self.engine._lock.acquire()

        def __exit__(self, *exc: object) -> None:
            with self.engine._waiters_lock:
                self.engine._control_waiters -= 1
            self.engine._changed.notify_all()
            self.engine._lock.release()

    def _control(self) -> InferenceEngine._Control:
        return InferenceEngine._Control(self)

    def validate_request(self, request: GenerationRequest) -> None:
        """Raise ValueError naming what is wrong with ``request``; queues nothing."""
        prompt = request.prompt_token_ids
        if isinstance(prompt, str | bytes) or len(prompt) == 0:
            raise ValueError("prompt_token_ids must hold at least one token")
        for token_id in prompt:
            if isinstance(token_id, bool) or not isinstance(token_id, int | np.integer):
                raise ValueError(f"prompt_token_ids must be integers, got {token_id!r}")
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"prompt token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )
        if len(prompt) >= self.max_seq_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens but max_seq_len is {self.max_seq_len}; "
                "no room to generate"
            )
        request.sampling.validate(self.vocab_size)

    def submit(self, request: GenerationRequest) -> str:
        """Queue a request and return its id. Raises ValueError on bad input (nothing queued)."""
        self.validate_request(request)
        prompt = tuple(int(t) for t in request.prompt_token_ids)
        params = request.sampling
        with self._control():
            if self._closed:
                raise EngineShutdownError("the inference engine has been shut down")
            request_id = request.request_id or uuid.uuid4().hex
            if request_id in self._in_flight:
                raise ValueError(f"request id {request_id!r} is already in flight")
            seed = (
                params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**63))
            )
            stop_ids = frozenset(params.stop_token_ids) | (
                frozenset() if params.ignore_eos else self.eos_token_ids
            )
            seq = _Sequence(
                request_id=request_id,
                prompt=prompt,
                params=params,
                seed=seed,
                stop_ids=stop_ids,
                future=Future(),
                submitted_at=time.perf_counter(),
                arrival=self._arrivals,
            )
            self._arrivals += 1
            self._futures[request_id] = seq.future
            if params.max_new_tokens == 0:
                self._finish(seq, "length")
            else:
                self._in_flight[request_id] = seq
                self._waiting.append(seq)
            return request_id

    def future(self, request_id: str) -> Future[GenerationOutput]:
        """The future that resolves to the request's output."""
        with self._lock:
            if request_id not in self._futures:
                raise KeyError(f"unknown request id {request_id!r}")
            return self._futures[request_id]

    def result(self, request_id: str, timeout_s: float | None = None) -> GenerationOutput:
        """Block until the request finishes and return (and forget) its output.

        Without a background thread, this drives the scheduler itself.
        """
        fut = self.future(request_id)
        if not self._thread_alive():
            while not fut.done():
                if not self.step() and not fut.done():
                    raise RuntimeError(
                        f"request {request_id!r} cannot make progress: the engine is paused "
                        "and no scheduler thread is running"
                    )
        output = fut.result(timeout=timeout_s)
        with self._lock:
            self._futures.pop(request_id, None)
        return output

    def forget(self, request_id: str) -> None:
        """Drop the stored future of a request whose output was read through ``future()``."""
        with self._lock:
            self._futures.pop(request_id, None)

    async def generate_async(self, request: GenerationRequest) -> GenerationOutput:
        """Submit and await one request (needs the background thread from ``start()``)."""
        import asyncio

        request_id = self.submit(request)
        try:
            return await asyncio.wrap_future(self.future(request_id))
        finally:
            with self._lock:
                self._futures.pop(request_id, None)

    def generate(self, requests: Iterable[GenerationRequest]) -> list[GenerationOutput]:
        """Submit all requests, wait for all, return outputs in submission order."""
        ids = [self.submit(r) for r in requests]
        return [self.result(i) for i in ids]

    def abort(self, request_id: str, message: str = "aborted by request") -> bool:
        """Abort one waiting or running request; False if it is not in flight."""
        with self._control():
            seq = self._in_flight.get(request_id)
            if seq is None:
                return False
            if seq in self._waiting:
                self._waiting.remove(seq)
                self._finish(seq, "abort", abort_message=message)
            else:
                self._release([seq], reasons={seq.request_id: ("abort", None, message)})
            return True

    def abort_all(self, message: str = "aborted by request") -> int:
        """Abort every waiting and running request; returns how many."""
        with self._control():
            return self._abort_all_locked(message)

    def _abort_all_locked(self, message: str) -> int:
        count = len(self._waiting) + len(self._running)
        self._release(
            list(self._running),
            reasons={s.request_id: ("abort", None, message) for s in self._running},
        )
        # Snapshot first: a done-callback that submits again must not extend this loop.
        waiting = list(self._waiting)
        self._waiting.clear()
        for seq in waiting:
            self._finish(seq, "abort", abort_message=message)
        return count

    def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> int:
        """Stop scheduling (SGLang semantics of ``mode``); returns the requests affected."""
        try:
            mode = PauseMode(mode)
        except ValueError:
            raise ValueError(
                f"pause mode must be one of {[m.value for m in PauseMode]}, got {mode!r}"
            ) from None
        with self._control():
            self._paused = True
            if mode is PauseMode.ABORT:
                return self._abort_all_locked("aborted by pause_generation")
            if mode is PauseMode.RETRACT:
                return self._retract_all_locked()
            return len(self._running)

    def continue_generation(self) -> None:
        """Resume scheduling after ``pause``."""
        with self._control():
            self._paused = False

    def _retract_all_locked(self) -> int:
        """Drop the KV of every running sequence and put it back at the head of the queue."""
        retracted = sorted(self._running, key=lambda s: s.arrival)
        self._running.clear()
        self._waiting.extendleft(reversed(retracted))
        return len(retracted)

    def update_weights_from_disk(
        self,
        model_path: str | Path,
        weight_version: int,
        *,
        drain: bool = False,
        abort_all_requests: bool = False,
    ) -> WeightUpdateReport:
        """Load new weights (same architecture) from a Hugging Face directory.

        Interruptible (default): applied between two decode steps; every
        in-flight sequence has its KV recomputed under the new weights, so its
        later tokens carry ``weight_version``. ``drain=True``: stop admitting,
        let in-flight sequences finish under the old weights, then load.
        Raises WeightLoadError (old weights kept) if the directory is unusable.
        """
        if isinstance(weight_version, bool) or not isinstance(weight_version, int):
            raise ValueError(f"weight_version must be an integer, got {weight_version!r}")
        with self._update_lock:
            t0 = time.perf_counter()
            # Reading from disk happens while generation keeps running.
            tensors = self._perturb(read_weight_files(model_path), weight_version)
            self._check_config(model_path)
            targets = self._match_state_dict(tensors, model_path)
            read_s = time.perf_counter() - t0
            drain_wait_s = 0.0
            if drain:
                t1 = time.perf_counter()
                self._drain()
                drain_wait_s = time.perf_counter() - t1
            with self._control():
                t2 = time.perf_counter()
                aborted = (
                    self._abort_all_locked("aborted for a weight update")
                    if abort_all_requests
                    else 0
                )
                self._retract_all_locked()
                # Retracted sequences (now or by an earlier retract pause) all
                # have output tokens: their KV is rebuilt under the new weights.
                recomputed = sum(1 for s in self._waiting if s.output_ids)
                with torch.no_grad():
                    for name, tensor in tensors.items():
                        targets[name].copy_(tensor)
                self._prompts.clear()
                self._weight_version = weight_version
                self._admitting = True
                apply_s = time.perf_counter() - t2
            return WeightUpdateReport(
                weight_version=weight_version,
                num_recomputed_requests=recomputed,
                num_aborted_requests=aborted,
                read_s=read_s,
                drain_wait_s=drain_wait_s,
                apply_s=apply_s,
            )

    def _perturb(
        self, tensors: dict[str, torch.Tensor], weight_version: int
    ) -> dict[str, torch.Tensor]:
        return perturb_weights(
            tensors, self.weight_noise_std, seed=self._noise_seed, weight_version=weight_version
        )

    def _check_config(self, model_path: str | Path) -> None:
        config_path = Path(model_path) / "config.json"
        if not config_path.is_file():
            return
        try:
            model_type = json.loads(config_path.read_text()).get("model_type")
        except (OSError, ValueError) as exc:
            raise WeightLoadError(f"cannot read {config_path}: {exc}") from exc
        if model_type is not None and self.model_type and model_type != self.model_type:
            raise WeightLoadError(
                f"weights in {str(model_path)!r} are for model_type {model_type!r}, "
                f"but the engine serves {self.model_type!r}"
            )

    def _match_state_dict(
        self, tensors: dict[str, torch.Tensor], model_path: str | Path
    ) -> dict[str, torch.Tensor]:
        current = self.model.state_dict()
        unexpected = sorted(set(tensors) - set(current))
        mismatched = [
            f"{k} {tuple(t.shape)} != {tuple(current[k].shape)}"
            for k, t in tensors.items()
            if k in current and t.shape != current[k].shape
        ]
        loaded_ptrs = {current[k].data_ptr() for k in tensors if k in current}
        # Tied parameters (e.g. lm_head sharing the embedding) are saved once.
        missing = sorted(
            k for k in set(current) - set(tensors) if current[k].data_ptr() not in loaded_ptrs
        )
        problems = []
        if unexpected:
            problems.append(f"unexpected tensors {unexpected[:5]}")
        if mismatched:
            problems.append(f"shape mismatches {mismatched[:5]}")
        if missing:
            problems.append(f"missing tensors {missing[:5]}")
        if problems:
            raise WeightLoadError(
                f"weights in {str(model_path)!r} do not fit the served architecture: "
                + "; ".join(problems)
            )
        return current

    def _drain(self) -> None:
        with self._control():
            if self._paused and self._running:
                raise RuntimeError(
                    "a drain update cannot finish while generation is paused with requests "
                    "in flight; call continue_generation() first or use drain=False"
                )
            self._admitting = False
        if self._thread_alive():
            with self._changed:
                self._changed.wait_for(lambda: not self._running or self._paused or self._closed)
        else:
            while self._running and not self._paused:
                self.step()
        with self._control():
            if self._running:
                self._admitting = True
                raise RuntimeError(
                    "generation was paused or shut down while draining for a weight update; "
                    "the weights were not updated"
                )

    # ------------------------------------------------------------ scheduler

    def start(self) -> None:
        """Run the scheduler in a background daemon thread."""
        with self._lock:
            if self._thread_alive():
                return
            if self._closed:
                raise EngineShutdownError("the inference engine has been shut down")
            self._stop_thread = False
            self._thread = threading.Thread(target=self._loop, name="sluice-inference", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Stop the scheduler thread and abort whatever is still in flight."""
        with self._lock:
            self._stop_thread = True
            self._closed = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self._abort_all_locked("the inference engine shut down")

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while not self._stop_thread:
            while self._control_waiters > 0 and not self._stop_thread:
                time.sleep(0.0002)
            try:
                worked = self.step()
            except Exception as exc:  # keep serving: fail what was in flight, not the thread
                self._fail_in_flight(exc)
                continue
            if not worked:
                with self._changed:
                    if not self._stop_thread and not self._has_work():
                        self._changed.wait(timeout=0.05)

    def _fail_in_flight(self, exc: Exception) -> None:
        with self._lock:
            failed = [*self._running, *self._waiting]
            self._running.clear()
            self._waiting.clear()
            for seq in failed:
                self._in_flight.pop(seq.request_id, None)
                if not seq.future.done():
                    seq.future.set_exception(
                        RuntimeError(f"inference step failed: {type(exc).__name__}: {exc}")
                    )
            self._changed.notify_all()

    def _has_work(self) -> bool:
        if self._paused:
            return False
        return bool(self._running) or (self._admitting and bool(self._waiting))

    def step(self) -> bool:
        """One scheduler step: admit + prefill waiting prompts, then one decode step.

        Returns False when there was nothing to do (idle or paused).
        """
        with self._lock, torch.inference_mode():
            if not self._has_work():
                return False
            self.step_count += 1
            admitted: list[_Sequence] = []
            if self._admitting:
                free = self.max_batch_size - len(self._running)
                while self._waiting and len(admitted) < free:
                    admitted.append(self._waiting.popleft())
            if admitted:
                self._prefill(admitted)
            if self._running:
                self._decode()
            self._changed.notify_all()
            return True

    def _prefill(self, seqs: list[_Sequence]) -> None:
        """Admit new or retracted sequences into fresh slots and sample their next token.

        A new sequence whose prompt is in the prompt cache (or is prefilled earlier in
        this same admission) copies that prompt's K/V instead of running a forward.
        """
        to_prefill: list[_Sequence] = []
        reuse: list[_Sequence] = []
        first_of: set[tuple[int, ...]] = set()
        for seq in seqs:
            if seq.output_ids:  # retracted: recompute prompt + response under new weights
                to_prefill.append(seq)
            elif seq.prompt in first_of or self._prompts.get(seq.prompt) is not None:
                reuse.append(seq)
            else:
                first_of.add(seq.prompt)
                to_prefill.append(seq)
        chunk: list[_Sequence] = []
        longest = total = 0
        # Longest first, so each padded chunk holds sequences of similar length
        # (a recompute after a weight update re-prefills very uneven lengths). The
        # packed path pays for real tokens only; the padded one for rows x longest.
        packed = self._fast is not None
        for seq in sorted(to_prefill, key=lambda s: s.num_tokens, reverse=True):
            longest_if_added = max(longest, seq.num_tokens)
            cost = total + seq.num_tokens if packed else longest_if_added * (len(chunk) + 1)
            if chunk and cost > self.max_prefill_tokens:
                self._prefill_chunk(chunk)
                chunk, longest_if_added, total = [], seq.num_tokens, 0
            chunk.append(seq)
            longest = longest_if_added
            total += seq.num_tokens
        if chunk:
            self._prefill_chunk(chunk)
        if reuse:
            self._admit_from_cache(reuse)

    def _admit_from_cache(self, seqs: list[_Sequence]) -> None:
        entries = []
        for seq in seqs:
            entry = self._prompts.get(seq.prompt)
            if entry is None:  # evicted within this admission (cache smaller than it)
                self._prefill_chunk([seq])
                continue
            if seq.admitted_step is None:
                seq.admitted_step = self.step_count
            self._cache.load(len(self._running), entry.keys, entry.values)
            self._running.append(seq)
            entries.append((seq, entry))
        self._prompts.hits += len(entries)
        if entries:
            self._sample_and_advance(
                [seq for seq, _ in entries], torch.stack([e.logits for _, e in entries])
            )

    def _prefill_chunk(self, seqs: list[_Sequence]) -> None:
        start = len(self._running)
        lengths = [s.num_tokens for s in seqs]
        for r, seq in enumerate(seqs):
            if seq.admitted_step is None:
                seq.admitted_step = self.step_count
            elif seq.output_ids:
                self.recomputed_tokens += lengths[r]
        if self._fast is not None:
            tokens = [seq.all_tokens() for seq in seqs]
            slots = list(range(start, start + len(seqs)))
            last = self._fast.prefill_packed(tokens, slots, self._cache)
        else:
            last = self._padded_prefill(seqs, lengths, start)
        logits = self._lm_head(last).float()
        self.prefill_forwards += 1
        self.prefilled_tokens += sum(lengths)
        for r, seq in enumerate(seqs):
            if not seq.output_ids:
                self._prompts.misses += 1
                keys, values = self._cache.snapshot(start + r, lengths[r])
                self._prompts.put(seq.prompt, _PromptEntry(keys, values, logits[r].clone()))
        self._running.extend(seqs)
        self._sample_and_advance(seqs, logits)

    def _padded_prefill(
        self, seqs: list[_Sequence], lengths: list[int], start: int
    ) -> torch.Tensor:
        """Prefill through the Hugging Face decoder: one right-padded batch, explicit mask."""
        width, rows = max(lengths), len(seqs)
        input_ids = torch.zeros((rows, width), dtype=torch.long)
        for r, seq in enumerate(seqs):
            input_ids[r, : lengths[r]] = torch.tensor(seq.all_tokens(), dtype=torch.long)
        lengths_t = torch.tensor(lengths, device=self.device)
        positions = torch.arange(width, device=self.device)
        causal = positions[None, :] <= positions[:, None]
        allowed = causal[None] & (positions[None, None, :] < lengths_t[:, None, None])
        mask = torch.zeros((rows, 1, width, width), dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed[:, None], self._mask_min)
        self._cache.plan_prefill(start, width)
        hidden = self._forward(input_ids.to(self.device), positions[None, :].expand(rows, -1), mask)
        return hidden[torch.arange(rows, device=self.device), lengths_t - 1]

    def _forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Last hidden states of the decoder over the slot cache (plan set by the caller)."""
        if self._fast is not None:
            return self._fast.forward(input_ids, position_ids, mask, self._cache)
        return self._decoder(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=self._cache,
            use_cache=True,
        ).last_hidden_state

    def _decode(self) -> None:
        seqs = list(self._running)
        positions = torch.tensor([s.num_tokens - 1 for s in seqs], device=self.device)
        input_ids = torch.tensor([[s.output_ids[-1]] for s in seqs], device=self.device)
        kv_length = int(positions.max().item()) + 1
        keys = torch.arange(kv_length, device=self.device)
        mask = torch.zeros((len(seqs), 1, 1, kv_length), dtype=self.dtype, device=self.device)
        mask.masked_fill_((keys[None, :] > positions[:, None])[:, None, None, :], self._mask_min)
        self._cache.plan_decode(positions, kv_length)
        hidden = self._forward(input_ids, positions[:, None], mask)
        logits = self._lm_head(hidden[:, -1]).float()
        self.decode_forwards += 1
        self._sample_and_advance(seqs, logits)

    def _sample_and_advance(self, seqs: list[_Sequence], logits: torch.Tensor) -> None:
        tokens, logprobs = self._sample(seqs, logits)
        finished: list[_Sequence] = []
        reasons: dict[str, tuple[FinishReason, int | None, str | None]] = {}
        version = self._weight_version
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            if token in seq.stop_ids:
                reasons[seq.request_id] = ("stop", token, None)
            elif (
                len(seq.output_ids) >= seq.params.max_new_tokens
                or seq.num_tokens >= self.max_seq_len
            ):
                reasons[seq.request_id] = ("length", None, None)
            else:
                continue
            finished.append(seq)
        self.generated_tokens += len(seqs)
        if finished:
            self._release(finished, reasons)

    def _sample(self, seqs: list[_Sequence], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Draw one token per row; see the module docstring for the logprob convention."""
        device = logits.device
        temps = [s.params.temperature for s in seqs]
        greedy = torch.tensor([t == 0.0 for t in temps], device=device)
        temperature = torch.tensor([t if t > 0.0 else 1.0 for t in temps], device=device)
        logp = torch.log_softmax(logits / temperature[:, None], dim=-1)
        probs = logp.exp()
        if any(s.params.top_p < 1.0 or s.params.top_k_active for s in seqs):
            vocab = logits.shape[-1]
            top_k = torch.tensor(
                [s.params.top_k if s.params.top_k_active else vocab for s in seqs], device=device
            )
            top_p = torch.tensor([s.params.top_p for s in seqs], device=device)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=device)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            keep = (ranks[None, :] < top_k[:, None]) & (mass_before < top_p[:, None])
            keep[:, 0] = True
            # Scatter back to vocabulary order so rows without a filter sample
            # exactly as they would in a batch where no row sorts.
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
        uniforms = counter_uniforms([s.seed for s in seqs], [len(s.output_ids) for s in seqs])
        cdf = probs.double().cumsum(dim=-1)
        targets = torch.as_tensor(uniforms, device=device)[:, None] * cdf[:, -1:]
        sampled = torch.searchsorted(cdf, targets, right=True).clamp_(max=probs.shape[-1] - 1)
        # Guard against landing on a zero-probability token through rounding at the top end.
        last_nonzero = (probs > 0).long().cumsum(dim=-1).argmax(dim=-1, keepdim=True)
        sampled = torch.where(probs.gather(1, sampled) > 0, sampled, last_nonzero)
        chosen = torch.where(greedy[:, None], logits.argmax(dim=-1, keepdim=True), sampled)
        chosen_logp = logp.gather(1, chosen)
        return chosen[:, 0].tolist(), chosen_logp[:, 0].tolist()

    def _release(
        self,
        seqs: list[_Sequence],
        reasons: dict[str, tuple[FinishReason, int | None, str | None]],
    ) -> None:
        """Finish resident sequences and close the gaps, keeping the others in slot order.

        Slot order is admission order, so the K/V lengths of slots ``[0, b)`` fall
        from first to last (new sequences are admitted behind the old ones, and a
        decode step lengthens every row by one); the decode attention buckets rows by
        that order (``decode_buckets``). Each survivor behind a gap moves up once.
        """
        leaving = {id(s) for s in seqs}
        survivors: list[_Sequence] = []
        run: list[int] = []  # consecutive survivors that move up by the same gap

        def flush() -> None:
            if run:
                # A resident sequence's KV covers all its tokens but the newest; the
                # run's first row is its longest (slot order).
                length = max(self._running[slot].num_tokens for slot in run) - 1
                self._cache.shift(run[0], run[0] - gap, len(run), length)
                run.clear()

        gap = 0
        for slot, seq in enumerate(self._running):
            if id(seq) in leaving:
                flush()
                gap += 1
                continue
            if gap:
                run.append(slot)
            survivors.append(seq)
        flush()
        self._running[:] = survivors
        for seq in seqs:
            reason, matched, message = reasons[seq.request_id]
            self._finish(seq, reason, matched_stop_token_id=matched, abort_message=message)

    def _finish(
        self,
        seq: _Sequence,
        reason: FinishReason,
        *,
        matched_stop_token_id: int | None = None,
        abort_message: str | None = None,
    ) -> None:
        self._in_flight.pop(seq.request_id, None)
        output = GenerationOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt,
            output_token_ids=list(seq.output_ids),
            behaviour_logprobs=list(seq.logprobs),
            token_versions=list(seq.versions),
            finish_reason=reason,
            matched_stop_token_id=matched_stop_token_id,
            abort_message=abort_message,
            admitted_step=seq.admitted_step,
            finished_step=self.step_count,
            e2e_latency_s=time.perf_counter() - seq.submitted_at,
        )
        if not seq.future.done():
            seq.future.set_result(output)
