"""Names TRL and verl give Sluice's knobs, as `--set` overrides: accepted with one line
saying which Sluice key each set, or refused with one line saying how Sluice's meaning
differs and what to set instead.

Practitioners arrive typing `learning_rate=1e-6` (TRL) or
`actor_rollout_ref.actor.optim.lr=1e-6` (verl). A name is mapped only where a run under
it does what it does in its own framework (checked against TRL's `GRPOConfig` and
`GRPOTrainer.compute_loss`, verl's actor config and `agg_loss`/`kl_penalty`); where the
meaning differs (verl's `ppo_mini_batch_size` is a size, Sluice's `ppo_minibatches` a
count) it is refused, naming the conversion. docs/configuration.md ("Names from TRL and
verl") has the table.

Departures, on purpose:

- Only overrides are translated. In a config file a peer name stays an unknown key
  (whose error names the Sluice key), so a file says each thing one way, as Sluice's own
  renamed keys (`RENAMED_KEYS`) are errors rather than aliases.
- The notice goes to stderr once per name per process: `load_config` runs twice for a
  resumed run, and its callers cannot be asked to print what it returns.
- A value is validated against the Sluice field as it is translated, so a bad one fails
  in one line naming both names; the cross-field rules run later with the whole config.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ValidationError, create_model

TRL, VERL, BOTH = "TRL's", "verl's", "TRL's and verl's"

_LOW, _HIGH = "trainer.loss.eps_clip_low", "trainer.loss.eps_clip_high"
_KL_COEF = "trainer.kl.coef"
_VERL_KL_COEF = 0.001
"""verl's default `actor.kl_loss_coef`, used when `use_kl_loss=true` comes without one."""

_SAME_SCALE = (
    "the same direction at another scale, which trainer.grad_clip and trainer.adam_eps feel"
)
_STRAIGHT_THROUGH = (
    "takes k2's gradient under another estimate's value (straight-through); Sluice's "
    "estimators take their own gradient: use kl, mse or low_var_kl"
)


class PeerNameError(ValueError):
    """A peer name Sluice refuses, or a value its Sluice key rejects: one line."""


@dataclass(frozen=True)
class PeerName:
    """What Sluice does with one name that TRL or verl gives a knob."""

    origin: str
    """Whose name it is, possessive: "TRL's", "verl's", or both."""
    target: str = ""
    """The Sluice key it sets (the lower clip, for `both_clips`); empty: refused."""
    refusal: str = ""
    """For a refused name: how its meaning differs and what to set instead, a clause
    that follows "{origin} {name}"."""
    values: Mapping[str, str] | None = None
    """Its values and their Sluice spelling, when the two differ; any other value is
    refused (with `refused_values`' reason, else `other_values`). None: values pass."""
    refused_values: Mapping[str, str] = field(default_factory=dict)
    """Values that mean something Sluice does not do, and why (a clause)."""
    other_values: str = ""
    """Why a value in neither `values` nor `refused_values` is refused."""
    note: str = ""
    """Said after the value in the notice: where the units line up."""
    kind: Literal["set", "both_clips", "kl_switch"] = "set"
    """`both_clips`: TRL's `epsilon` and verl's `clip_ratio`, which set the upper clip
    too unless it is set; `kl_switch`: verl's `use_kl_loss` (Sluice's KL is on at coef > 0)."""


_STEPS = "Sluice counts batches of prompts: TRL's optimizer steps are the same at num_iterations=1"
_EPOCHS = (
    "counts passes over a dataset; Sluice draws prompts without epochs and counts steps: "
    "set trainer.total_steps = epochs x dataset prompts / trainer.prompts_per_batch"
)
_MICRO = (
    "counts sequences per forward pass; Sluice packs micro-batches by tokens: set "
    "trainer.max_tokens_per_micro_batch (verl's ppo_max_token_len_per_gpu)"
)
_TOKENS = (
    "Sluice packs micro-batches by tokens (trainer.max_tokens_per_micro_batch) and an "
    "optimizer step always takes a whole minibatch (trainer.prompts_per_batch / "
    "trainer.ppo_minibatches prompt groups)"
)

