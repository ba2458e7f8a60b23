"""A short real `train` flow under the Prefect harness: roles in processes, real MLflow,
real Arrow shards on disk. Checks what a user would look at afterwards."""

import json
from pathlib import Path

import pytest

from sluice.infra.checkpoints import read_manifest
from sluice.infra.config.run import load_config
from sluice.infra.registry import CheckpointRegistry
from sluice.infra.streams.reader import StreamReader
from sluice.infra.tracking import get_metric_history
from sluice.tasks.run.metrics_file import metrics_file
from sluice.tasks.run.paths import registered_model_name, run_paths
from sluice.tasks.run.status import read_statuses
from tests.flows.conftest import flow_run_artifacts, tiny_run_overrides

pytestmark = pytest.mark.flows


def test_train_flow_runs_roles_and_leaves_versions_metrics_shards_and_artifacts(
    prefect_api, tmp_path
):
    from sluice.flows.train import train

    config = load_config("default", tiny_run_overrides(tmp_path))
    state = train(config, run_id="flowtest", return_state=True)
    assert state.is_completed(), state.message
    result = state.result()

    # Registry: versions 0..3, alias on the newest, checkpoint sources on storage.
    registry = CheckpointRegistry(config.tracking.uri, registered_model_name(config, "flowtest"))
    versions = [v.policy_version for v in registry.versions()]
    assert versions == [0, 1, 2, 3]
    assert registry.newest_servable().policy_version == 3
    assert registry.newest_servable().checkpoint_uri.endswith("/flowtest/checkpoints/v000003")
    assert "sluice.eval.reward" in registry.get(3).tags  # the final version was evaluated

    # Streams: every trained group came through rollouts -> scored, consumed once.
    committed_scored = StreamReader(
        config.storage.url, "flowtest", "scored", consumer="probe"
    ).committed()
    trainer = StreamReader(config.storage.url, "flowtest", "scored", consumer="trainer")
    acked = trainer.acked()
    assert len(acked) == 3 * config.trainer.prompts_per_batch
    assert acked <= {r.name for r in committed_scored}
    rollouts = StreamReader(
        config.storage.url, "flowtest", "rollouts", consumer="probe"
    ).committed()
    assert len(rollouts) >= len(committed_scored) >= len(acked)

    # MLflow: per-step training metrics and held-out evaluations.
    steps = [
        s
        for s, _ in get_metric_history(config.tracking.uri, result["mlflow_run_id"], "reward/mean")
    ]
    assert steps == [1, 2, 3]
    for key in ("staleness/max", "mismatch/kl_k3", "train/idle_ratio", "loss/clip_fraction"):
        assert len(get_metric_history(config.tracking.uri, result["mlflow_run_id"], key)) == 3, key

    # Where a publish went: each part no longer than the whole it is a part of.
    def series(key: str) -> dict[int, float]:
        return dict(get_metric_history(config.tracking.uri, result["mlflow_run_id"], key))

    stall, wait = series("train/publish_stall_s"), series("train/publish_wait_s")
    assert sorted(stall) == sorted(wait) == [1, 2, 3]
    assert all(wait[step] <= stall[step] for step in stall)
    commit = series("train/commit_s")  # logged once a commit has finished: from step 2 or 3
    state_s, policy_s = series("train/commit_state_s"), series("train/commit_policy_s")
    assert commit and sorted(commit) == sorted(state_s) == sorted(policy_s)
    assert all(max(state_s[step], policy_s[step]) <= commit[step] for step in commit)
    # Where each role's time went (tasks/run/state_timer.py): each step's states add up
    # to the step, each role's shares to its wall, within the cores. (How large `other`
    # is depends on the machine's load: benchmarks report it, a test cannot bound it.)
    lines = [json.loads(line) for line in metrics_file(config, "flowtest").read_text().splitlines()]
    for line in lines:
        parts = [
            v
            for k, v in line.items()
            if k.startswith("time/") and k.endswith("_s") and k != "time/step_s"
        ]
        assert sum(parts) == pytest.approx(line["time/step_s"], abs=1e-6)
        assert line["time/cpu_over_cores"] == 0.0
    statuses = read_statuses(config, run_paths(config, "flowtest"))
    for role in ("rollout", "reward", "train"):
        shares = {k: v for k, v in statuses[role].items() if k.endswith("_frac")}
        assert sum(shares.values()) == pytest.approx(1.0), role
        assert "time/other_frac" in shares, (role, shares)
        assert statuses[role]["time/cpu_over_cores"] == 0.0, role
    # The idle ratios the roles always reported agree with their timelines: the
    # trainer's sleeps waiting for data are inside its `wait_data`, and the rollout's
    # ratio is its `idle` share (an idle span still open at the end included).
    train_wall = sum(line["time/step_s"] - line["time/start_s"] for line in lines)
    waits = sum(line["time/wait_data_s"] for line in lines)
    assert lines[-1]["train/idle_ratio"] <= waits / train_wall + 0.01
    rollout = statuses["rollout"]
    assert rollout["idle_ratio"] == pytest.approx(rollout["time/idle_frac"], abs=0.01)
    staleness = get_metric_history(config.tracking.uri, result["mlflow_run_id"], "staleness/max")
    assert all(value <= config.staleness.max_staleness for _, value in staleness)
    held_out = get_metric_history(config.tracking.uri, result["mlflow_run_id"], "eval/reward")
    assert held_out[0][0] == 0 and held_out[-1][0] == 3

    # A clean run: the mismatch watchdog (on, warning, by default) never fired.
    assert result["watchdog"] == {"firings": 0, "by_signal": {}, "groups_skipped": 0}

    # Prefect: summary and per-version table artifacts on the flow run.
    keys = {a.key for a in flow_run_artifacts(state.state_details.flow_run_id)}
    assert {"run-summary", "policy-versions"} <= keys


