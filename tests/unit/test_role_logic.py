"""The roles' own logic, without their loops: what each role decides, checked on CPU.

The shape every role shares (tasks/role.py): the wait for the first committed version
ends at once on a stop, and the stream loop skips a corrupt shard and ends on a stop.
Then role by role: what a restarted rollout re-issues and admits, the rows a group
becomes; how the reward role fills the reward column; what the trainer trains on and
where a restarted trainer goes on from (a real sqlite MLflow: the alias left behind by
a crash is repaired); the colocated loop's requests and batch; how evaluation scores
versions and picks the next one. Streams are real files under tmp_path.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from sluice.engines.rl.advantages import make_advantage_fn
from sluice.engines.rl.evaluation import heldout_metrics
from sluice.engines.rl.groups import group_key, reissue_plan, resume_gate
from sluice.engines.rl.samples import (
    batch_rows,
    batch_table,
    group_rows,
    row_from_columns,
    samples_from_table,
    score_table,
    staleness_stats,
)
from sluice.infra.config.run import RunConfig
from sluice.infra.registry import CommittedVersion
from sluice.infra.streams.reader import StreamReader
from sluice.infra.streams.schema import table_from_rows
from sluice.infra.streams.writer import StreamWriter
from sluice.tasks import role as role_module
from sluice.tasks.role import Role, StopRequested


@pytest.fixture
def config(local_run_config: Callable[..., RunConfig], tmp_path: Path) -> RunConfig:
    return local_run_config(tmp_path, "rollout.poll_interval_s=0.01")


def version(policy_version: int) -> CommittedVersion:
    return CommittedVersion(
        policy_version=policy_version,
        checkpoint_uri=f"file:///ckpt/v{policy_version}",
        model_version=policy_version + 1,
        trainer_step=policy_version,
        run_id=None,
        checkpoint_digest=None,
        created_at_ms=0,
        tags={},
    )


class FakeRegistry:
    """`newest_durable()` is None for the first `empty_polls` calls, then version 0."""

    def __init__(self, empty_polls: int = 0) -> None:
        self.empty_polls = empty_polls
        self.polls = 0

    def newest_durable(self) -> CommittedVersion | None:
        self.polls += 1
        return version(0) if self.polls > self.empty_polls else None


def make_role(config: RunConfig, monkeypatch, registry: Any) -> Role:
    monkeypatch.setattr(role_module, "run_registry", lambda _config, _run: registry)
    return Role(config, "run", mlflow_run_id="")


def scored_rows(index: int, rewards: tuple[float | None, ...] = (0.0, 1.0)) -> list[dict[str, Any]]:
    return [
        {
            "sample_id": f"{group_key(index)}-{k:03d}",
            "group_id": group_key(index),
            "prompt_id": f"p{index}",
            "prompt_token_ids": [1, 2],
            "response_token_ids": [3, 4, 5][: k + 1],
            "behaviour_logprobs": [-0.5, -0.5, -0.5][: k + 1],
            "token_versions": [0, 0, 1][: k + 1],
            "finish_reason": "stop",
            "reward": reward,
            "task": "t",
            "worker": "w",
        }
        for k, reward in enumerate(rewards)
    ]


# ------------------------------------------------------------------ every role


def test_the_first_version_wait_returns_once_a_version_is_committed(config, monkeypatch):
    registry = FakeRegistry(empty_polls=3)
    role = make_role(config, monkeypatch, registry)
    assert role.wait_for_first_version().policy_version == 0
    assert registry.polls == 4


def test_the_first_version_wait_ends_at_once_when_a_stop_was_requested(config, monkeypatch):
    registry = FakeRegistry(empty_polls=10**9)
    role = make_role(config, monkeypatch, registry)
    role.control.request_stop()
    with pytest.raises(StopRequested):
        role.wait_for_first_version()
    assert registry.polls == 0


def test_a_stop_from_another_thread_interrupts_a_long_poll_sleep(config, monkeypatch):
    config.rollout.poll_interval_s = 60.0
    role = make_role(config, monkeypatch, FakeRegistry(empty_polls=10**9))
    threading.Timer(0.2, role.control.request_stop).start()  # as the SIGTERM handler does
    started = time.monotonic()
    with pytest.raises(StopRequested):
        role.wait_for_first_version()
    assert time.monotonic() - started < 5.0


def test_the_runs_done_marker_stops_the_first_version_wait(config, monkeypatch):
    role = make_role(config, monkeypatch, FakeRegistry(empty_polls=10**9))
    role.control.mark_done("finished elsewhere")
    with pytest.raises(StopRequested):
        role.wait_for_first_version()


def test_the_first_version_wait_gives_up_after_its_timeout(config, monkeypatch):
    role = make_role(config, monkeypatch, FakeRegistry(empty_polls=10**9))
    with pytest.raises(TimeoutError, match="no committed policy version"):
        role.wait_for_first_version(timeout_s=0.05)


def test_the_stream_loop_skips_a_corrupt_shard_and_ends_when_done(config, monkeypatch, tmp_path):
    role = make_role(config, monkeypatch, FakeRegistry())
    writer = StreamWriter(config.storage.url, "run", "scored", writer_id="reward")
    names = [
        writer.write(table_from_rows(scored_rows(i)), shard_key=group_key(i)).name
        for i in (0, 1, 2)
    ]
    (tmp_path / "store" / "run" / "scored" / names[1]).write_bytes(b"not arrow")
    reader = role.stream_reader("scored", consumer="trainer")
    handled: list[str] = []
    idles = []
    ended = role.consume(
        reader,
        lambda ref, table: handled.append(ref.name),
        lambda: idles.append(1),
        done=lambda: len(idles) >= 2,
    )
    assert ended is True
    assert handled == [names[0], names[2]]  # the corrupt one was quarantined, not handed on
    assert len(idles) == 2  # polls that found nothing new


def test_the_stream_loop_ends_on_a_stop_request_before_the_next_poll(config, monkeypatch):
    role = make_role(config, monkeypatch, FakeRegistry())
    writer = StreamWriter(config.storage.url, "run", "rollouts", writer_id="rollout")
    for i in (0, 1):
        writer.write(table_from_rows(scored_rows(i, (None, None))), shard_key=group_key(i))
    reader = role.stream_reader("rollouts", consumer="reward")
    handled: list[str] = []

    def handle(ref: Any, table: pa.Table) -> None:
        handled.append(ref.name)
        role.control.request_stop()

    assert role.consume(reader, handle, idle=lambda: None) is False
    assert len(handled) == 1  # the second shard waits for the next run


# ------------------------------------------------------------------ rollout


def test_a_restarted_rollout_reissues_the_numbers_that_never_reached_the_stream():
    assert reissue_plan(set()) == (0, [])
    assert reissue_plan({0, 1, 2}) == (3, [])
    assert reissue_plan({0, 1, 3, 6}) == (7, [2, 4, 5])


def test_a_restarted_rollout_admits_only_what_the_staleness_bound_leaves():
    # B=2, eta=1, version 1 committed: at most (1 + 1 + 1) * 2 = 6 groups hold slots.
    # 5 groups are in the stream, 2 of them trained: 5 hold slots, one more may start.
    gate = resume_gate(groups_in_stream=5, policy_version=1, prompts_per_batch=2, max_staleness=1)
    assert gate.capacity(1) == 1
    # Fewer groups written than version 1 trained (a stream that lost some): v * B count.
    gate = resume_gate(groups_in_stream=1, policy_version=1, prompts_per_batch=2, max_staleness=1)
    assert gate.capacity(1) == 4


@dataclass(frozen=True)
class Response:
    output_token_ids: list[int]
    behaviour_logprobs: list[float]
    token_versions: list[int]
    finish_reason: str


def test_a_generated_group_becomes_one_row_per_response_keyed_by_its_issue_number():
    row = {"prompt_id": 17, "prompt": "1+2=", "answer": "3", "task": "sum", "num_terms": 2}
    results = [Response([5, 6], [-0.1, -0.2], [3, 3], "stop"), Response([7], [-0.3], [3], "length")]
    rows = group_rows(12, row, [1, 2], results, worker="rollout-9")
    assert [r["sample_id"] for r in rows] == ["group-000000012-000", "group-000000012-001"]
    assert {r["group_id"] for r in rows} == {group_key(12)}
    assert rows[1]["response_token_ids"] == [7] and rows[1]["finish_reason"] == "length"
    assert all(r["reward"] is None and r["worker"] == "rollout-9" for r in rows)
    # The verifier later sees the prompt row as the dataset had it.
    assert row_from_columns(rows[0]) == {**row, "prompt_id": "17"}


def test_rollout_stats_count_responses_that_span_a_weight_update():
    from sluice.tasks.rollout.stats import RolloutStats

    stats = RolloutStats()
    stats.record_group(
        [
            {"response_token_ids": [1, 2, 3], "token_versions": [4, 4, 4]},
            {"response_token_ids": [1, 2, 3], "token_versions": [4, 5, 6]},
            {"response_token_ids": [1], "token_versions": [5]},
        ]
    )
    status = stats.as_status()
    assert (status["groups_written"], status["samples_written"]) == (1, 3)
    assert status["tokens_generated"] == 7
    assert status["partial_rollout_ratio"] == pytest.approx(1 / 3)
    assert status["max_version_span"] == 2


# ------------------------------------------------------------------ reward


def test_scoring_fills_the_reward_column_in_row_order_from_the_decoded_responses():
    rows = scored_rows(0, rewards=(0.0, 0.0))
    for r, answer in zip(rows, ("4", "5"), strict=True):
        r.update(prompt="2+2=", answer=answer, row_json=json.dumps({"num_terms": 2}))
    table = table_from_rows(rows)
    seen = []

    def score(prompt_rows: list[dict[str, Any]], texts: list[str]) -> list[float]:
        seen.extend(zip([r["answer"] for r in prompt_rows], texts, strict=True))
        assert all(r["num_terms"] == 2 for r in prompt_rows)  # row_json is unpacked
        return [1.0, 0.25]

    scored = score_table(table, score, decode=lambda ids: " ".join(map(str, ids)))
    assert seen == [("4", "3"), ("5", "3 4")]
    assert scored.column("reward").to_pylist() == [1.0, 0.25]
    assert scored.schema == table.schema
    assert scored.drop_columns(["reward"]).equals(table.drop_columns(["reward"]))


def test_the_built_in_verifier_scores_inline_without_a_worker_pool():
    from sluice.tasks.reward.role import VerifierPool

    pool = VerifierPool("builtin", workers=1, timeout_s=1.0, correct=1.0, incorrect=-1.0)
    row = {"prompt_id": "p", "prompt": "3+4=", "answer": "7", "task": "longtail_sum"}
    assert pool.inline
    assert pool.score([row, row], ["3+4=7", "3+4=8"]) == [1.0, -1.0]
    pool.close()


# ------------------------------------------------------------------ train


def test_a_scored_batch_trains_on_its_mixed_groups_with_centred_advantages():
    table = table_from_rows(scored_rows(0, (0.0, 1.0)) + scored_rows(1, (1.0, 1.0)))
    advantages = make_advantage_fn(mode="grpo", drop_zero_variance_groups=True)
    samples, stats = samples_from_table(table, advantages)
    # Group 1 scored the same twice: no gradient, dropped. Group 0: rewards 0 and 1,
    # mean 0.5, std 0.5 (or sqrt(0.5) unbiased): advantages of opposite sign, equal size.
    assert len(samples) == 2
    assert samples[0].advantage == pytest.approx(-samples[1].advantage)
    assert samples[0].advantage < 0 < samples[1].advantage
    assert stats["reward/mean"] == pytest.approx(0.75)
    assert stats["reward/groups"] == 2.0
    assert stats["reward/zero_variance_groups"] == 1.0
    assert stats["grad/mixed_groups"] == 1.0 and stats["grad/all_right_groups"] == 1.0


def test_staleness_counts_versions_behind_the_weights_being_updated():
    table = pa.table(
        {
            "version_start": pa.array([3, 4, 5], pa.int32()),
            "version_end": pa.array([3, 5, 5], pa.int32()),
        }
    )
    stats = staleness_stats(table, policy_version=5)
    # lags 2, 1, 0; one response spans versions 4..5.
    assert (stats["staleness/min"], stats["staleness/max"]) == (0.0, 2.0)
    assert stats["staleness/mean"] == pytest.approx(1.0)
    assert stats["staleness/stale_samples"] == 2.0
    assert stats["rollout/partial_ratio"] == pytest.approx(1 / 3)
    assert stats["rollout/max_version_span"] == 1.0


def _checkpoint(tmp_path: Path, config: RunConfig, policy_version: int, consumed: list[str]) -> str:
    from sluice.infra.checkpoints import save_checkpoint

    weights = tmp_path / f"weights-{policy_version}"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    (weights / "model.safetensors").write_bytes(bytes([policy_version]) * 16)
    (weights / "consumed_shards.json").write_text(json.dumps(consumed))
    return save_checkpoint(weights, f"{config.storage.url}/run/checkpoints/v{policy_version:06d}")


def test_a_restarted_trainer_repairs_a_lagging_alias_and_acks_what_that_version_consumed(
    config, tmp_path, monkeypatch
):
    from sluice.tasks.train.role import TrainRole

    writer = StreamWriter(config.storage.url, "run", "scored", writer_id="reward")
    shards = [
        writer.write(table_from_rows(scored_rows(i)), shard_key=group_key(i)).name for i in (0, 1)
    ]
    role = TrainRole(config, "run", mlflow_run_id="")
    registry = role.registry
    registry.commit(0, _checkpoint(tmp_path, config, 0, []))
    # A crash after version 1 was created in the registry, before the alias moved
    # and before its shards were acked.
    with monkeypatch.context() as patch:
        patch.setattr(registry, "_move_alias_forward", lambda _committed: None)
        registry.commit(1, _checkpoint(tmp_path, config, 1, shards))
    assert registry.newest_servable().policy_version == 0

    start = role.start_version()
    assert start.policy_version == 1  # not a retrain into the taken version 1
    assert registry.newest_servable().policy_version == 1
    reader = StreamReader(config.storage.url, "run", "scored", consumer="trainer")
    assert all(reader.is_acked(name) for name in shards)


# ------------------------------------------------------------------ sync


class Prompts:
    stop_token_ids = (2, 5)

    def __init__(self) -> None:
        self.versions: list[int | None] = []

    def train_prompt(self, index: int, version: int | None = None) -> tuple[dict, list[int]]:
        self.versions.append(version)
        return {"prompt_id": f"p{index}"}, [index, index + 1]


def test_a_sync_step_asks_its_b_groups_g_times_each_with_seeded_samples(config):
    from sluice.tasks.train.sync import sample_seed, step_requests

    config.trainer.prompts_per_batch, config.rollout.group_size, config.seed = 2, 3, 7
    source = Prompts()
    prompts, requests = step_requests(config, source, step=4)
    assert [g for g, _, _ in prompts] == [8, 8, 8, 9, 9, 9]
    assert source.versions == [4, 4]  # the step's policy answers it (a curriculum's clock)
    assert [r.prompt_token_ids for r in requests[::3]] == [[8, 9], [9, 10]]
    assert sample_seed(7, 3, 1) == 7 * 1_000_003 + 3 * 1009 + 1  # the seeds runs were made with
    assert [r.sampling.seed for r in requests[:3]] == [sample_seed(7, 8, k) for k in range(3)]
    assert len({r.sampling.seed for r in requests}) == 6
    assert {r.sampling.stop_token_ids for r in requests} == {(2, 5)}  # the policy's end tokens


@dataclass(frozen=True)
class Output:
    output_token_ids: list[int]
    behaviour_logprobs: list[float]
    token_versions: list[int]
    finish_reason: str


def test_a_sync_batch_has_the_scored_streams_columns_and_its_own_version_when_unmarked():
    outputs = [Output([5], [-0.1], [2], "stop"), Output([], [], [], "length")]
    row = {"prompt_id": "p0", "prompt": "1+1", "answer": "2", "task": "sum", "level": 3}
    prompts = [(0, row, [1]), (0, row, [1])]
    rows = batch_rows(prompts, outputs, [1.0, 0.0], policy_version=3)
    # Built as the rollout role builds its rows: one sample id per response of a group.
    assert [r.sample_id for r in rows] == [f"{group_key(0)}-000", f"{group_key(0)}-001"]
    assert rows[0].row_json == '{"level": 3}' and rows[1].worker == "sync"
    table = batch_table(rows)
    assert table.column("group_id").to_pylist() == [group_key(0)] * 2
    assert table.column("version_start").to_pylist() == [2, 3]
    assert table.column("reward").type == pa.float32()
    samples, _ = samples_from_table(table, make_advantage_fn())
    assert len(samples) == 2


# ------------------------------------------------------------------ evaluate


def test_held_out_metrics_split_sampled_from_greedy_responses():
    rows = [{"num_terms": 2}, {"num_terms": 5}]
    # Per prompt: 2 samples, then the greedy response (layout of eval_requests).
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    lengths = [4, 6, 100, 8, 10, 100]
    metrics = heldout_metrics(rows, rewards, lengths, 2, with_greedy=True, correct_reward=1.0)
    assert metrics["eval/reward"] == pytest.approx(0.25)  # (1 + 0 + 0 + 0) / 4
    assert metrics["eval/pass_at_1"] == pytest.approx(0.25)
    assert metrics["eval/greedy_accuracy"] == pytest.approx(0.5)  # greedy right on prompt 0
    assert metrics["eval/response_length_mean"] == pytest.approx(7.0)  # greedy lengths left out
    assert metrics["eval/reward_terms_2"] == pytest.approx(0.5)
    assert metrics["eval/reward_terms_5-8"] == pytest.approx(0.0)
    greedy = heldout_metrics(rows, [1.0, 0.0], [3, 3], 1, False, 1.0, greedy_temperature=True)
    assert greedy["eval/greedy_accuracy"] == greedy["eval/pass_at_1"] == 0.5


def test_evaluation_requests_are_seeded_per_prompt_and_sample_then_one_greedy(config):
    from sluice.tasks.evaluate.role import eval_requests, eval_seed

    config.evaluation.samples, config.seed = 2, 3
    requests = eval_requests(config, [[1], [2]], 0.7, with_greedy=True, stop_token_ids=(2,))
    assert {r.sampling.stop_token_ids for r in requests} == {(2,)}
    assert [r.prompt_token_ids for r in requests] == [[1], [1], [1], [2], [2], [2]]
    assert [r.sampling.seed for r in requests[:2]] == [eval_seed(3, 0, 0), eval_seed(3, 0, 1)]
    assert eval_seed(3, 1, 1) == 3 * 1_000_003 + 101 + 1
    assert requests[2].sampling.temperature == 0.0 and requests[0].sampling.temperature == 0.7


def test_evaluation_picks_version_zero_every_nth_and_the_last_and_never_falls_behind(config):
    from sluice.tasks.evaluate.role import choose_target
    from sluice.tasks.run.eval_schedule import should_evaluate

    config.trainer.total_steps, config.evaluation.every = 10, 4
    assert [v for v in range(12) if should_evaluate(v, config)] == [0, 4, 8, 10, 11]
    waiting = [version(4), version(8)]
    assert choose_target(waiting, finished=False).policy_version == 8  # newest while running
    assert choose_target(waiting, finished=True).policy_version == 4  # all of them at the end
    assert choose_target([version(4)], finished=False).policy_version == 4
    # A short run can commit versions before the evaluator looks: the start comes first.
    assert choose_target([version(0), version(4)], finished=False).policy_version == 0


def test_evaluation_passes_over_a_version_whose_weights_were_deleted_and_counts_it(
    config, tmp_path, tiny_dir
):
    from sluice.infra.checkpoints import save_checkpoint
    from sluice.infra.tracking import get_metric_history, start_or_resume_run
    from sluice.tasks.evaluate.role import EvaluateRole
    from sluice.tasks.run.paths import read_json, run_paths

    config.trainer.total_steps, config.evaluation.every = 2, 1
    config.evaluation.num_prompts, config.evaluation.greedy = 2, False
    config.rollout.max_new_tokens = 4
    mlflow_run = start_or_resume_run(config.tracking.uri, "evaluate", run_name="run")
    role = EvaluateRole(config, "run", mlflow_run_id=mlflow_run)
    for v in range(3):
        url = f"{config.storage.url}/run/checkpoints/v{v:06d}"
        role.registry.commit(v, save_checkpoint(tiny_dir, url))
    # Expired, say, by a lifecycle rule: deleted after its commit.
    (tmp_path / "store" / "run" / "checkpoints" / "v000001" / "model.safetensors").unlink()
    role.control.mark_done("trained")

    role.run()  # evaluates what it can and ends: no exception, no restart

    steps = get_metric_history(config.tracking.uri, mlflow_run, "eval/reward")
    assert [step for step, _ in steps] == [0, 2]
    status = read_json(config, run_paths(config, "run").status("evaluate"))
    assert status["versions_unreadable"] == 1 and status["state"] == "stopped"


def test_a_signal_is_seen_without_reading_storage_but_the_done_marker_is_not(config):
    from sluice.tasks.run.control import RunControl
    from sluice.tasks.run.paths import run_paths

    control = RunControl(config, run_paths(config, "run"))
    control.mark_done("trained")
    assert not control.stop_requested()  # evaluate still scores the final version
    assert control.should_stop()  # the other roles stop on the marker
    assert control.stop_requested()  # and remember they saw it
    fresh = RunControl(config, run_paths(config, "other"))
    fresh.request_stop()
    assert fresh.stop_requested()


def test_a_stop_ends_training_before_a_batch_that_is_already_complete(config):
    """The time budget's done marker stops the trainer at the next step, not after every
    batch that had finished by then (those would be trained past the budget)."""
    from sluice.tasks.train.role import TrainRole

    writer = StreamWriter(config.storage.url, "run", "scored", writer_id="reward")
    for i in range(2 * config.trainer.prompts_per_batch):  # batches 0 and 1, complete
        writer.write(table_from_rows(scored_rows(i)), shard_key=group_key(i))
    role = TrainRole(config, "run", mlflow_run_id="")
    table, _, _, _ = role.next_batch(0)
    assert table is not None and table.num_rows > 0
    role.control.mark_done("time budget of 60 s reached")
    with pytest.raises(StopRequested):
        role.next_batch(1)