PEER_NAMES: dict[str, PeerName] = {
    # optimizer
    "learning_rate": PeerName(TRL, "trainer.lr"),
    "lr": PeerName(VERL, "trainer.lr"),
    "weight_decay": PeerName(BOTH, "trainer.weight_decay"),
    "max_grad_norm": PeerName(TRL, "trainer.grad_clip"),
    "grad_clip": PeerName(VERL, "trainer.grad_clip"),
    "warmup_steps": PeerName(TRL, "trainer.lr_warmup_steps", note=_STEPS),
    "lr_warmup_steps": PeerName(
        VERL,
        "trainer.lr_warmup_steps",
        refused_values={
            "-1": "defers to lr_warmup_steps_ratio; Sluice counts warm-up in steps: "
            "give a count (0 = none)"
        },
    ),
    "warmup_ratio": PeerName(
        TRL,
        refusal="is a share of the run; Sluice counts warm-up in steps: set "
        "trainer.lr_warmup_steps = warmup_ratio x trainer.total_steps",
    ),
    "lr_warmup_steps_ratio": PeerName(
        VERL,
        refusal="is a share of the run; Sluice counts warm-up in steps: set "
        "trainer.lr_warmup_steps = lr_warmup_steps_ratio x trainer.total_steps",
    ),
    "lr_scheduler_type": PeerName(
        BOTH,
        "trainer.lr_decay",
        values={
            "constant": "constant",
            "constant_with_warmup": "constant",
            "linear": "linear",
            "cosine": "cosine",
        },
        refused_values={
            "cosine_with_min_lr": "is Sluice's cosine with a floor: set "
            "lr_scheduler_type=cosine and trainer.lr_min_ratio (TRL's min_lr_rate)"
        },
        other_values="Sluice's trainer.lr_decay has constant, linear and cosine "
        "(TRL's constant_with_warmup is constant)",
        note="after trainer.lr_warmup_steps of linear warm-up",
    ),
    "warmup_style": PeerName(
        VERL,
        "trainer.lr_decay",
        values={"constant": "constant", "cosine": "cosine"},
        other_values="Sluice's trainer.lr_decay has constant, linear and cosine",
    ),
    "min_lr_ratio": PeerName(VERL, "trainer.lr_min_ratio"),
    # batch and run length
    "train_batch_size": PeerName(VERL, "trainer.prompts_per_batch"),
    "max_steps": PeerName(TRL, "trainer.total_steps", note=_STEPS),
    "total_training_steps": PeerName(VERL, "trainer.total_steps"),
    "num_train_epochs": PeerName(
        TRL,
        refusal=_EPOCHS,
    ),
    "total_epochs": PeerName(
        VERL,
        refusal=_EPOCHS,
    ),
    "ppo_mini_batch_size": PeerName(
        VERL,
        refusal="is a size (prompts per optimizer step), Sluice's trainer.ppo_minibatches "
        "a count (optimizer steps per batch): set trainer.ppo_minibatches = "
        "train_batch_size / ppo_mini_batch_size",
    ),
    "ppo_micro_batch_size": PeerName(
        VERL,
        refusal=_MICRO,
    ),
    "ppo_micro_batch_size_per_gpu": PeerName(
        VERL,
        refusal=_MICRO,
    ),
    "ppo_max_token_len_per_gpu": PeerName(VERL, "trainer.max_tokens_per_micro_batch"),
    "gradient_accumulation_steps": PeerName(
        TRL, refusal=f"counts micro-batches per optimizer step; {_TOKENS}: drop it"
    ),
    "per_device_train_batch_size": PeerName(
        TRL,
        refusal="counts completions per device per forward pass; Sluice sizes a step in "
        "prompts (trainer.prompts_per_batch groups of rollout.group_size) and packs "
        "micro-batches by tokens (trainer.max_tokens_per_micro_batch): set "
        "trainer.prompts_per_batch = per_device_train_batch_size x processes x "
        "steps_per_generation / num_generations",
    ),
    "generation_batch_size": PeerName(
        TRL,
        refusal="counts completions, Sluice's trainer.prompts_per_batch prompts: set "
        "trainer.prompts_per_batch = generation_batch_size / num_generations",
    ),
    "steps_per_generation": PeerName(
        TRL,
        refusal="counts forward passes per generation, Sluice's trainer.ppo_minibatches "
        "optimizer steps per batch: set trainer.ppo_minibatches = steps_per_generation / "
        "gradient_accumulation_steps",
    ),
    "ppo_epochs": PeerName(VERL, "trainer.ppo_epochs"),
    "num_iterations": PeerName(TRL, "trainer.ppo_epochs"),
    # generation
    "num_generations": PeerName(TRL, "rollout.group_size"),
    "rollout.n": PeerName(VERL, "rollout.group_size"),
    "temperature": PeerName(BOTH, "rollout.temperature"),
    "max_completion_length": PeerName(TRL, "rollout.max_new_tokens"),
    "max_response_length": PeerName(VERL, "rollout.max_new_tokens"),
    "max_prompt_length": PeerName(
        BOTH,
        refusal="cuts prompts to a length; Sluice never cuts one: rollout.max_seq_len "
        "bounds prompt + response tokens of an engine slot and passes a longer prompt "
        "over, so set rollout.max_seq_len = max_prompt_length + rollout.max_new_tokens",
    ),
    # the policy loss
    "epsilon": PeerName(TRL, _LOW, kind="both_clips"),
    "clip_ratio": PeerName(VERL, _LOW, kind="both_clips"),
    "epsilon_high": PeerName(TRL, _HIGH),
    "clip_ratio_low": PeerName(VERL, _LOW),
    "clip_ratio_high": PeerName(VERL, _HIGH),
    "clip_ratio_c": PeerName(VERL, "trainer.loss.dual_clip_c"),
    "entropy_coeff": PeerName(VERL, "trainer.loss.entropy_coef"),
    "loss_agg_mode": PeerName(
        VERL,
        "trainer.loss.loss_agg_mode",
        refused_values={
            "seq-mean-token-sum-norm": "is seq-mean-token-sum divided by a constant length "
            "(Dr. GRPO's); Sluice's seq-mean-token-sum lacks that constant (" + _SAME_SCALE + ")"
        },
    ),
    "loss_type": PeerName(
        TRL,
        "trainer.loss.loss_agg_mode",
        values={"grpo": "seq-mean-token-mean", "dapo": "token-mean"},
        refused_values={
            "bnpo": "normalises by the tokens of each device's micro-batch, which Sluice's "
            "token packing makes arbitrary; loss_type=dapo (trainer.loss.loss_agg_mode="
            "token-mean) normalises by the minibatch's tokens",
            "dr_grpo": "is the mean response token sum divided by max_completion_length; "
            "Sluice's trainer.loss.loss_agg_mode=seq-mean-token-sum lacks that constant ("
            + _SAME_SCALE
            + "); Dr. GRPO's unscaled advantages are trainer.advantage.mode=drgrpo",
            "cispo": "caps the weight at epsilon_high itself, with no lower clip; Sluice's "
            "trainer.loss.objective=cispo clips it to [1 - eps_clip_low, 1 + eps_clip_high]: "
            "set that objective, loss_agg_mode=token-mean and the clips",
            "sapo": "gates the ratio softly; Sluice has no such objective "
            "(trainer.loss.objective: decoupled_ppo, gspo, cispo)",
            "luspo": "weighs GSPO's sequence losses by length; Sluice has no such objective "
            "(trainer.loss.objective: decoupled_ppo, gspo, cispo)",
        },
        other_values="Sluice maps TRL's grpo and dapo (its loss aggregation)",
    ),
    # the KL penalty
    "beta": PeerName(TRL, _KL_COEF),
    "kl_loss_coef": PeerName(
        VERL, _KL_COEF, note="on whenever > 0: Sluice has no use_kl_loss switch"
    ),
    "use_kl_loss": PeerName(VERL, _KL_COEF, kind="kl_switch"),
    "kl_loss_type": PeerName(
        VERL,
        "trainer.kl.estimator",
        values={"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"},
        refused_values={
            "abs": "is |log r|, which Sluice does not estimate (trainer.kl.estimator: k1, k2, k3)",
            "full": "is the exact KL over the vocabulary; Sluice estimates it from the sampled "
            "tokens (trainer.kl.estimator: k1, k2, k3)",
            **{
                kind: _STRAIGHT_THROUGH
                for kind in ("kl+", "k1+", "mse+", "k2+", "low_var_kl+", "k3+")
            },
        },
        other_values="Sluice has verl's kl (k1), mse (k2) and low_var_kl (k3)",
    ),
}
"""Peer names by what is typed: bare (`learning_rate`), or a dotted path that is no
Sluice key (`rollout.n`). verl's full paths are in `VERL_PATHS`."""


