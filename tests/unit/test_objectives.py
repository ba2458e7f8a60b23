"""GSPO and CISPO: hand-worked values and gradients, their defining properties,
micro-batch invariance under every aggregation mode, and the loss registry."""

import math

import pytest
import torch

from sluice.engines.rl.aggregation import LOSS_AGG_MODES, aggregation_scale
from sluice.engines.rl.batching import dynamic_micro_batches
from sluice.engines.rl.loss import (
    POLICY_LOSSES,
    decoupled_ppo_loss,
    make_policy_loss,
    merge_micro_batch_metrics,
)
from sluice.engines.rl.loss_inputs import LossInputs
from sluice.engines.rl.objectives import cispo_loss, gspo_loss

# ------------------------------------------------------------------ GSPO, by hand
# Five tokens of two sequences, ids [0, 0, 0, 1, 1]:
#   token log-ratios  d = logprobs - prox = [0.3, -0.1, 0.1 | 0.4, 0.2]
#   sequence ratios   s_0 = exp(mean(0.3, -0.1, 0.1)) = e^0.1 = 1.10517092   (in [0.8, 1.2])
#                     s_1 = exp(mean(0.4, 0.2))       = e^0.3 = 1.34985881   (> 1.2)
#   behaviour weight  w = exp(prox - behav) = [1, e^0.5, 1 | 1, e^-0.5]
#   advantages        A = [1, 1, 1 | 2, 2]
G_PROX = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.3])
G_LOG_RATIO = torch.tensor([0.3, -0.1, 0.1, 0.4, 0.2])
G_BEHAV = G_PROX - torch.tensor([0.0, 0.5, 0.0, 0.0, -0.5])
G_ADV = torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0])
G_IDS = torch.tensor([0, 0, 0, 1, 1])
G_MASK = torch.ones(5, dtype=torch.bool)


def _gspo(**kwargs):
    logprobs = (G_PROX + G_LOG_RATIO).requires_grad_(True)
    token_scale = kwargs.pop("token_scale", None)
    inputs = LossInputs(
        logprobs=logprobs,
        proximal_logprobs=G_PROX,
        behaviour_logprobs=G_BEHAV,
        advantages=G_ADV,
        loss_mask=G_MASK,
        num_global_tokens=5,
        token_scale=token_scale,
        sequence_ids=G_IDS,
    )
    loss, metrics = gspo_loss(inputs, **kwargs)
    loss.backward()
    return loss, logprobs.grad, metrics


def test_gspo_matches_hand_worked_value_and_gradient():
    loss, grad, metrics = _gspo()
    # sequence 0, unclipped: -s_0 A w summed = -1.10517092 * (1 + 1.64872127 + 1) = -4.03246064
    # sequence 1, A > 0 and s_1 > 1.2: min(2 s_1, 2 * 1.2) = 2.4 per token,
    #   -2.4 * (1 + 0.60653066) = -3.85567358
    # L = (-4.03246064 - 3.85567358) / 5 = -1.57762684
    torch.testing.assert_close(loss, torch.tensor(-1.57762684))
    # GSPO-token: ∂/∂logprob_t of -w_t sg[s_i] exp(lp_t - sg[lp_t]) A_t / 5 = -w_t s_i A_t / 5
    # (each token its own weight, not the sequence's mean weight); the clipped sequence 1
    # gets none.
    s0 = math.exp(0.1)
    expected = torch.tensor([-s0 / 5, -math.exp(0.5) * s0 / 5, -s0 / 5, 0.0, 0.0])
    torch.testing.assert_close(grad, expected)
    # The two tokens of sequence 1 are clipped (high), sequence 0's three are not.
    torch.testing.assert_close(metrics["loss/clip_fraction"], torch.tensor(2 / 5))
    torch.testing.assert_close(metrics["loss/clip_high_fraction"], torch.tensor(2 / 5))
    torch.testing.assert_close(metrics["loss/ratio_max"], torch.tensor(math.exp(0.3)))
    torch.testing.assert_close(metrics["loss/ratio_min"], torch.tensor(math.exp(0.1)))


