"""Decoupled PPO loss: hand-worked values, reductions, and micro-batch gradient equivalence."""

import math

import pytest
import torch

from sluice.engines.rl.batching import dynamic_micro_batches
from sluice.engines.rl.loss import decoupled_ppo_loss, make_policy_loss, merge_micro_batch_metrics
from sluice.engines.rl.loss_inputs import LossInputs
from sluice.infra.config.trainer import LossConfig

# Three tokens shared by the hand-worked cases:
#   proximal log-probs      p = [-1.0, -2.0, -0.5]
#   trust-region ratio      u = [1.1, 0.7, 1.3]        (logprobs = p + log u)
#   behaviour log-probs     b = p - [-1.0, 0.5, 0.0]   so w = exp(p - b) = [e^-1, e^0.5, 1]
#   advantages              A = [1, -1, 2]
PROX = torch.tensor([-1.0, -2.0, -0.5])
U = torch.tensor([1.1, 0.7, 1.3])
DELTA = torch.tensor([-1.0, 0.5, 0.0])
ADV = torch.tensor([1.0, -1.0, 2.0])
MASK = torch.ones(3, dtype=torch.bool)


def _inputs():
    logprobs = (PROX + U.log()).requires_grad_(True)
    return logprobs, PROX.clone(), PROX - DELTA


def test_decoupled_loss_matches_hand_worked_value():
    logprobs, prox, behav = _inputs()
    loss, metrics = decoupled_ppo_loss(
        LossInputs(
            logprobs=logprobs,
            proximal_logprobs=prox,
            behaviour_logprobs=behav,
            advantages=ADV,
            loss_mask=MASK,
            num_global_tokens=3,
        )
    )
    # token 0: A=1,  u=1.1 inside [0.8, 1.2]: min(1.1, 1.1) = 1.1; times w=e^-1  -> -0.40466739
    # token 1: A=-1, u=0.7 < 0.8: min(-0.7, -0.8) = -0.8;      times w=e^0.5 -> +1.31897702
    # token 2: A=2,  u=1.3 > 1.2: min(2.6, 2.4) = 2.4;          times w=1     -> -2.4
    # L = (-0.40466739 + 1.31897702 - 2.4) / 3 = -0.49523012
    torch.testing.assert_close(loss, torch.tensor(-0.49523012))
    torch.testing.assert_close(metrics["loss/clip_fraction"], torch.tensor(2 / 3))
    torch.testing.assert_close(metrics["loss/clip_low_fraction"], torch.tensor(1 / 3))
    torch.testing.assert_close(metrics["loss/clip_high_fraction"], torch.tensor(1 / 3))
    torch.testing.assert_close(metrics["loss/ratio_max"], torch.tensor(1.3))
    torch.testing.assert_close(metrics["loss/ratio_min"], torch.tensor(0.7))
    # k3 of u: mean(u - 1 - log u) = (0.0046898 + 0.0566749 + 0.0376357) / 3
    torch.testing.assert_close(metrics["loss/approx_kl"], torch.tensor(0.0330001))


def test_behaviour_weight_is_exp_of_log_ratio():
    # With u = 1 and A = 1 every token costs -w: the loss exposes w itself.
    prox = torch.tensor([-1.0, -1.0])
    behav = prox - torch.tensor([-1.0, 0.5])
    logprobs = prox.clone().requires_grad_(True)
    loss, metrics = decoupled_ppo_loss(
        LossInputs(
            logprobs=logprobs,
            proximal_logprobs=prox,
            behaviour_logprobs=behav,
            advantages=torch.ones(2),
            loss_mask=torch.ones(2, dtype=torch.bool),
            num_global_tokens=1,
        )
    )
    # w = exp(-1) = 0.3679 and exp(0.5) = 1.6487; L = -(0.3679 + 1.6487) / 1
    torch.testing.assert_close(loss, torch.tensor(-(0.36787944 + 1.64872127)))
    torch.testing.assert_close(metrics["loss/behaviour_weight_max"], torch.tensor(1.64872127))


def test_clipped_tokens_get_no_gradient_and_unclipped_get_weighted_gradient():
    logprobs, prox, behav = _inputs()
    loss, _ = decoupled_ppo_loss(
        LossInputs(
            logprobs=logprobs,
            proximal_logprobs=prox,
            behaviour_logprobs=behav,
            advantages=ADV,
            loss_mask=MASK,
            num_global_tokens=3,
        )
    )
    loss.backward()
    # d/dlogprob of -w*u*A/N = -w*u*A/N for the unclipped token 0: -(e^-1 * 1.1 * 1)/3
    expected = torch.tensor([-math.exp(-1) * 1.1 / 3, 0.0, 0.0])
    torch.testing.assert_close(logprobs.grad, expected)


