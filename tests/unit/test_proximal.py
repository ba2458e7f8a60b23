"""Log-linear π_prox (AReaL's ``prox_logp_method: loglinear``): hand-worked values of
log π_behav + α (log π_θ − log π_behav) with α = lag / (lag + j/k), exact at the first
optimizer step, π_behav itself on fresh data, and a refusal of what cannot be."""

import pytest
import torch

from sluice.engines.rl.proximal import loglinear_proximal

BEHAVIOUR = [-2.0, -1.0, -3.0, -0.5]
CURRENT = [-1.0, -2.0, -1.0, -1.5]


def test_loglinear_values_by_hand():
    # Step j/k = 0.5 of the version, lags 1, 3, 0, 2 versions:
    #   α = lag / (lag + 0.5) = 1/1.5 = 2/3, 3/3.5 = 6/7, 0, 2/2.5 = 0.8
    #   log π_behav + α (log π_θ − log π_behav):
    #     -2 + 2/3 · (+1)  = -4/3
    #     -1 + 6/7 · (−1)  = -13/7
    #     -3 + 0 · (+2)    = -3
    #   -0.5 + 0.8 · (−1)  = -1.3
    got = loglinear_proximal(
        torch.tensor(BEHAVIOUR), torch.tensor(CURRENT), torch.tensor([1, 3, 0, 2]), 0.5
    )
    torch.testing.assert_close(got, torch.tensor([-4 / 3, -13 / 7, -3.0, -1.3]))


def test_a_later_step_leans_further_towards_the_behaviour_policy():
    # One version behind (lag 1), one token: behaviour -2, current -1.
    #   j/k = 0.25: α = 1/1.25 = 0.8 -> -2 + 0.8 = -1.2
    #   j/k = 0.75: α = 1/1.75 = 4/7 -> -2 + 4/7 = -10/7
    behaviour, current, lag = torch.tensor([-2.0]), torch.tensor([-1.0]), torch.tensor([1])
    early = loglinear_proximal(behaviour, current, lag, 0.25)
    late = loglinear_proximal(behaviour, current, lag, 0.75)
    torch.testing.assert_close(early, torch.tensor([-1.2]))
    torch.testing.assert_close(late, torch.tensor([-10 / 7]))


def test_the_first_optimizer_step_gives_the_current_logprobs_exactly():
    # j = 0: the weights being trained are π_prox, whatever the lag (α = lag/lag = 1).
    current = torch.tensor(CURRENT, requires_grad=True)
    got = loglinear_proximal(torch.tensor(BEHAVIOUR), current, torch.tensor([0, 1, 5, 2]), 0.0)
    assert torch.equal(got, current.detach())
    assert not got.requires_grad


def test_fresh_tokens_after_the_first_step_take_the_behaviour_logprobs():
    # lag 0: α = 0 / (0 + j/k) = 0 for every j > 0, so π_prox is π_behav (weight 1).
    for step_fraction in (0.25, 0.5, 0.75):
        got = loglinear_proximal(
            torch.tensor(BEHAVIOUR), torch.tensor(CURRENT), torch.zeros(4), step_fraction
        )
        assert torch.equal(got, torch.tensor(BEHAVIOUR)), step_fraction


def test_the_approximation_carries_no_gradient():
    current = torch.tensor(CURRENT, requires_grad=True)
    got = loglinear_proximal(torch.tensor(BEHAVIOUR), current, torch.ones(4), 0.5)
    assert not got.requires_grad


def test_a_negative_lag_or_step_fraction_is_refused():
    behaviour, current = torch.tensor(BEHAVIOUR), torch.tensor(CURRENT)
    with pytest.raises(ValueError, match="lag must be >= 0"):
        loglinear_proximal(behaviour, current, torch.tensor([1, 0, -1, 2]), 0.5)
    with pytest.raises(ValueError, match="step_fraction must be >= 0"):
        loglinear_proximal(behaviour, current, torch.ones(4), -0.5)