def test_gspo_with_seq_mean_token_mean_is_the_papers_aggregation():
    scale = aggregation_scale(G_MASK, G_IDS, "seq-mean-token-mean", 2)
    loss, grad, _ = _gspo(token_scale=scale)
    # (1/G) Σ_i (1/n_i) Σ_t: (-4.03246064 / 3 + -3.85567358 / 2) / 2 = -1.63599517
    torch.testing.assert_close(loss, torch.tensor(-1.63599517))
    s0 = math.exp(0.1)
    expected = torch.tensor([-s0 / 6, -math.exp(0.5) * s0 / 6, -s0 / 6, 0.0, 0.0])
    torch.testing.assert_close(grad, expected)


def test_gspo_with_the_papers_clip_range_clips_both_sequences():
    # With the paper's eps 3e-4 / 4e-4, s_0 = 1.105 and s_1 = 1.350 both exceed 1.0004
    # with A > 0: every token costs -1.0004 A w and has no gradient.
    # L = -1.0004 * (1 * (1 + e^0.5 + 1) + 2 * (1 + e^-0.5)) / 5
    #   = -1.0004 * (3.64872127 + 3.21306132) / 5 = -1.37290546
    loss, grad, metrics = _gspo(eps_clip_low=3e-4, eps_clip_high=4e-4)
    torch.testing.assert_close(loss, torch.tensor(-1.37290546))
    torch.testing.assert_close(grad, torch.zeros(5))
    torch.testing.assert_close(metrics["loss/clip_fraction"], torch.tensor(1.0))


def test_gspo_gives_every_token_of_a_sequence_the_same_ratio():
    # One sequence whose token ratios differ widely: log-ratios [0.5, -0.3, 0.1, -0.1],
    # mean 0.05, so every token's ratio is e^0.05 = 1.05127110, where PPO sees four.
    prox = torch.tensor([-1.0, -0.7, -2.0, -0.4])
    logprobs = prox + torch.tensor([0.5, -0.3, 0.1, -0.1])
    args = dict(
        logprobs=logprobs,
        proximal_logprobs=prox,
        behaviour_logprobs=prox,
        advantages=torch.ones(4),
        loss_mask=torch.ones(4),
        num_global_tokens=4,
    )
    _, metrics = gspo_loss(LossInputs(**args, sequence_ids=torch.zeros(4, dtype=torch.int64)))
    torch.testing.assert_close(metrics["loss/ratio_max"], torch.tensor(math.exp(0.05)))
    torch.testing.assert_close(metrics["loss/ratio_min"], torch.tensor(math.exp(0.05)))
    _, ppo_metrics = decoupled_ppo_loss(LossInputs(**args))
    assert ppo_metrics["loss/ratio_max"] > ppo_metrics["loss/ratio_min"]


def test_gspo_gradient_carries_each_sequences_ratio_on_every_token():
    # Unclipped (wide eps), w = 1, A = 1, N = 1: ∂L/∂logprob_t = -s_i exactly, so the
    # gradient reads the sequence ratio token by token.
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    prox = -torch.rand(9, generator=generator) * 2
    log_ratio = 0.2 * torch.randn(9, generator=generator)
    logprobs = (prox + log_ratio).requires_grad_(True)
    loss, _ = gspo_loss(
        LossInputs(
            logprobs=logprobs,
            proximal_logprobs=prox,
            behaviour_logprobs=prox,
            advantages=torch.ones(9),
            loss_mask=torch.ones(9),
            num_global_tokens=1,
            sequence_ids=ids,
        ),
        eps_clip_low=1.0,
        eps_clip_high=100.0,
    )
    loss.backward()
    for i in range(3):
        s_i = log_ratio[ids == i].mean().exp()
        torch.testing.assert_close(-logprobs.grad[ids == i], s_i.expand(int((ids == i).sum())))


def test_gspo_sequence_ratio_leaves_out_masked_tokens():
    # Token 1 is masked with a log-ratio of 50: s_0 = exp(mean(0.3, 0.1)) = e^0.2, not
    # exp(50.4 / 3); with A = 1, w = 1 and wide clips L = -(2 e^0.2) / 2 = -1.22140276.
    prox = torch.zeros(3)
    logprobs = torch.tensor([0.3, 50.0, 0.1])
    mask = torch.tensor([True, False, True])
    loss, metrics = gspo_loss(
        LossInputs(
            logprobs=logprobs,
            proximal_logprobs=prox,
            behaviour_logprobs=prox,
            advantages=torch.ones(3),
            loss_mask=mask,
            num_global_tokens=2,
            sequence_ids=torch.zeros(3, dtype=torch.int64),
        ),
        eps_clip_high=10.0,
    )
    torch.testing.assert_close(loss, torch.tensor(-math.exp(0.2)))
    assert all(torch.isfinite(v) for v in metrics.values())