def _verl_paths() -> dict[str, str]:
    actor = [
        "clip_ratio",
        "clip_ratio_low",
        "clip_ratio_high",
        "clip_ratio_c",
        "entropy_coeff",
        "loss_agg_mode",
        "ppo_epochs",
        "use_kl_loss",
        "kl_loss_coef",
        "kl_loss_type",
        "grad_clip",
        "ppo_mini_batch_size",
        "ppo_micro_batch_size",
        "ppo_micro_batch_size_per_gpu",
        "ppo_max_token_len_per_gpu",
    ]
    optim = [
        "lr",
        "lr_warmup_steps",
        "lr_warmup_steps_ratio",
        "min_lr_ratio",
        "warmup_style",
        "lr_scheduler_type",
        "weight_decay",
    ]
    paths = {f"actor_rollout_ref.actor.{name}": name for name in actor}
    paths |= {f"actor_rollout_ref.actor.optim.{name}": name for name in optim}
    data = ("train_batch_size", "max_prompt_length", "max_response_length")
    paths |= {f"data.{name}": name for name in data}
    paths |= {f"trainer.{name}": name for name in ("total_training_steps", "total_epochs")}
    rollout = {
        "n": "rollout.n",
        "temperature": "temperature",
        "response_length": "max_response_length",
        "prompt_length": "max_prompt_length",
    }
    paths |= {f"actor_rollout_ref.rollout.{theirs}": ours for theirs, ours in rollout.items()}
    return paths