def test_standard_ppo_anchors_the_ratio_at_behaviour_policy():
    logprobs, _, behav = _inputs()
    loss, _ = decoupled_ppo_loss(
        LossInputs(
            logprobs=logprobs,
            proximal_logprobs=None,
            behaviour_logprobs=behav,
            advantages=ADV,
            loss_mask=MASK,
            num_global_tokens=3,
        ),
        decoupled=False,
    )
    # ratio = exp(logprobs - b) = u * w = [0.40466739, 1.15410489, 1.3], weight 1
    # token 0: A=1,  r=0.405 < 0.8: min(0.405, 0.8) = 0.405       -> -0.40466739
    # token 1: A=-1, r=1.154 in range: -1.154                     -> +1.15410489
    # token 2: A=2,  r=1.3 > 1.2: min(2.6, 2.4)                    -> -2.4
    # L = (-0.40466739 + 1.15410489 - 2.4) / 3 = -0.55018750
    torch.testing.assert_close(loss, torch.tensor(-0.5501875))


def test_decoupled_equals_standard_ppo_when_proximal_is_behaviour():
    torch.manual_seed(0)
    behav = -torch.rand(6) * 3
    advantages = torch.randn(6)
    mask = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)
    base = behav + 0.3 * torch.randn(6)
    a = base.clone().requires_grad_(True)
    b = base.clone().requires_grad_(True)
    loss_a, _ = decoupled_ppo_loss(
        LossInputs(
            logprobs=a,
            proximal_logprobs=behav,
            behaviour_logprobs=behav,
            advantages=advantages,
            loss_mask=mask,
            num_global_tokens=5,
        )
    )
    loss_b, _ = decoupled_ppo_loss(
        LossInputs(
            logprobs=b,
            proximal_logprobs=None,
            behaviour_logprobs=behav,
            advantages=advantages,
            loss_mask=mask,
            num_global_tokens=5,
        ),
        decoupled=False,
    )
    loss_a.backward()
    loss_b.backward()
    torch.testing.assert_close(loss_a, loss_b)
    torch.testing.assert_close(a.grad, b.grad)


def test_dual_clip_caps_negative_advantage_loss():
    prox = torch.zeros(3)
    logprobs = torch.log(torch.tensor([5.0, 1.0, 1.0])).requires_grad_(True)
    advantages = torch.tensor([-1.0, -2.0, 1.0])
    loss, metrics = decoupled_ppo_loss(
        LossInputs(
            logprobs=logprobs,
            proximal_logprobs=prox,
            behaviour_logprobs=prox,
            advantages=advantages,
            loss_mask=torch.ones(3),
            num_global_tokens=3,
        ),
        dual_clip_c=3.0,
    )
    # token 0: A=-1, u=5: max(5, 1.2) = 5 capped at c|A| = 3
    # token 1: A=-2, u=1: 2 (cap 6 not reached); token 2: A=1, u=1: -1
    # L = (3 + 2 - 1) / 3 = 4/3   (without dual clip: (5 + 2 - 1) / 3 = 2)
    torch.testing.assert_close(loss, torch.tensor(4 / 3))
    torch.testing.assert_close(metrics["loss/dual_clip_fraction"], torch.tensor(1 / 3))
    loss.backward()
    assert logprobs.grad[0] == 0.0
    undual, _ = decoupled_ppo_loss(
        LossInputs(
            logprobs=logprobs.detach(),
            proximal_logprobs=prox,
            behaviour_logprobs=prox,
            advantages=advantages,
            loss_mask=torch.ones(3),
            num_global_tokens=3,
        )
    )
    torch.testing.assert_close(undual, torch.tensor(2.0))


def test_masked_tokens_with_garbage_values_do_not_change_the_loss():
    logprobs, prox, behav = _inputs()
    # A fourth, masked token whose log-ratios would overflow exp() and whose advantage is huge.
    lp4 = torch.cat([logprobs.detach(), torch.tensor([900.0])])
    prox4 = torch.cat([prox, torch.tensor([-900.0])])
    behav4 = torch.cat([behav, torch.tensor([-1e30])])
    adv4 = torch.cat([ADV, torch.tensor([1e6])])
    mask4 = torch.tensor([True, True, True, False])
    loss, metrics = decoupled_ppo_loss(
        LossInputs(
            logprobs=lp4,
            proximal_logprobs=prox4,
            behaviour_logprobs=behav4,
            advantages=adv4,
            loss_mask=mask4,
            num_global_tokens=3,
        )
    )
    torch.testing.assert_close(loss, torch.tensor(-0.49523012))
    assert all(torch.isfinite(v) for v in metrics.values())