# ------------------------------------------------------------------ CISPO, by hand
# The three tokens of test_loss.py:
#   proximal log-probs  p = [-1.0, -2.0, -0.5]
#   ratio               r = [1.1, 0.7, 1.3]   (logprobs = p + log r
#                                              = [-0.90468982, -2.35667494, -0.23763574])
#   behaviour weight    w = [e^-1, e^0.5, 1]
#   advantages          A = [1, -1, 2]
#   clip(r, 0.8, 1.2)     = [1.1, 0.8, 1.2]
C_PROX = torch.tensor([-1.0, -2.0, -0.5])
C_RATIO = torch.tensor([1.1, 0.7, 1.3])
C_BEHAV = C_PROX - torch.tensor([-1.0, 0.5, 0.0])
C_ADV = torch.tensor([1.0, -1.0, 2.0])
C_MASK = torch.ones(3, dtype=torch.bool)


def test_cispo_matches_hand_worked_value_and_gradient():
    logprobs = (C_PROX + C_RATIO.log()).requires_grad_(True)
    loss, metrics = cispo_loss(
        LossInputs(
            logprobs=logprobs,
            proximal_logprobs=C_PROX,
            behaviour_logprobs=C_BEHAV,
            advantages=C_ADV,
            loss_mask=C_MASK,
            num_global_tokens=3,
        )
    )
    # -w sg[clip r] A logprob per token:
    #   token 0: -e^-1  * 1.1 *  1 * -0.90468982 = +0.36609846
    #   token 1: -e^0.5 * 0.8 * -1 * -2.35667494 = -3.10840009
    #   token 2: -1     * 1.2 *  2 * -0.23763574 = +0.57032577
    # L = (0.36609846 - 3.10840009 + 0.57032577) / 3 = -0.72399195
    torch.testing.assert_close(loss, torch.tensor(-0.72399195))
    loss.backward()
    # ∂/∂logprob = -w sg[clip r] A / 3 = [-e^-1 * 1.1, +e^0.5 * 0.8, -2.4] / 3
    expected = torch.tensor([-math.exp(-1) * 1.1 / 3, math.exp(0.5) * 0.8 / 3, -0.8])
    torch.testing.assert_close(logprobs.grad, expected)
    # Tokens 1 (r < 0.8) and 2 (r > 1.2) had their weight truncated, yet both train.
    torch.testing.assert_close(metrics["loss/clip_fraction"], torch.tensor(2 / 3))
    torch.testing.assert_close(metrics["loss/clip_low_fraction"], torch.tensor(1 / 3))
    torch.testing.assert_close(metrics["loss/clip_high_fraction"], torch.tensor(1 / 3))


def test_cispo_trains_a_clipped_token_that_ppo_drops():
    # Token 2 (r = 1.3 > 1.2, A = 2 > 0) is outside PPO's trust region: PPO's gradient
    # there is 0; CISPO's is -1 * 1.2 * 2 / 3 = -0.8.
    grads = {}
    for name, fn in (("ppo", decoupled_ppo_loss), ("cispo", cispo_loss)):
        logprobs = (C_PROX + C_RATIO.log()).requires_grad_(True)
        loss, _ = fn(
            LossInputs(
                logprobs=logprobs,
                proximal_logprobs=C_PROX,
                behaviour_logprobs=C_BEHAV,
                advantages=C_ADV,
                loss_mask=C_MASK,
                num_global_tokens=3,
            )
        )
        loss.backward()
        grads[name] = logprobs.grad
    assert grads["ppo"][2] == 0.0
    torch.testing.assert_close(grads["cispo"][2], torch.tensor(-0.8))


# ------------------------------------------------------------------ shared behaviour


def _ids(n):
    return torch.zeros(n, dtype=torch.int64)


