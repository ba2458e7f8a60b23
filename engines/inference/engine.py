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

This module loads the model and applies weight updates. The rest of the package:
``scheduler`` holds the request lifecycle (queues, futures, pause, abort, the
scheduler thread), ``batch`` runs a step's compute, ``sampling`` states the
logprob convention the trainer relies on, ``weights`` reads checkpoints and
injects the mismatch used by studies, ``types`` holds what goes in and out.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sluice.engines.inference.batch import SlotBatch
from sluice.engines.inference.loading import (
    check_attention_is_full,
    eos_token_ids,
    load_causal_lm,
    resolve_dtype,
)
from sluice.engines.inference.scheduler import Scheduler
from sluice.engines.inference.types import WeightLoadError, WeightUpdateReport
from sluice.engines.inference.weight_specs import check_specs
from sluice.engines.inference.weights import (
    check_model_type,
    match_state_dict,
    perturb_weights,
    read_weight_files,
)
from sluice.engines.policy.adapter import (
    AdapterError,
    is_adapter_dir,
    merged_weights,
    read_adapter,
)

log = logging.getLogger(__name__)


class InferenceEngine(Scheduler):
    """Continuous-batching generator over a local Hugging Face causal LM.

    A ``Scheduler`` (submit, result, generate, abort, pause, step, start, shutdown)
    over the model loaded from ``model_dir``, plus weight updates from disk.
    Thread-safe: ``update_weights_from_disk`` too may be called from any thread.
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
            prompt_cache_size: prefilled prompts kept for reuse (see
                ``prompt_cache.PromptCache``); default ``max_batch_size``, 0 turns the
                cache off. Whatever the count, the cache holds at most a quarter of the
                KV cache's bytes.
            fast_forward: run Llama-shaped models through ``sluice.engines.inference.decoder``
                (same arithmetic, fewer calls); False, or any other model type, runs
                the Hugging Face decoder.
        """
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
        self.dtype = resolve_dtype(dtype)
        self.model: Any = load_causal_lm(self.model_dir, self.dtype).to(self.device).eval()
        config = self.model.config
        self.model_type = str(getattr(config, "model_type", ""))
        max_positions = int(getattr(config, "max_position_embeddings", 2048) or 2048)
        max_seq_len = int(max_seq_len) if max_seq_len is not None else min(max_positions, 2048)
        if not 2 <= max_seq_len <= max_positions:
            raise ValueError(
                f"max_seq_len must be in [2, max_position_embeddings={max_positions}], "
                f"got {max_seq_len}"
            )
        check_attention_is_full(config, max_seq_len)
        self.max_prefill_tokens = max_prefill_tokens
        batch = SlotBatch(
            self.model,
            device=self.device,
            dtype=self.dtype,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            max_prefill_tokens=max_prefill_tokens,
            prompt_cache_size=prompt_cache_size,
            fast_forward=fast_forward,
        )
        if fast_forward and batch.fast is None:
            log.info(
                "%s (model_type %r) has no fast forward in sluice.engines.inference.decoder; "
                "the engine runs the Hugging Face decoder",
                type(self.model).__name__,
                self.model_type,
            )
        super().__init__(
            batch,
            vocab_size=int(config.vocab_size),
            max_seq_len=max_seq_len,
            max_batch_size=max_batch_size,
            eos_token_ids=eos_token_ids(self.model),
            seed=seed,
            weight_version=weight_version,
        )
        self._update_lock = threading.Lock()
        self._base_path = self.model_dir
        """The last full checkpoint loaded: the base an adapter update applies to."""
        self._adapter_base: dict[str, torch.Tensor] | None = None
        self._staged: dict[str, torch.Tensor] = {}
        self._staged_version: int | None = None
        """Tensors of a version arriving in parts (``update_weights_from_tensors``)."""
        self.weight_noise_std = float(weight_noise_std)
        self._noise_seed = int(seed)
        if self.weight_noise_std:
            # from_pretrained loaded clean weights; overwrite them exactly as an update
            # would, so version 0 is perturbed like every later version.
            tensors = read_weight_files(self.model_dir)
            targets = match_state_dict(self.model.state_dict(), tensors, self.model_dir)
            with torch.no_grad():
                for name, tensor in self._perturb(tensors, self._weight_version).items():
                    targets[name].copy_(tensor)

    def update_weights_from_disk(
        self,
        model_path: str | Path,
        weight_version: int,
        *,
        drain: bool = False,
        abort_all_requests: bool = False,
    ) -> WeightUpdateReport:
        """Load new weights (same architecture) from a Hugging Face directory, or fold a
        LoRA adapter directory (PEFT's format) into the base weights.

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
            # Reading from disk (and folding an adapter) happens while generation goes on.
            adapter = is_adapter_dir(model_path)
            if adapter:
                tensors = self._perturb(self._merge_adapter(model_path), weight_version)
                targets = self.model.state_dict()
            else:
                tensors = self._perturb(read_weight_files(model_path), weight_version)
                check_model_type(model_path, self.model_type)
                targets = match_state_dict(self.model.state_dict(), tensors, model_path)
            read_s = time.perf_counter() - t0
            return self._apply(
                tensors, targets, weight_version, read_s,
                drain=drain, abort_all_requests=abort_all_requests,
                new_base=None if adapter else str(model_path),
            )  # fmt: skip

    def _apply(
        self,
        tensors: dict[str, torch.Tensor],
        targets: dict[str, torch.Tensor],
        weight_version: int,
        read_s: float,
        *,
        drain: bool,
        abort_all_requests: bool,
        new_base: str | None,
    ) -> WeightUpdateReport:
        """Copy ``tensors`` into the served weights between two decode steps (caller holds
        ``_update_lock``). ``new_base``: the directory of the full checkpoint they are, ""
        for full weights sent from another process, None for an adapter folded into the
        base."""
        drain_wait_s = 0.0
        if drain:
            t1 = time.perf_counter()
            self._drain()
            drain_wait_s = time.perf_counter() - t1
        with self._control():
            t2 = time.perf_counter()
            aborted = (
                self._abort_all_locked("aborted for a weight update") if abort_all_requests else 0
            )
            self._retract_all_locked()
            # Retracted sequences (now or by an earlier retract pause) all
            # have output tokens: their KV is rebuilt under the new weights.
            recomputed = sum(1 for s in self._waiting if s.output_token_ids)
            with torch.no_grad():
                for name, tensor in tensors.items():
                    targets[name].copy_(tensor)
            self._batch.prompts.clear()
            if new_base is not None:  # a new base: the next adapter applies to these weights
                self._adapter_base = None
                self._base_path = new_base or self._base_path
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

    def update_weights_from_tensors(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        weight_version: int,
        *,
        abort_all_requests: bool = False,
        source: str = "tensors",
    ) -> WeightUpdateReport | None:
        """Stage tensors of policy version ``weight_version`` sent by another process (a
        process group or shared memory); once every served tensor of that version has
        arrived, swap them in as ``update_weights_from_disk`` does (interruptible, one
        atomic step). Returns the report when applied, None while the version is still
        partial. The tensors are held until then and must be this process's own memory
        (a process group's receive buffers, or copies read from the sender's shared
        memory: ``tensor_handles``), never a mapping of another process's: a sender that
        truncates a mapped segment before the swap would kill this process (SIGBUS). A
        call for another version drops what was staged before. Raises WeightLoadError
        (served weights untouched) for no tensors at all, a tensor the model does not
        have, or one of the wrong shape.
        """
        if isinstance(weight_version, bool) or not isinstance(weight_version, int):
            raise ValueError(f"weight_version must be an integer, got {weight_version!r}")
        if not named_tensors:
            raise WeightLoadError(
                f"weights sent from {source}: an update needs at least one tensor"
            )
        with self._update_lock:
            t0 = time.perf_counter()
            current = self.model.state_dict()
            unknown = sorted(n for n, _ in named_tensors if n not in current)
            wrong = [
                f"{n} {tuple(t.shape)} != {tuple(current[n].shape)}"
                for n, t in named_tensors
                if n in current and t.shape != current[n].shape
            ]
            if unknown or wrong:
                problems = [f"unexpected tensors {unknown[:5]}"] if unknown else []
                problems += [f"shape mismatches {wrong[:5]}"] if wrong else []
                raise WeightLoadError(
                    f"weights sent from {source} do not fit the served architecture: "
                    + "; ".join(problems)
                )
            if self._staged_version != weight_version:
                self._staged, self._staged_version = {}, weight_version
            for name, tensor in named_tensors:
                # Held, not copied again: the caller hands over memory of its own.
                self._staged[name] = tensor.to(self.device, self.dtype)
            covered = {current[n].data_ptr() for n in self._staged}
            if any(t.data_ptr() not in covered for t in current.values()):
                return None
            tensors = self._perturb(self._staged, weight_version)
            self._staged, self._staged_version = {}, None
            read_s = time.perf_counter() - t0
            return self._apply(
                tensors, current, weight_version, read_s,
                drain=False, abort_all_requests=abort_all_requests, new_base="",
            )  # fmt: skip

    def check_tensor_specs(
        self, specs: Sequence[tuple[str, str, tuple[int, ...]]], declared_bytes: int
    ) -> None:
        """SpecMismatch unless tensors ``specs`` names fit the served model
        (``weight_specs``): called before a buffer is allocated or memory is read."""
        check_specs(specs, declared_bytes, self.model.state_dict())

    @property
    def staged_tensors(self) -> int:
        """Tensors received for a version not yet swapped in (a transfer under way)."""
        return len(self._staged)

    def load_adapter(self, adapter_dir: str | Path, weight_version: int) -> WeightUpdateReport:
        """`update_weights_from_disk` for a LoRA adapter directory only (SGLang's
        ``/load_lora_adapter``); WeightLoadError for anything else."""
        if not is_adapter_dir(adapter_dir):
            raise WeightLoadError(
                f"{str(adapter_dir)!r} holds no LoRA adapter (no adapter_config.json)"
            )
        return self.update_weights_from_disk(adapter_dir, weight_version)

    def _merge_adapter(self, adapter_dir: str | Path) -> dict[str, torch.Tensor]:
        """The weights a LoRA adapter changes, folded into the base (W + alpha/r · B A).

        The base is the last full checkpoint loaded; the weights an adapter touches are
        kept as they were then (a copy on the model's device, as large as the adapted
        layers), so every adapter is applied to the base exactly, however many came
        before it. With injected noise the copy is read clean from the base's files."""
        try:
            adapter = read_adapter(adapter_dir)
            if self._adapter_base is None or not set(adapter.factors) <= set(self._adapter_base):
                source = (
                    read_weight_files(self._base_path)
                    if self.weight_noise_std
                    else self.model.state_dict()
                )
                self._adapter_base = {
                    name: source[name].detach().to(self.device, copy=True)
                    for name in adapter.factors
                    if name in source
                }
            merged = merged_weights(self._adapter_base, adapter, adapter_dir)
        except AdapterError as exc:
            raise WeightLoadError(str(exc)) from exc
        return {name: tensor.to(self.dtype) for name, tensor in merged.items()}

    def _perturb(
        self, tensors: dict[str, torch.Tensor], weight_version: int
    ) -> dict[str, torch.Tensor]:
        return perturb_weights(
            tensors, self.weight_noise_std, seed=self._noise_seed, weight_version=weight_version
        )