def test_behaviour_weights_replace_the_ratio_and_zeroed_tokens_keep_the_denominator():
    logprobs, prox, behav = _inputs()
    weights = torch.tensor([2.0, 0.0, 1.0])
    mask = torch.tensor([True, False, True])
    loss, _ = decoupled_ppo_loss(
        LossInputs(
            logprobs=logprobs,
            proximal_logprobs=prox,
            behaviour_logprobs=behav,
            advantages=ADV,
            loss_mask=mask,
            num_global_tokens=3,
            behaviour_weights=weights,
        )
    )
    # token 0: -2 * 1.1 = -2.2; token 1 rejected; token 2: -2.4. Denominator stays 3:
    # L = (-2.2 - 2.4) / 3 = -1.5333333
    torch.testing.assert_close(loss, torch.tensor(-4.6 / 3))


def test_micro_batched_accumulation_equals_full_batch_gradient():
    torch.manual_seed(1)
    vocab, width = 7, 5
    seq_lens = [6, 2, 9, 4, 3, 7]
    total = sum(seq_lens)
    features = torch.randn(total, width, dtype=torch.float64)
    tokens = torch.randint(vocab, (total,))
    behav = -torch.rand(total, dtype=torch.float64) * 2 - 0.5
    advantages = torch.randn(total, dtype=torch.float64)
    mask = torch.rand(total) > 0.25
    weight = torch.randn(width, vocab, dtype=torch.float64)

    def token_logprobs(w, rows):
        return torch.log_softmax(features[rows] @ w, -1).gather(1, tokens[rows, None])[:, 0]

    all_rows = torch.arange(total)
    prox = token_logprobs(weight, all_rows).detach()
    n_global = int(mask.sum())

    w_full = weight.clone().requires_grad_(True)
    full, _ = decoupled_ppo_loss(
        LossInputs(
            logprobs=token_logprobs(w_full, all_rows),
            proximal_logprobs=prox,
            behaviour_logprobs=behav,
            advantages=advantages,
            loss_mask=mask,
            num_global_tokens=n_global,
        )
    )
    full.backward()

    starts = torch.tensor([0, *seq_lens]).cumsum(0).tolist()
    w_micro = weight.clone().requires_grad_(True)
    parts = []
    micro_batches = dynamic_micro_batches(seq_lens, 12, min_micro_batches=2)
    assert len(micro_batches) >= 2
    for mb in micro_batches:
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in mb])
        loss, metrics = decoupled_ppo_loss(
            LossInputs(
                logprobs=token_logprobs(w_micro, rows),
                proximal_logprobs=prox[rows],
                behaviour_logprobs=behav[rows],
                advantages=advantages[rows],
                loss_mask=mask[rows],
                num_global_tokens=n_global,
            )
        )
        loss.backward()
        parts.append(metrics)
    torch.testing.assert_close(w_micro.grad, w_full.grad)
    merged = merge_micro_batch_metrics(parts)
    assert merged["loss/policy_loss"] == pytest.approx(float(full.detach()))
    assert merged["loss/valid_tokens"] == n_global


def test_make_policy_loss_binds_config_and_rejects_bad_values():
    fn = make_policy_loss(decoupled=True, eps_clip_low=0.2, eps_clip_high=0.2, dual_clip_c=None)
    logprobs, prox, behav = _inputs()
    loss, _ = fn(
        LossInputs(
            logprobs=logprobs,
            proximal_logprobs=prox,
            behaviour_logprobs=behav,
            advantages=ADV,
            loss_mask=MASK,
            num_global_tokens=3,
        )
    )
    torch.testing.assert_close(loss, torch.tensor(-0.49523012))
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'"):
        make_policy_loss("ppo2")
    # Bad bounds are refused once, by the config the user sets them in, not by the loss.
    with pytest.raises(ValueError, match="dual_clip_c"):
        LossConfig(dual_clip_c=0.5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_global_tokens": 0}, "num_global_tokens must be positive"),
        ({"advantages": torch.ones(4)}, "advantages has shape"),
        ({"proximal_logprobs": None}, "proximal_logprobs is None"),
        ({"decoupled": False, "behaviour_weights": torch.ones(3)}, "behaviour_weights"),
    ],
)
def test_bad_inputs_raise_one_clear_error(kwargs, message):
    logprobs, prox, behav = _inputs()
    args = {
        "logprobs": logprobs,
        "proximal_logprobs": prox,
        "behaviour_logprobs": behav,
        "advantages": ADV,
        "loss_mask": MASK,
        "num_global_tokens": 3,
    }
    args.update(kwargs)
    config = {k: args.pop(k) for k in ("decoupled",) if k in args}
    with pytest.raises(ValueError, match=message):
        decoupled_ppo_loss(LossInputs(**args), **config)
