"""The trainer's section of the run configuration (`trainer:`): optimisation, the policy
loss, rollout correction and the advantage estimator, and the Megatron backend's
parallelism. Part of `sluice.infra.config.run.RunConfig`; validated with it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from sluice.infra.config.section import Section


class LossConfig(Section):
    """The policy objective (decoupled PPO, AReaL eq. 3, by default) and the terms added to it (docs/design.md §1.1)."""

    objective: Literal["decoupled_ppo", "gspo", "cispo"] = "decoupled_ppo"
    """`decoupled_ppo`: the clipped token ratio. `gspo`: the ratio of whole sequences (Zheng et al.
    2025; the paper's clips are ~3e-4/4e-4, so set eps_clip_low/high to match). `cispo`: the clipped
    ratio as a constant weight on every token's log-prob gradient, so no token's gradient is clipped
    away (MiniMax-M1). verl: `actor.policy_loss.loss_mode` (`vanilla`, `gspo`, `cispo`); TRL:
    `importance_sampling_level: sequence` for GSPO, `loss_type: cispo`."""
    proximal: Literal["exact", "loglinear"] = "exact"
    """How log pi_prox is had. Either way the first minibatch's own forward gives its tokens'
    exactly (the weights are pi_prox before the first optimizer step); with one minibatch (the
    default) no extra pass runs. `exact`: one no-grad pass over the other minibatches' samples.
    `loglinear`: none; interpolated between the behaviour and the current log-probs by policy
    version (docs/design.md §1.1), and the mismatch metrics and the watchdog then see the first
    minibatch's tokens only. AReaL: `prox_logp_method` (`recompute`, `loglinear`). Torch backend; no
    dropout with `loglinear`."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses become the minibatch's: the mean over all trained tokens (long responses
    weigh more), the mean over responses of each response's token mean (every response weighs the
    same), or the mean over responses of each one's token sum. verl: `actor.loss_agg_mode`; TRL:
    `loss_type` (`dapo`/`bnpo`, `grpo`, `dr_grpo`-like)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus: minus this times the aggregated token entropy of pi_theta is added to the loss (0 = off). verl: `actor.entropy_coeff`."""
    decoupled: bool = True
    """Use pi_prox as the trust-region anchor (True) or standard PPO with pi_old = pi_behav (False)."""
    eps_clip_low: float = Field(0.2, ge=0, le=1)
    """Lower clip of the ratio: 1 - eps_clip_low."""
    eps_clip_high: float = Field(0.2, ge=0, le=10)
    """Upper clip of the ratio: 1 + eps_clip_high (DAPO clip-higher when > eps_clip_low)."""
    dual_clip_c: float | None = Field(None, gt=1)
    """Dual-clip bound for negative advantages (None = off)."""


class KlConfig(Section):
    """A KL penalty to the reference policy (version 0: the base; under LoRA, the base with the adapters off, which costs no memory; else a frozen copy in the trainer)."""

    coef: float = Field(0.0, ge=0)
    """beta: weight of the penalty in the loss; 0 = off (no reference pass runs). verl: `actor.kl_loss_coef` with `actor.use_kl_loss`; TRL: `beta`; prime-rl: `kl_tau`."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator of KL(pi_theta || pi_ref) (Schulman 2020): k1 = log(pi_theta/pi_ref), k2
    = its square / 2, k3 = r - 1 - log r with r = pi_ref/pi_theta (unbiased, never negative; clamped
    to [-10, 10]). verl: `actor.kl_loss_type` (`kl`, `mse`, `low_var_kl`)."""
    in_reward: bool = False
    """Take the penalty from each response's reward instead of adding it to the loss: r - coef x
    (sum over its tokens of the estimate between the sampling policy's recorded log-probs and
    pi_ref), then the advantages again. verl: `algorithm.use_kl_in_reward` (with
    `algorithm.kl_ctrl.kl_coef`)."""


class CorrectionConfig(Section):
    """Rollout correction of the behaviour weight pi_prox / pi_behav."""

    mode: Literal[
        "none", "token_tis", "sequence_tis", "token_mis", "sequence_mis", "geometric_rs", "icepop"
    ] = "token_tis"
    """Truncate (TIS) or mask (MIS, RS) importance weights that train-inference mismatch blows up."""
    threshold: float = Field(2.0, gt=0)
    """C: cap (TIS) or rejection bound (MIS) of the weight."""
    geometric_lower: float = Field(0.999, gt=0)
    """Lower bound of exp(mean log-ratio) for geometric rejection."""
    geometric_upper: float = Field(1.001, gt=0)
    """Upper bound of exp(mean log-ratio) for geometric rejection."""
    icepop_lower: float = Field(0.5, gt=0, le=1)
    """`icepop`: a token whose weight pi_prox/pi_behav is below this is masked (its own token only,
    not its response). NeMo-RL's and AReaL's 0.5; verl: `rollout_rs: token_k1` with its lower
    threshold."""
    icepop_upper: float = Field(5.0, ge=1)
    """`icepop`: a token whose weight is above this is masked. NeMo-RL's and AReaL's 5.0 (SkyRL and slime suggest 2.0)."""


class AdvantageConfig(Section):
    """Group-relative advantages, broadcast to every response token."""

    mode: Literal["grpo", "drgrpo", "rloo", "batch"] = "grpo"
    """grpo: (r - mean) / std per group; drgrpo: no std; rloo: leave-one-out mean; batch: batch-level std."""
    eps: float = Field(1e-6, gt=0)
    """Added to the std to keep all-equal groups finite."""
    drop_zero_variance_groups: bool = False
    """Drop groups whose responses all got the same reward (they carry zero advantage)."""


class LoraConfig(Section):
    """Low-rank adapters (LoRA, through peft) instead of full fine-tuning; off at rank 0."""

    rank: int = Field(0, ge=0, le=4096)
    """r: the adapters' rank; 0 = full fine-tuning. Only the adapters train (every base weight is
    frozen and out of the optimizer); each version after 0 is published as the adapter alone, which
    the servers load through SGLang's LoRA API. Torch backend only."""
    alpha: int = Field(16, ge=1)
    """Scale of the adapters' update: W + (alpha / r) * B A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training."""
    target_modules: list[str] = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    """Names of the linear layers that get an adapter (the last part of their module name); a name the model lacks is refused naming the ones it has."""