@pytest.mark.parametrize("objective", [gspo_loss, cispo_loss])
def test_standard_form_equals_decoupled_form_with_proximal_equal_to_behaviour(objective):
    generator = torch.Generator().manual_seed(3)
    behav = -torch.rand(7, generator=generator) * 3
    advantages = torch.randn(7, generator=generator)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    base = behav + 0.3 * torch.randn(7, generator=generator)
    a = base.clone().requires_grad_(True)
    b = base.clone().requires_grad_(True)
    loss_a, _ = objective(
        LossInputs(
            logprobs=a,
            proximal_logprobs=behav,
            behaviour_logprobs=behav,
            advantages=advantages,
            loss_mask=mask,
            num_global_tokens=5,
            sequence_ids=ids,
        )
    )
    loss_b, _ = objective(
        LossInputs(
            logprobs=b,
            proximal_logprobs=None,
            behaviour_logprobs=behav,
            advantages=advantages,
            loss_mask=mask,
            num_global_tokens=5,
            sequence_ids=ids,
        ),
        decoupled=False,
    )
    loss_a.backward()
    loss_b.backward()
    torch.testing.assert_close(loss_a, loss_b)
    torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("objective", [gspo_loss, cispo_loss])
def test_masked_tokens_with_garbage_values_leave_the_loss_finite_and_unchanged(objective):
    logprobs = C_PROX + C_RATIO.log()
    clean, _ = objective(
        LossInputs(
            logprobs=logprobs,
            proximal_logprobs=C_PROX,
            behaviour_logprobs=C_BEHAV,
            advantages=C_ADV,
            loss_mask=C_MASK,
            num_global_tokens=3,
            sequence_ids=_ids(3),
        )
    )
    # A fourth, masked token of the same sequence whose log-probs would overflow exp().
    lp4 = torch.cat([logprobs, torch.tensor([float("-inf")])]).requires_grad_(True)
    prox4 = torch.cat([C_PROX, torch.tensor([-900.0])])
    behav4 = torch.cat([C_BEHAV, torch.tensor([-1e30])])
    adv4 = torch.cat([C_ADV, torch.tensor([1e6])])
    mask4 = torch.tensor([True, True, True, False])
    loss, metrics = objective(
        LossInputs(
            logprobs=lp4,
            proximal_logprobs=prox4,
            behaviour_logprobs=behav4,
            advantages=adv4,
            loss_mask=mask4,
            num_global_tokens=3,
            sequence_ids=_ids(4),
        )
    )
    loss.backward()
    torch.testing.assert_close(loss, clean)
    assert torch.isfinite(lp4.grad).all() and lp4.grad[3] == 0.0
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("objective", [gspo_loss, cispo_loss])
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_global_tokens": 0}, "num_global_tokens must be positive"),
        ({"advantages": torch.ones(4)}, "advantages has shape"),
        ({"token_scale": torch.ones(2)}, "token_scale has shape"),
        ({"proximal_logprobs": None}, "proximal_logprobs is None"),
        ({"decoupled": False, "behaviour_weights": torch.ones(3)}, "behaviour_weights"),
        ({"dual_clip_c": 3.0}, "dual_clip_c=3.0 does not apply"),
    ],
)
def test_bad_inputs_raise_one_clear_error(objective, kwargs, message):
    args = {
        "logprobs": C_PROX + C_RATIO.log(),
        "proximal_logprobs": C_PROX,
        "behaviour_logprobs": C_BEHAV,
        "advantages": C_ADV,
        "loss_mask": C_MASK,
        "num_global_tokens": 3,
        "sequence_ids": _ids(3),
    }
    args.update(kwargs)
    config = {k: args.pop(k) for k in ("decoupled", "dual_clip_c") if k in args}
    with pytest.raises(ValueError, match=message):
        objective(LossInputs(**args), **config)


def test_gspo_refuses_to_run_without_sequence_ids():
    with pytest.raises(ValueError, match="gspo needs sequence_ids"):
        gspo_loss(
            LossInputs(
                logprobs=C_PROX,
                proximal_logprobs=C_PROX,
                behaviour_logprobs=C_BEHAV,
                advantages=C_ADV,
                loss_mask=C_MASK,
                num_global_tokens=3,
            )
        )


# ------------------------------------------------------------------ micro-batch invariance

