"""The warm start lowers the supervised loss, trains only on response tokens, does not
let micro-batching change the gradient, and caches its finished checkpoint."""

import numpy as np
import pytest
import torch

from sluice.engines.env.problems.longtail import LongTailSum
from sluice.engines.policy.model import load_policy_dir
from sluice.engines.policy.warm_checks import evaluate_greedy
from sluice.engines.policy.warmstart import (
    IGNORE_INDEX,
    WARM_START_MARKER,
    WeightAverage,
    encode_supervised,
    length_bucketed,
    read_warm_start,
    supervised_step,
    warm_start,
)

SMALL = dict(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=128
)
PROBLEM = LongTailSum(max_terms=6)


@pytest.fixture(scope="module")
def tiny_dir(tiny_policy):
    return tiny_policy(seed=0, **SMALL)


def _examples(tokenizer, n, seed):
    rows = PROBLEM.sample_warmstart_prompts(n, seed)
    return [
        encode_supervised(tokenizer, PROBLEM.format_prompt(r), PROBLEM.reference_response(r))
        for r in rows
    ]


def test_only_response_tokens_carry_labels(tiny_dir):
    _, tokenizer = load_policy_dir(tiny_dir)
    ids, labels = encode_supervised(tokenizer, "a1b2:", "a1=1b2=3")
    # <bos> + 5 prompt chars are masked; 8 response chars + <eos> are labelled.
    assert labels[:6] == [IGNORE_INDEX] * 6
    assert labels[6:] == ids[6:] and len(ids) == 6 + 8 + 1
    assert ids[-1] == tokenizer.eos_token_id


def test_length_buckets_keep_every_example_and_respect_the_budget():
    rng = np.random.default_rng(0)
    for _ in range(50):
        examples = [
            ([0] * int(n), [0] * int(n)) for n in rng.integers(1, 60, size=int(rng.integers(1, 40)))
        ]
        budget = int(rng.integers(60, 400))
        groups = length_bucketed(examples, budget)
        assert sorted(len(e[0]) for g in groups for e in g) == sorted(len(e[0]) for e in examples)
        for group in groups:
            assert max(len(e[0]) for e in group) * len(group) <= budget


def test_micro_batching_does_not_change_the_gradient(tiny_dir):
    model, tokenizer = load_policy_dir(tiny_dir)
    examples = _examples(tokenizer, 6, seed=1)
    grads = []
    losses = []
    for budget in (10_000, 96):  # one micro-batch vs. several
        model.zero_grad(set_to_none=True)
        losses.append(supervised_step(model, examples, tokenizer.pad_token_id, budget))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_a_few_supervised_steps_lower_the_loss(tiny_dir):
    torch.manual_seed(0)
    model, tokenizer = load_policy_dir(tiny_dir)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    examples = _examples(tokenizer, 8, seed=2)
    losses = []
    for _ in range(12):
        optimizer.zero_grad(set_to_none=True)
        losses.append(supervised_step(model, examples, tokenizer.pad_token_id, 4096))
        optimizer.step()
    # A random model starts near ln(vocab) ~ 4.6 nats per token.
    assert losses[0] > 3.5
    assert losses[-1] < 0.75 * losses[0]


def test_evaluate_greedy_counts_checked_rows(tiny_dir):
    model, tokenizer = load_policy_dir(tiny_dir)
    rows = PROBLEM.sample_prompts(5, 0, "test")
    assert evaluate_greedy(model, tokenizer, PROBLEM, rows, 4, check=lambda row, text: True) == 1.0
    first_only = lambda row, text: row is rows[0]  # noqa: E731
    assert evaluate_greedy(model, tokenizer, PROBLEM, rows, 4, check=first_only) == pytest.approx(
        0.2
    )
    with pytest.raises(ValueError, match="no rows"):
        evaluate_greedy(model, tokenizer, PROBLEM, [], 4)


def test_warm_start_saves_a_loadable_checkpoint_and_caches_it(tiny_dir, tmp_path):
    out = tmp_path / "warm"
    report = warm_start(
        tiny_dir,
        PROBLEM,
        steps=6,
        lr=3e-3,
        batch_size=4,
        seed=0,
        max_minutes=1.0,
        out_dir=out,
        eval_every=3,
        num_eval_prompts=3,
        max_new_tokens=8,
        warmup_steps=1,
    )
    assert report.steps == 6 and report.examples_seen == 24
    assert [step for step, _ in report.accuracy_curve] == [3, 6]
    # A random model cannot solve any held-out prompt in 6 steps, so the band is never hit.
    assert report.stop_reason == "max_steps" and report.final_accuracy == 0.0
    # Mean loss of steps 4-6 is below that of steps 1-3.
    assert report.loss_curve[1][1] < report.loss_curve[0][1]
    assert (out / WARM_START_MARKER).is_file()
    model, _ = load_policy_dir(out)
    trained = dict(model.named_parameters())
    start, _ = load_policy_dir(tiny_dir)
    assert any(not torch.equal(p, trained[name]) for name, p in start.named_parameters())

    again = warm_start(tiny_dir, PROBLEM, steps=100, seed=0, max_minutes=1.0, out_dir=out)
    assert again.cached and again.steps == 6
    assert read_warm_start(tmp_path / "nothing") is None


def test_weight_average_follows_the_ramped_decay_and_swaps_back():
    layer = torch.nn.Linear(1, 3, bias=False)
    with torch.no_grad():
        layer.weight.zero_()
    average = WeightAverage(layer, decay=0.5)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0], [2.0], [3.0]]))
    # Update 1: decay = min(0.5, 2/11) = 2/11, shadow = 0 + (9/11) * p.
    average.update(layer)
    torch.testing.assert_close(average.shadow["weight"], layer.weight.detach() * 9 / 11)
    # Update 2: decay = min(0.5, 3/12) = 1/4, shadow = 9/11 p + 3/4 (p - 9/11 p) = 10.5/11 p.
    average.update(layer)
    expected = torch.tensor([[1.0], [2.0], [3.0]]) * 10.5 / 11
    torch.testing.assert_close(average.shadow["weight"], expected)
    average.swap(layer)
    torch.testing.assert_close(layer.weight.detach(), expected)
    average.swap(layer)
    torch.testing.assert_close(layer.weight.detach(), torch.tensor([[1.0], [2.0], [3.0]]))


def test_warm_start_rejects_a_bad_band(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="target_accuracy"):
        warm_start(tiny_dir, PROBLEM, target_accuracy=(0.5, 0.2), out_dir=tmp_path / "w")
