"""The `rollout` section: sampling, group size, the embedded engine's slots and how the
rollout role follows new policy versions."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sluice.engines.inference.types import PauseMode
from sluice.infra.config.section import Section


class RolloutConfig(Section):
    """Generation: sampling, group size, inference servers, weight reloads."""

    group_size: int = Field(8, ge=1, le=1024)
    """Responses sampled per prompt (G in GRPO)."""
    max_new_tokens: int = Field(256, ge=1)
    """Longest response, in tokens; longer ones end with finish_reason=length."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer recomputes log-probs at the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling (-1 = off)."""
    server_urls: list[str] = []
    """SGLang-compatible servers. Empty starts the embedded inference server in the rollout process."""
    max_batch_size: int = Field(64, ge=1)
    """Concurrent sequences in the embedded engine (continuous-batching slots)."""
    max_seq_len: int | None = Field(None, ge=2)
    """Prompt + response tokens each slot of Sluice's engine holds (its KV cache is `max_batch_size`
    x this); a longer prompt is passed over for the group's next draw. None: the model's positions,
    at most 2048. Size it to the longest prompt plus `max_new_tokens`: at 2048 x 64 slots, a 135M
    model's float32 KV cache alone is ~6 GB."""
    interruptible: bool = True
    """Pause in-flight generation for a weight update and recompute KV (True), or drain it first (False)."""
    pause_mode: PauseMode = PauseMode.RETRACT
    """How in-flight requests are held during a weight update when interruptible."""
    poll_interval_s: float = Field(0.5, gt=0)
    """How often the rollout role polls the registry alias for a newer committed version (and, at start, for the first one)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the inference engine wherever the policy generates: the embedded server, the
    sync baseline's engine and evaluation. The trainer keeps float32 weights and optimizer state;
    the decoupled loss corrects the difference (its behaviour log-probs come from this dtype).
    float32 on CPU."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Deadline of one generate request."""
    weight_noise_std: float = Field(0.0, ge=0, le=10)
    """Relative std of Gaussian noise added to every weight the embedded inference engine loads (w +
    σ·std(w)·N(0,1), seeded by run seed and policy version), to inject train–inference mismatch on
    purpose; the trainer and the evaluator keep clean weights. 0 = off (`sluice bench mismatch` sets
    it)."""

    @model_validator(mode="after")
    def _room_to_generate(self) -> RolloutConfig:
        if self.max_seq_len is not None and self.max_seq_len <= self.max_new_tokens:
            raise ValueError(
                f"rollout.max_seq_len ({self.max_seq_len}) must exceed rollout.max_new_tokens "
                f"({self.max_new_tokens}): a slot holds the prompt and the response"
            )
        return self