OBJECTIVES = {"decoupled_ppo": decoupled_ppo_loss, "gspo": gspo_loss, "cispo": cispo_loss}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_micro_batched_accumulation_equals_full_batch_for_every_mode(name, mode):
    objective = OBJECTIVES[name]
    torch.manual_seed(1)
    vocab, width = 7, 5
    seq_lens = [6, 2, 9, 4, 3, 7]
    total = sum(seq_lens)
    features = torch.randn(total, width, dtype=torch.float64)
    tokens = torch.randint(vocab, (total,))
    behav = -torch.rand(total, dtype=torch.float64) * 2 - 0.5
    advantages = torch.randn(total, dtype=torch.float64)
    mask = torch.rand(total) > 0.25
    mask[6:8] = False  # sequence 1 has no trained token
    corrected = mask & (torch.rand(total) > 0.1)  # rollout correction drops a few more
    weight = torch.randn(width, vocab, dtype=torch.float64)
    seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    n_tokens = int(mask.sum())
    n_sequences = len(set(seq_of_token[mask].tolist()))

    def token_logprobs(w, rows):
        return torch.log_softmax(features[rows] @ w, -1).gather(1, tokens[rows, None])[:, 0]

    prox = token_logprobs(weight, torch.arange(total)).detach()

    def run(w, rows, ids):
        scale = aggregation_scale(mask[rows], ids, mode, n_sequences)
        return objective(
            LossInputs(
                logprobs=token_logprobs(w, rows),
                proximal_logprobs=prox[rows],
                behaviour_logprobs=behav[rows],
                advantages=advantages[rows],
                loss_mask=corrected[rows],
                num_global_tokens=n_tokens,
                token_scale=scale,
                sequence_ids=ids,
            )
        )

    w_full = weight.clone().requires_grad_(True)
    full, _ = run(w_full, torch.arange(total), seq_of_token)
    full.backward()

    starts = torch.tensor([0, *seq_lens]).cumsum(0).tolist()
    w_micro = weight.clone().requires_grad_(True)
    parts = []
    micro_batches = dynamic_micro_batches(seq_lens, 12, min_micro_batches=2)
    assert len(micro_batches) >= 2
    for mb in micro_batches:
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in mb])
        local_ids = torch.cat(
            [torch.full((seq_lens[i],), k, dtype=torch.int64) for k, i in enumerate(mb)]
        )
        loss, metrics = run(w_micro, rows, local_ids)
        loss.backward()
        parts.append(metrics)
    torch.testing.assert_close(w_micro.grad, w_full.grad)
    merged = merge_micro_batch_metrics(parts)
    assert merged["loss/policy_loss"] == pytest.approx(float(full.detach()))
    assert merged["loss/valid_tokens"] == int(corrected.sum())


# ------------------------------------------------------------------ registry

REQUIRED_METRICS = {
    "loss/policy_loss",
    "loss/valid_tokens",
    "loss/clip_fraction",
    "loss/approx_kl",
    "loss/ratio_mean",
    "loss/ratio_max",
    "loss/ratio_min",
    "loss/behaviour_weight_mean",
    "loss/behaviour_weight_max",
}


def test_registry_holds_the_three_objectives_with_the_metrics_the_trainer_merges():
    assert set(POLICY_LOSSES) == {"decoupled_ppo", "gspo", "cispo"}
    for name, objective in POLICY_LOSSES.items():
        _, metrics = objective(
            LossInputs(
                logprobs=C_PROX + C_RATIO.log(),
                proximal_logprobs=C_PROX,
                behaviour_logprobs=C_BEHAV,
                advantages=C_ADV,
                loss_mask=C_MASK,
                num_global_tokens=3,
                sequence_ids=_ids(3),
            )
        )
        assert REQUIRED_METRICS.issubset(metrics), name
        assert all(m.dim() == 0 and not m.requires_grad for m in metrics.values()), name


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_make_policy_loss_binds_the_new_objectives(name):
    fn = make_policy_loss(name, decoupled=True, eps_clip_low=0.2, eps_clip_high=0.2)
    inputs = LossInputs(
        logprobs=C_PROX + C_RATIO.log(),
        proximal_logprobs=C_PROX,
        behaviour_logprobs=C_BEHAV,
        advantages=C_ADV,
        loss_mask=C_MASK,
        num_global_tokens=3,
        sequence_ids=_ids(3),
    )
    bound, _ = fn(inputs)
    direct, _ = OBJECTIVES[name](inputs)
    assert torch.equal(bound, direct)


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_make_policy_loss_refuses_dual_clip_with_gspo_and_cispo_in_one_line(name):
    with pytest.raises(ValueError, match=f"does not apply to policy loss '{name}'") as info:
        make_policy_loss(name, dual_clip_c=3.0)
    assert "\n" not in str(info.value)


def test_make_policy_loss_still_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'; known: cispo, decoupled_ppo"):
        make_policy_loss("grpo")
