"""`model.supervised`: rows are the rollout's prompt then the reference answer and the end
token; the pass lowers the loss on them, stops on its clock or its step cap, and its
result is committed as policy version 0 with its facts and its loss curve."""

import itertools
import os
from itertools import islice

import pytest
import torch

from sluice.engines.env.problems.longtail import LongTailSum
from sluice.engines.policy.model import load_policy_dir
from sluice.engines.policy.supervised import supervised_pass
from sluice.engines.policy.warmstart import (
    IGNORE_INDEX,
    collate_supervised,
    encode_supervised,
    response_token_loss_sum,
)
from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import load_config
from sluice.infra.registry import CheckpointRegistry
from sluice.infra.tracking import get_metric_history, start_or_resume_run
from sluice.tasks.prompts import PromptSource, reference_examples
from sluice.tasks.run.paths import registered_model_name
from sluice.tasks.run.prepare import ensure_version_zero
from tests.conftest import local_run_settings
from tests.unit.synthetic import SHIPPED

SMALL = dict(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=128
)


def source(tmp_path):
    config = load_config("reasoning_gym_mix", [f"model.path={SHIPPED}", f"workdir={tmp_path}"])
    return PromptSource(config).use_policy(SHIPPED)


def test_each_row_is_the_rollouts_prompt_then_the_reference_answer_and_the_end(tmp_path):
    src = source(tmp_path)
    eos = 99
    for index, (ids, labels) in enumerate(islice(reference_examples(src, eos), 5)):
        row = src.train_row(index)
        prompt = src.encode_prompt(row)
        answer = src.problem.reference_response(row)
        assert ids[: len(prompt)] == prompt and len(ids) == len(labels)
        assert labels[: len(prompt)] == [IGNORE_INDEX] * len(prompt)
        assert labels[len(prompt) :] == ids[len(prompt) :] and ids[-1] == eos
        assert src.tokenizer.decode(ids[len(prompt) : -1]) == answer


def test_max_terms_keeps_only_the_rows_up_to_that_many_terms(tmp_path):
    src = source(tmp_path)
    kept = [i for i in range(40) if src.train_row(i)["num_terms"] <= 2]
    assert 0 < len(kept) < 40  # the mix has 2-4 terms
    expected = [src.encode_prompt(src.train_row(i)) for i in kept[:4]]
    got = [ids for ids, _ in islice(reference_examples(src, 99, max_terms=2), 4)]
    assert [ids[: len(prompt)] for ids, prompt in zip(got, expected, strict=True)] == expected


def _rows(tokenizer, n):
    problem = LongTailSum(max_terms=4)
    rows = problem.sample_warmstart_prompts(n, 0)
    return [
        encode_supervised(tokenizer, problem.format_prompt(r), problem.reference_response(r))
        for r in rows
    ]


def _loss(model_dir, examples):
    model, tokenizer = load_policy_dir(model_dir)
    batch = collate_supervised(examples, tokenizer.pad_token_id)
    tokens = sum(sum(1 for t in labels[1:] if t != IGNORE_INDEX) for _, labels in examples)
    with torch.no_grad():
        return float(response_token_loss_sum(model, batch)) / tokens


def test_the_pass_lowers_the_loss_on_its_rows_and_stops_at_its_step_cap(tiny_policy, tmp_path):
    base = tiny_policy(seed=0, **SMALL)
    _, tokenizer = load_policy_dir(base)
    rows = _rows(tokenizer, 8)
    report = supervised_pass(
        base,
        itertools.cycle(rows),
        tmp_path / "out",
        minutes=10,
        max_steps=30,
        lr=3e-3,
        batch_size=8,
        max_tokens_per_micro_batch=256,  # several micro-batches a step
    )
    assert (report.steps, report.rows, report.stopped_by) == (30, 240, "max_steps")
    before, after = _loss(base, rows), _loss(tmp_path / "out", rows)
    assert after < 0.7 * before, (before, after)
    assert report.loss_by_minute and report.facts()["loss_last_minute"] > 0
    trained, tokens = load_policy_dir(tmp_path / "out")
    assert tokens(["7 + 5"])["input_ids"] == tokenizer(["7 + 5"])["input_ids"]
    assert not any(name.startswith((".", "sluice_")) for name in os.listdir(tmp_path / "out"))
    assert _loss(base, rows) == before  # the source is untouched


def test_the_clock_ends_the_pass_and_the_last_minute_is_counted(tiny_policy, tmp_path):
    base = tiny_policy(seed=0, **SMALL)
    _, tokenizer = load_policy_dir(base)
    ticks = itertools.count(0.0, 20.0)  # each reading of the clock is 20 s later
    report = supervised_pass(
        base,
        itertools.cycle(_rows(tokenizer, 4)),
        tmp_path / "out",
        minutes=2,
        lr=1e-3,
        batch_size=2,
        clock=lambda: next(ticks),
    )
    # Started at 0, steps end at 20, 40, 60 (the first minute's loss), 80, 100 and 120 s
    # (the second's, and the deadline).
    assert (report.steps, report.stopped_by, len(report.loss_by_minute)) == (6, "minutes", 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.supervised.minutes=5"], "model.supervised trains a model you give in model.path"),
        (
            ["model.supervised.minutes=5", "trainer.time_budget_s=300", f"model.path={SHIPPED}"],
            "model.supervised.minutes=5 leaves RL none of trainer.time_budget_s=300",
        ),
        (
            ["model.supervised.minutes=5", "episode.tools=[calculator]", f"model.path={SHIPPED}"],
            "model.supervised trains single-turn answers",
        ),
    ],
)
def test_a_pass_that_cannot_run_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config("default", overrides)
    assert "\n" not in str(err.value)


def test_version_zero_is_the_passed_model_with_its_facts_and_its_loss_curve(tiny_policy, tmp_path):
    base = tiny_policy(seed=0, **SMALL)
    settings = {
        **local_run_settings(tmp_path),
        "model.path": str(base),
        "model.supervised.minutes": "5",
        "model.supervised.max_steps": "3",
        "model.supervised.batch_size": "4",
    }
    config = load_config("default", [f"{k}={v}" for k, v in settings.items()])
    mlflow_run_id = start_or_resume_run(config.tracking.uri, config.tracking.experiment, "sft")
    zero = ensure_version_zero(config, "sft", mlflow_run_id)
    assert zero["source"] == "user-supervised" and zero["supervised_steps"] == 3
    tags = CheckpointRegistry(config.tracking.uri, registered_model_name(config, "sft")).get(0).tags
    assert (tags["source"], tags["supervised_rows"], tags["supervised_stopped_by"]) == (
        "user-supervised",
        "12",
        "max_steps",
    )
    losses = get_metric_history(config.tracking.uri, mlflow_run_id, "supervised/loss")
    assert [step for step, _ in losses] == [1] and losses[0][1] > 0
    assert not (tmp_path / "work" / "runs" / "sft" / "sft").exists()  # on storage now
    model, _ = load_policy_dir(base)
    stored = zero["checkpoint_uri"].removeprefix("file://")
    trained, _ = load_policy_dir(stored)
    moved = [
        not torch.equal(a, b) for a, b in zip(model.parameters(), trained.parameters(), strict=True)
    ]
    assert any(moved)