@pytest.mark.parametrize(
    ("lora_rank", "kl_coef"), [(0, 0.0), (4, 0.0), (0, 0.05)], ids=["full", "lora", "full-kl"]
)
def test_resumed_run_continues_versions_and_mlflow_run_without_retraining(
    prefect_api, tmp_path, lora_rank, kl_coef
):
    from sluice.flows.train import train

    first = load_config(
        "default",
        tiny_run_overrides(
            tmp_path,
            **{
                "trainer.total_steps": 2,
                "trainer.lora.rank": lora_rank,
                "trainer.kl.coef": kl_coef,
            },
            # A LoRA run keeps its base, version 0, whatever retention lets go; so does a
            # run whose KL penalty takes version 0 as its reference.
            **({"storage.keep_versions": 2} if lora_rank or kl_coef else {}),
        ),
    )
    done = train(first, run_id="resumed")
    assert done["final_policy_version"] == 2

    longer = first.model_copy(deep=True)
    longer.trainer.total_steps = 4
    resumed = train(longer, run_id="resumed", resume=True)

    # Same MLflow run, one curve: steps 1..4, each logged once.
    assert resumed["mlflow_run_id"] == done["mlflow_run_id"]
    steps = [
        s for s, _ in get_metric_history(longer.tracking.uri, done["mlflow_run_id"], "reward/mean")
    ]
    assert steps == [1, 2, 3, 4]
    # The servers took the versions after 0 (a LoRA run's adapters through
    # /load_lora_adapter): samples were generated by them.
    rollouts = StreamReader(longer.storage.url, "resumed", "rollouts", consumer="probe")
    served = rollouts.read_next().table.column("version_end").to_pylist()
    assert max(served) >= 2, sorted(set(served))

    registry = CheckpointRegistry(longer.tracking.uri, registered_model_name(longer, "resumed"))
    assert [v.policy_version for v in registry.versions()] == [0, 1, 2, 3, 4]

    # Every trained shard went into exactly one version across both flow runs.
    trainer = StreamReader(longer.storage.url, "resumed", "scored", consumer="trainer")
    assert len(trainer.acked()) == 4 * longer.trainer.prompts_per_batch

    # A LoRA run publishes each version after 0 as its adapter, naming version 0 (kept
    # by retention) as its base; the resumed trainer went on from base + adapter.
    newest = registry.newest_servable()
    base = registry.get(0)
    assert newest is not None and base is not None
    published = {f.name for f in read_manifest(newest.checkpoint_uri).files}
    state = {f.name for f in read_manifest(run_paths(longer, "resumed").trainer_state(4)).files}
    assert "optimizer.pt" in state and not {"adapter_config.json", "config.json"} & state
    if kl_coef:  # the resumed trainer reloaded version 0 as its reference policy
        assert not base.deleted and [v.policy_version for v in registry.versions() if v.deleted]
        kl = get_metric_history(longer.tracking.uri, done["mlflow_run_id"], "loss/kl_ref")
        assert [step for step, _ in kl] == [1, 2, 3, 4]
        assert kl[0][1] == pytest.approx(0.0, abs=1e-6)  # version 0 against itself
        passes = get_metric_history(
            longer.tracking.uri, done["mlflow_run_id"], "train/reference_pass_tokens"
        )
        assert all(value > 0 for _, value in passes)
    if not lora_rank:
        assert "config.json" in published and "adapter_config.json" not in published
        return
    assert not base.deleted and [v.policy_version for v in registry.versions() if v.deleted]
    assert published == {"adapter_config.json", "adapter_model.safetensors", "sluice_adapter.json"}
    where = Path(newest.checkpoint_uri.removeprefix("file://"), "sluice_adapter.json")
    reference = json.loads(where.read_text())
    assert reference["base_digest"] == read_manifest(base.checkpoint_uri).digest
    assert newest.tags["lora.base_digest"] == reference["base_digest"]  # in the MLflow UI
    adapter_bytes = read_manifest(newest.checkpoint_uri).total_bytes
    assert adapter_bytes < read_manifest(base.checkpoint_uri).total_bytes / 5


