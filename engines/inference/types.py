"""What goes into and comes out of the inference engine: requests, sampling, outputs.

Plain dataclasses and enums with no torch import, so the HTTP server and client
(``infra/serving``) share this vocabulary without loading a model runtime.

Two result types exist on purpose and differ by where the response was produced:
``GenerationOutput`` here is what the engine returns in process (with its
scheduling record: admitted/finished step, latency, stop token);
``sluice.infra.serving.protocol.GenerateResponse`` is a ``/generate`` answer decoded by the
client from any SGLang-compatible server (with the server's URL and text, and none
of the engine's internals).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import inf
from typing import Literal

from sluice.engines.trajectory import version_bounds

FinishReason = Literal["stop", "length", "abort"]
"""Why a response ended: a stop/EOS token, a token budget, or an abort."""

GREEDY_BELOW = 1e-5
"""A temperature below this decodes greedily (``sampling``): dividing logits by less
overflows float32 into NaN logprobs."""
TOP_K_OFF = 1 << 30
"""top_k values at or above this are "off" (SGLang's default is ``1 << 30``)."""


class WeightLoadError(ValueError):
    """A weight directory could not be loaded; the engine keeps its old weights."""


class EngineShutdownError(RuntimeError):
    """The engine was shut down before the request finished."""


class PauseMode(enum.StrEnum):
    """How a pause treats in-flight requests (SGLang ``/pause_generation`` modes).

    The one definition of the pause vocabulary: the engine, and through
    ``sluice.infra.serving.protocol`` the HTTP server and client, read it from here.
    """

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
    """Softmax temperature; 0 (or anything below ``GREEDY_BELOW``) means greedy decoding."""
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
        if not isinstance(self.temperature, int | float) or not 0.0 <= self.temperature < inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
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
        return 0 < self.top_k < TOP_K_OFF


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
    """A finished (or aborted) response as the engine returns it in process, token-aligned.

    Not the type a client reads off the wire: see the module docstring.
    """

    request_id: str
    """Id the request was submitted under."""
    prompt_token_ids: tuple[int, ...]
    """The prompt as submitted."""
    output_token_ids: list[int]
    """Generated tokens, including a final stop/EOS token if one ended the response."""
    behaviour_logprobs: list[float]
    """log_softmax(logits / temperature) of each generated token (see ``sampling``)."""
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
        bounds = version_bounds(self.token_versions)
        return None if bounds is None else bounds[0]

    @property
    def version_end(self) -> int | None:
        bounds = version_bounds(self.token_versions)
        return None if bounds is None else bounds[1]


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
