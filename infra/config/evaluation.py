"""The `evaluation` section: held-out evaluation during a run (the evaluate role) and
after it (`sluice eval`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from sluice.infra.config.section import Section


class EvaluationConfig(Section):
    """Held-out evaluation: during a run (the evaluate role) and after it (`sluice eval`)."""

    dataset: str | None = None
    """Held-out rows in the format of `problem.dataset`; None = a held-out split of the built-in task."""
    num_prompts: int = Field(64, ge=1)
    """Held-out prompts per evaluation."""
    samples: int = Field(1, ge=1)
    """Samples per held-out prompt at `temperature`; the held-out reward (`eval/reward`) and pass@1 are averaged over them."""
    pass_at_k: list[int] = [1]
    """k of the pass@k reported as `eval/pass_at_{k}`: the chance that at least one of k samples is
    correct, estimated without bias from all `samples` of each prompt (Chen et al. 2021); every k
    needs `samples >= k`, e.g. `[1, 5]` with `samples: 10`."""
    temperature: float | None = Field(None, ge=0)
    """Temperature of the held-out samples. None = the rollout temperature, so `eval/reward` is the
    RL objective (expected reward of the policy being trained) on unseen prompts; 0 = greedy
    decoding."""
    greedy: bool = True
    """Also decode every held-out prompt greedily and log `eval/greedy_accuracy` (one more decoding pass per evaluation; ignored when `temperature` is 0)."""
    every: int = Field(5, ge=0)
    """The evaluate role scores version 0, every N-th version and the final one (0 = version 0 and the final one)."""
    during_run: bool = True
    """Run the evaluate role beside training. False leaves every core to the compared roles; committed versions are evaluated afterwards (`sluice eval`, `sluice bench time-to-target`)."""
    poll_interval_s: float = Field(1.0, gt=0)
    """How often the evaluate role polls the registry for a version to score."""

    @model_validator(mode="after")
    def _pass_at_k_samples(self) -> EvaluationConfig:
        if any(not 1 <= k <= self.samples for k in self.pass_at_k):
            raise ValueError(f"pass_at_k {self.pass_at_k} needs k in 1..samples={self.samples}")
        return self