VERL_PATHS: dict[str, str] = _verl_paths()
"""verl's full config paths -> the `PEER_NAMES` entry that says what each means."""


@dataclass(frozen=True)
class Resolution:
    """What one override under a peer name does."""

    assignments: list[tuple[str, Any]]
    """Sluice keys and the values they get (none: nothing to change)."""
    notice: str
    """The one line that says so."""


def lookup(name: str) -> PeerName | None:
    """The entry of a name typed in full (bare or dotted), with verl's origin for its paths."""
    if name in PEER_NAMES:
        return PEER_NAMES[name]
    if name in VERL_PATHS:
        return dataclasses.replace(PEER_NAMES[VERL_PATHS[name]], origin=VERL)
    return None


def resolve_peer_name(
    name: str,
    value: Any,
    raw: str,
    data: Mapping[str, Any],
    schema: type[BaseModel] | None = None,
) -> Resolution | None:
    """What `name=raw` (parsed: `value`) does to the nested config `data`; None when `name`
    is no peer name. Raises PeerNameError for a refusal or, given the config's `schema`
    (RunConfig, passed in: that module imports this one), a value Sluice's key rejects."""
    peer = lookup(name)
    if peer is None:
        return None
    raw = raw.strip()
    said = f"sluice: {name} is {peer.origin} name"
    if not peer.target:
        raise PeerNameError(f"--set {name}={raw}: {peer.origin} {name} {peer.refusal}")
    if peer.kind == "kl_switch":
        return _kl_switch(name, value, raw, data, said)
    shown, translated = raw, value
    key = str(value)
    if key in peer.refused_values:
        raise PeerNameError(f"--set {name}={raw}: {peer.origin} {raw} {peer.refused_values[key]}")
    if peer.values is not None:
        if key not in peer.values:
            reason = peer.other_values or f"Sluice maps {', '.join(peer.values)}"
            raise PeerNameError(f"--set {name}={raw}: {reason}")
        translated = peer.values[key]
        shown = translated if translated == key else f"{translated} (for {key})"
    translated = _check(schema, name, peer.origin, peer.target, translated)
    note = f" ({peer.note})" if peer.note else ""
    if peer.kind == "both_clips":
        translated = _check(schema, name, peer.origin, _HIGH, translated)
        high = _get(data, _HIGH)
        if high is not None:
            return Resolution(
                [(_LOW, translated)],
                f"{said}; using {_LOW}={shown} ({_HIGH} is already set: {high})",
            )
        return Resolution(
            [(_LOW, translated), (_HIGH, translated)],
            f"{said}; using {_LOW}={shown} and {_HIGH}={shown}",
        )
    return Resolution([(peer.target, translated)], f"{said}; using {peer.target}={shown}{note}")