WatchAction = Literal["warn", "skip", "stop"]


class WatchSignalConfig(Section):
    """How the mismatch watchdog judges one signal (docs/design.md, the watchdog)."""

    limit: float | None = None
    """Absolute bound: a step whose value passes it fires (above it; below it for `ess`), once `limit_steps` steps in a row have. None = no bound."""
    limit_steps: int = Field(1, ge=1)
    """Steps in a row (this one included, fired or not) whose value must pass `limit` before it fires: 1 judges every step alone; more lets a single healthy outlier pass."""
    spike: float | None = Field(None, gt=1)
    """Fires when the median of the last `watchdog.recent` steps is more than this many times the
    median of the `watchdog.window` steps before them (for `ess`: of 1 - ESS). None = judge by
    `limit` only."""
    floor: float = Field(0.0, ge=0)
    """`spike` fires only when that recent median is also above this (for `ess`: 1 - ESS above it), so a climb at a harmless scale stays quiet."""
    action: WatchAction | None = None
    """What a firing of this signal does; None = `watchdog.action`."""

    def rule_settings(self, default_action: WatchAction) -> dict[str, Any]:
        """Every setting of this signal, its action resolved (for `signal_rule`)."""
        return {**self.model_dump(), "action": self.action or default_action}


class WatchdogConfig(Section):
    """The train role's mismatch watchdog: judges every step's health signals before its update is
    applied, against fixed limits and the run's own recent history, and warns, leaves the batch out
    or stops the run."""

    enabled: bool = True
    """Judge every step (the metrics are computed either way)."""
    action: WatchAction = "warn"
    """What a firing does unless its signal says otherwise. `warn`: one log line, a Prefect event
    (`sluice.watchdog.fired`), an MLflow tag on the next version. `skip`: that too, and the batch is
    not applied (the version moves on with unchanged weights; its groups count as skipped). `stop`:
    the run stops, naming the signal and the last good version; `sluice train --resume` continues
    it. Torch backend: `skip` needs it (Megatron takes its optimizer step inside its own schedule)."""
    recent: int = Field(5, ge=1)
    """Steps whose median is judged for a spike (this one included): a climb that lasts, not one or two noisy steps."""
    window: int = Field(30, ge=2)
    """Steps before those whose median is the baseline."""
    min_history: int = Field(10, ge=1)
    """Baseline steps needed before `spike` is judged (`limit` is judged from the first step)."""
    kl_k3: WatchSignalConfig = WatchSignalConfig(limit=0.2, limit_steps=3, spike=8.0, floor=1e-3)
    """k3 estimate of KL(pi_behav || pi_prox) (`mismatch/kl_k3`). The limit catches a mismatch
    present from the first step, which no baseline of the run's own can; three steps in a row,
    because clean default runs had single steps up to 0.89 (medians about 0.01), while an engine
    serving weights with 50% relative noise gives about 2 on every step
    (docs/reports/2026-11-26-watchdog.md)."""
    log_ppl_gap: WatchSignalConfig = WatchSignalConfig(spike=5.0, floor=0.02)
    """|log PPL under the trainer - log PPL under the engine| (`mismatch/log_ppl_abs_diff`)."""
    grad_norm: WatchSignalConfig = WatchSignalConfig(spike=10.0, floor=1.0)
    """Pre-clip gradient norm of each optimizer step (`train/grad_norm`; the step's largest enters the history)."""
    ess: WatchSignalConfig = WatchSignalConfig(spike=6.0, floor=0.3)
    """Effective sample size of the sequence importance weights (`is/ess_sequence`, 1 = uniform); bad when it falls."""
    masked_fraction: WatchSignalConfig = WatchSignalConfig(limit=0.5)
    """Share of response tokens rollout correction masked out (`is/masked_fraction`; 0 unless a MIS or RS mode is on)."""

    def signals(self) -> dict[str, WatchSignalConfig]:
        return {
            "kl_k3": self.kl_k3,
            "log_ppl_gap": self.log_ppl_gap,
            "grad_norm": self.grad_norm,
            "ess": self.ess,
            "masked_fraction": self.masked_fraction,
        }

    def action_of(self, signal: str) -> WatchAction:
        return self.signals()[signal].action or self.action