def test_resume_of_a_finished_run_says_what_to_raise(prefect_api, tmp_path):
    from sluice.flows.train import ResumeError, train

    config = load_config("default", tiny_run_overrides(tmp_path, **{"trainer.total_steps": 1}))
    train(config, run_id="finished")
    with pytest.raises(ResumeError, match="raise trainer.total_steps"):
        train(config, run_id="finished", resume=True)


def test_a_checkpoint_deleted_after_its_commit_stops_the_run_in_one_line_until_restored(
    prefect_api, tmp_path
):
    """The newest version's weights deleted outside Sluice stop a resumed run in one line
    (no role restarted into it); restored, the run goes on. Version 0's deleted weights
    (old checkpoints expiring) cost nothing: the reward role takes the tokenizer from the
    newest version."""
    import shutil
    from pathlib import Path

    from sluice.flows.train import train
    from sluice.tasks.process.supervisor import CheckpointDamaged

    first = load_config("default", tiny_run_overrides(tmp_path, **{"trainer.total_steps": 2}))
    train(first, run_id="damaged")
    checkpoints = tmp_path / "store" / "damaged" / "checkpoints"
    newest = checkpoints / "v000002" / "model.safetensors"
    kept = tmp_path / "kept.safetensors"
    shutil.move(newest, kept)
    (checkpoints / "v000000" / "model.safetensors").unlink()
    for cache in (
        "trainer",
        "rollout-weights",
        "eval-weights",
        "reward-tokenizer",
    ):  # a new machine
        shutil.rmtree(Path(first.workdir) / "runs" / "damaged" / cache, ignore_errors=True)

    longer = first.model_copy(deep=True)
    longer.trainer.total_steps = 4
    with pytest.raises(CheckpointDamaged) as stopped:
        train(longer, run_id="damaged", resume=True)
    message = str(stopped.value)
    assert message.startswith("run damaged stopped: a committed checkpoint is damaged: ")
    assert "v000002" in message and "model.safetensors" in message and "\n" not in message
    assert message.endswith("restore it, then continue with: sluice train --resume damaged")

    shutil.move(kept, newest)
    resumed = train(longer, run_id="damaged", resume=True)
    assert resumed["final_policy_version"] == 4
