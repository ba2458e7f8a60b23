"""The one loss interface: every objective takes a frozen `LossInputs` by name, whose shapes
are checked once when it is made, and returns `(loss, metrics)`; no tensor is positional."""

import dataclasses
import inspect

import pytest
import torch

from sluice.engines.rl.loss import POLICY_LOSSES, make_policy_loss
from sluice.engines.rl.loss_inputs import LossInputs

PROX = torch.tensor([-1.0, -2.0, -0.5])
BEHAV = PROX - torch.tensor([-1.0, 0.5, 0.0])
NAMED = {
    "logprobs": PROX + torch.tensor([1.1, 0.7, 1.3]).log(),
    "proximal_logprobs": PROX,
    "behaviour_logprobs": BEHAV,
    "advantages": torch.tensor([1.0, -1.0, 2.0]),
    "loss_mask": torch.ones(3, dtype=torch.bool),
    "num_global_tokens": 3,
    "sequence_ids": torch.tensor([0, 0, 1]),
}


def test_the_tensors_cannot_be_passed_by_position():
    # The swap this prevents: proximal and behaviour log-probs share shape and dtype, so a
    # positional call with the two exchanged would train on the wrong ratio silently.
    with pytest.raises(TypeError):
        LossInputs(NAMED["logprobs"], BEHAV, PROX, NAMED["advantages"], NAMED["loss_mask"], 3)
    for objective in POLICY_LOSSES.values():
        with pytest.raises(TypeError):
            objective(*(NAMED[k] for k in list(NAMED)[:6]))


def test_inputs_are_frozen_once_made():
    inputs = LossInputs(**NAMED)
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.proximal_logprobs = BEHAV  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("proximal_logprobs", torch.zeros(4), "proximal_logprobs has shape"),
        ("behaviour_logprobs", torch.zeros(2), "behaviour_logprobs has shape"),
        ("loss_mask", torch.ones(3, 1), "loss_mask has shape"),
        ("sequence_ids", torch.zeros(2, dtype=torch.int64), "sequence_ids has shape"),
        ("behaviour_weights", torch.ones(5), "behaviour_weights has shape"),
        ("num_global_tokens", 0, "num_global_tokens must be positive"),
        ("num_global_tokens", torch.ones(2), "num_global_tokens must be a scalar"),
    ],
)
def test_shapes_are_checked_once_when_the_inputs_are_made(field, value, message):
    with pytest.raises(ValueError, match=message) as info:
        LossInputs(**{**NAMED, field: value})
    assert "\n" not in str(info.value)


def test_every_registered_objective_takes_the_inputs_and_its_config_as_keywords():
    for name, objective in POLICY_LOSSES.items():
        params = list(inspect.signature(objective).parameters.values())
        assert [p.name for p in params] == [
            "inputs",
            "eps_clip_low",
            "eps_clip_high",
            "dual_clip_c",
            "decoupled",
        ], name
        assert all(p.kind is p.KEYWORD_ONLY for p in params[1:]), name
        loss, metrics = make_policy_loss(name)(LossInputs(**NAMED))
        assert loss.dim() == 0 and loss.requires_grad is False, name
        assert metrics["loss/valid_tokens"] == 3, name


def test_a_swap_by_name_changes_the_loss():
    # Named, the two policies still mean what their names say: exchanging them is a
    # different (and visible) call, and gives a different loss.
    fn = make_policy_loss()
    right, _ = fn(LossInputs(**NAMED))
    swapped, _ = fn(LossInputs(**{**NAMED, "proximal_logprobs": BEHAV, "behaviour_logprobs": PROX}))
    assert not torch.equal(right, swapped)