class TrainerConfig(Section):
    """Optimisation."""

    background_save: bool = True
    """Write each published version's checkpoint (weights and optimizer state) on a background
    thread while the next step trains: the step pays one copy of them to host memory (three times
    the float32 weights, held until written) instead of the write. The version is committed, and
    served, only once written either way. False: write before the next step (no extra host memory).
    LoRA versions and the Megatron backend always write before."""
    backend: Literal["torch", "megatron"] = "torch"
    """Who trains the policy: `torch` (the Hugging Face model and torch AdamW) or `megatron` (a
    Megatron-core GPTModel converted from the same HF weights, Megatron's DDP, Adam and
    forward-backward schedule; Llama and Qwen2 shapes). Same loss, micro-batching, streams and
    registry; every version is published as an HF directory either way. Megatron can split the
    trainer over `tensor_parallel × pipeline_parallel × data_parallel` processes."""
    tensor_parallel: int = Field(1, ge=1)
    """Tensor-parallel size of the Megatron backend: each rank holds a slice of every layer (so it
    must divide the key/value heads and the MLP width). Splits each layer's compute and memory;
    needs the fastest links (one node). Needs `backend: megatron`."""
    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline-parallel size of the Megatron backend: each stage holds consecutive layers (so it
    must divide the layer count). Splits memory with little communication, at the price of the
    pipeline bubble: each replica gets at least this many micro-batches per minibatch. Needs
    `backend: megatron`."""
    data_parallel: int = Field(1, ge=1)
    """Data-parallel replicas of the Megatron backend: each takes every k-th micro-batch of a
    minibatch and gradients are summed, so the update is the same. Splits compute, not memory; each
    replica gets at least one micro-batch. Needs `backend: megatron`."""
    distributed_optimizer: bool = False
    """Megatron backend: shard the fp32 main weights and Adam state across the `data_parallel`
    replicas (Megatron's distributed optimizer, ZeRO-1): optimizer memory per replica falls about
    `data_parallel`-fold, at a reduce-scatter and an all-gather per step instead of one all-reduce.
    No effect on the update."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training precision. `bfloat16` (Megatron backend): the model, activations and gradients in
    bf16, with fp32 main weights and Adam state in Megatron's mixed-precision optimizer. Versions
    are still published as float32 HF directories (the bf16 weights and float32 norms, exactly); the
    inference engine casts them to `rollout.dtype`. The torch backend trains in float32."""
    prompts_per_batch: int = Field(8, ge=1)
    """B: prompt groups per training step."""
    ppo_minibatches: int = Field(1, ge=1)
    """Optimizer steps per training batch (PPO minibatches)."""
    total_steps: int = Field(40, ge=1)
    """Training steps (policy versions) in the run."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each training batch, each split into `ppo_minibatches` afresh: epochs x minibatches optimizer steps per policy version. verl: `actor.ppo_epochs`; TRL: `num_iterations`."""
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate (its peak, with a schedule)."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Policy versions of linear warm-up to `lr`. verl: `optim.lr_warmup_steps`; TRL: `warmup_steps`."""
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: stay at `lr`, or fall linearly or along a cosine to `lr x lr_min_ratio` at `total_steps`. verl: `optim.warmup_style` / `lr_scheduler_type`; TRL: `lr_scheduler_type`."""
    lr_min_ratio: float = Field(0.0, ge=0, le=1)
    """Where `linear` and `cosine` decay end, as a share of `lr`. verl: `optim.min_lr_ratio`."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    adam_eps: float = Field(1e-5, gt=0)
    """AdamW epsilon."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    max_tokens_per_micro_batch: int = Field(8192, ge=16)
    """Token budget of one packed micro-batch (dynamic micro-batching)."""
    min_micro_batches: int = Field(1, ge=1)
    """Lower bound on micro-batches per minibatch."""
    shared_prompt: bool = False
    """Run each prompt once per micro-batch with its group's responses on top (each response attends
    to the prompt and its own tokens), instead of once per response: a group costs P + G x R tokens
    instead of G x (P + R), with the same loss and gradient up to the order of float sums.
    Micro-batches then keep a group together (cut where it exceeds `max_tokens_per_micro_batch`).
    Worth most where prompts are long beside responses. Torch backend only. No verl/TRL key; AReaL
    and verl pack one sequence per response."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling with refill: the rollout keeps generating past groups whose rewards
    are all equal (they carry no gradient) so that every batch still holds B groups that do; those
    are dropped, and their count per batch is the cost (`dynamic_sampling/extra_groups`). The
    staleness bound holds for every sample (docs/design.md). Off: such groups stay in their batch
    with zero advantage, or shrink it with `advantage.drop_zero_variance_groups`."""
    dynamic_sampling_max_draws: int = Field(10, ge=1)
    """Dynamic sampling: a batch that has drawn this many times B groups without finding B
    informative ones stops the run with one line (the task is too hard or too easy for the policy),
    instead of generating forever. DAPO's `max_num_gen_batches`."""
    publish_every: int = Field(1, ge=1)
    """Commit a new policy version every K training steps."""
    time_budget_s: float | None = Field(None, gt=0)
    """Stop the run this many wall-clock seconds after the flow started (start-up included): the
    step in progress then finishes, and no further one starts, even on a batch already complete;
    None = run `total_steps`."""
    loss: LossConfig = LossConfig()
    """Policy loss."""
    kl: KlConfig = KlConfig()
    """KL penalty to the reference policy (off by default)."""
    correction: CorrectionConfig = CorrectionConfig()
    """Rollout correction of the behaviour importance weight."""
    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage estimator."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters instead of full fine-tuning (`rank` > 0)."""
    watchdog: WatchdogConfig = WatchdogConfig()
    """The mismatch watchdog (warns by default)."""

    @property
    def world_size(self) -> int:
        """Trainer processes: the train role is rank 0 and starts the others on its machine."""
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    @model_validator(mode="after")
    def _megatron_only_settings(self) -> TrainerConfig:
        sizes = {
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "data_parallel": self.data_parallel,
        }
        asked = [f"{name}={size}" for name, size in sizes.items() if size > 1]
        asked += ["distributed_optimizer=true"] if self.distributed_optimizer else []
        asked += [f"dtype={self.dtype}"] if self.dtype != "float32" else []
        if self.lora.rank and self.backend != "torch":
            raise ValueError(
                "trainer.lora trains adapters with the torch backend only; set "
                "trainer.backend=torch or trainer.lora.rank=0"
            )
        if self.shared_prompt and self.backend != "torch":
            raise ValueError(
                f"trainer.shared_prompt needs trainer.backend=torch (the {self.backend} "
                "backend's attention has no mask for a prompt shared by several responses)"
            )
        if self.backend != "torch":
            torch_only = {
                "trainer.loss.proximal=loglinear": self.loss.proximal == "loglinear",
                "trainer.kl.coef > 0": self.kl.coef > 0,
                "an lr schedule": self.lr_warmup_steps > 0 or self.lr_decay != "constant",
            }
            for setting, asked_for in torch_only.items():
                if asked_for:
                    raise ValueError(
                        f"{setting} needs trainer.backend=torch (the {self.backend} backend "
                        "takes its optimizer step inside its own schedule)"
                    )
        if self.lr_warmup_steps > self.total_steps:
            raise ValueError(
                f"trainer.lr_warmup_steps={self.lr_warmup_steps} is longer than the run "
                f"(trainer.total_steps={self.total_steps}): lower it or raise total_steps"
            )
        if self.loss.objective != "decoupled_ppo" and self.loss.dual_clip_c is not None:
            raise ValueError(
                f"trainer.loss.dual_clip_c bounds decoupled_ppo's token loss; "
                f"{self.loss.objective} has no such term: unset it"
            )
        if self.loss.proximal == "loglinear" and self.lora.rank and self.lora.dropout > 0:
            raise ValueError(
                "trainer.loss.proximal=loglinear needs trainer.lora.dropout=0: with dropout a "
                "training forward is not pi_prox, so nothing can be had from it"
            )
        skipping = [s for s in self.watchdog.signals() if self.watchdog.action_of(s) == "skip"]
        if skipping and self.watchdog.enabled and self.backend != "torch":
            raise ValueError(
                f"trainer.watchdog action skip ({', '.join(skipping)}) needs "
                "trainer.backend=torch (Megatron takes its optimizer step inside its own "
                "schedule); use warn or stop"
            )
        if asked and self.backend != "megatron":
            raise ValueError(
                f"{' and '.join(asked)} {'need' if len(asked) > 1 else 'needs'} backend=megatron "
                f"(the {self.backend} backend trains in float32, in one process)"
            )
        return self