def _kl_switch(name: str, value: Any, raw: str, data: Mapping[str, Any], said: str) -> Resolution:
    if not isinstance(value, bool):
        raise PeerNameError(f"--set {name}={raw}: verl's {name} takes true or false")
    if not value:
        return Resolution([(_KL_COEF, 0.0)], f"{said}; using {_KL_COEF}=0 (the KL loss is off)")
    coef = _get(data, _KL_COEF)
    if _positive(coef):
        return Resolution([], f"{said}; {_KL_COEF}={coef} already turns the KL loss on")
    return Resolution(
        [(_KL_COEF, _VERL_KL_COEF)],
        f"{said}; using {_KL_COEF}={_VERL_KL_COEF} (verl's default kl_loss_coef; "
        "Sluice's KL loss is on when the coef is > 0)",
    )


def peer_suggestion(key: str) -> str:
    """For an unknown config key that is a peer name or ends in one
    (`trainer.learning_rate`): the Sluice key it means, or why Sluice has none, as the
    tail of the error line; "" for any other key."""
    name, peer = key, lookup(key)
    if peer is None:
        name = key.rsplit(".", 1)[-1]
        peer = PEER_NAMES.get(name)
    if peer is None:
        return ""
    if not peer.target:
        return f"; {peer.origin} {name} {peer.refusal}"
    if peer.kind == "both_clips":
        return f"; did you mean '{_LOW}' and '{_HIGH}'? ({name} is {peer.origin} name for both)"
    if peer.kind == "kl_switch":
        return f"; Sluice's KL loss is on when '{_KL_COEF}' > 0 ({name} is verl's switch for it)"
    return f"; did you mean '{peer.target}'? ({name} is {peer.origin} name for it)"


_SAID: set[str] = set()


def say_once(name: str, line: str) -> None:
    """Print `line` to stderr the first time `name` is translated in this process."""
    if name not in _SAID:
        _SAID.add(name)
        print(line, file=sys.stderr)


def _get(data: Mapping[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _positive(value: Any) -> bool:
    """Whether a value as the config holds it (YAML reads `1e-3` as text) is a number > 0."""
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return False


def _check(schema: type[BaseModel] | None, name: str, origin: str, target: str, value: Any) -> Any:
    """`value` as the field of `target` reads it; PeerNameError naming both names when
    it is no valid value there. Without a schema the value goes on unchecked (the whole
    config's validation still sees it)."""
    if schema is None:
        return value
    try:
        return _field_model(schema, target).model_validate({"value": value}).model_dump()["value"]
    except ValidationError as err:
        shown = json.dumps(value, default=str)
        raise PeerNameError(
            f"--set: invalid value for '{name}' ({origin} name for '{target}') = {shown}: "
            f"{err.errors()[0]['msg']}"
        ) from None


@functools.cache
def _field_model(schema: type[BaseModel], target: str) -> type[BaseModel]:
    """A one-field model holding the field of `target` (its type and constraints)."""
    model: type[BaseModel] = schema
    *sections, leaf = target.split(".")
    for section in sections:
        annotation = model.model_fields[section].annotation
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
        model = annotation
    found = model.model_fields[leaf]
    return create_model("PeerValue", value=(found.annotation, found))
