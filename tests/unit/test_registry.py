"""Checkpoint registry and tracking helpers against a real MLflow sqlite store.

One sqlite database per module (creating MLflow's tables costs seconds); every test
registers its own model name or run, so tests stay independent. Checkpoints are real
Hugging Face-style directories (config.json, safetensors, tokenizer.json) on local disk.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from sluice.infra.checkpoints import (  # noqa: E402
    MANIFEST_NAME,
    CheckpointIncomplete,
    save_checkpoint,
    verify_checkpoint,
)
from sluice.infra.policy_version import TAG_EVAL_REWARD, eval_tag  # noqa: E402
from sluice.infra.registry import (  # noqa: E402
    CheckpointRegistry,
    PolicyVersionConflict,
    RegistryError,
)
from sluice.infra.tracking import (  # noqa: E402
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    TrackingError,
    TrackingUnavailable,
    end_run,
    flatten_config,
    get_client,
    get_metric_history,
    log_artifact_file,
    log_config,
    log_figure_png,
    log_metrics,
    run_ui_url,
    start_or_resume_run,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def registry(tracking_uri: str) -> CheckpointRegistry:
    return CheckpointRegistry(tracking_uri, f"policy-{uuid.uuid4().hex[:8]}")


def make_hf_dir(path: Path, seed: int) -> Path:
    """A small Hugging Face-style model directory whose weights depend on `seed`."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "seed": seed}))
    save_file(
        {"model.embed_tokens.weight": rng.standard_normal((16, 8), dtype=np.float32)},
        str(path / "model.safetensors"),
    )
    return path


def committed_checkpoint(tmp_path: Path, version: int, seed: int | None = None) -> str:
    source = make_hf_dir(tmp_path / f"src-{version}-{uuid.uuid4().hex[:6]}", seed or version)
    return save_checkpoint(source, str(tmp_path / "ckpts" / f"v{version:06d}"))


# ---------------------------------------------------------------- commit


def test_commit_creates_a_tagged_version_and_moves_the_alias(registry, tmp_path):
    uri = committed_checkpoint(tmp_path, 1)
    committed = registry.commit(
        1, uri, run_id="run-abc", tags={"staleness.mean": 0.5}, trainer_step=4
    )

    assert committed.policy_version == 1
    assert committed.checkpoint_uri == uri
    assert committed.trainer_step == 4
    assert committed.run_id == "run-abc"
    assert committed.checkpoint_digest == verify_checkpoint(uri).digest
    assert committed.tags["sluice.policy_version"] == "1"
    assert committed.tags["sluice.trainer_step"] == "4"
    assert committed.tags["sluice.run_id"] == "run-abc"
    assert committed.tags["staleness.mean"] == "0.5"
    assert registry.newest_servable() == committed
    assert registry.get(1) == committed
    assert registry.get(2) is None


@pytest.mark.parametrize("damage", ["no_manifest", "truncated_safetensors", "missing_tokenizer"])
def test_incomplete_checkpoint_is_refused_and_nothing_is_registered(registry, tmp_path, damage):
    uri = committed_checkpoint(tmp_path, 1)
    ckpt = tmp_path / "ckpts" / "v000001"
    if damage == "no_manifest":
        (ckpt / MANIFEST_NAME).unlink()
        message = "no sluice_manifest.json"
    elif damage == "truncated_safetensors":
        weights = ckpt / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:64])
        message = "model.safetensors has 64 bytes"
    else:
        (ckpt / "tokenizer.json").unlink()
        message = "tokenizer.json is missing"

    with pytest.raises(CheckpointIncomplete, match=message):
        registry.commit(1, uri)
    assert registry.versions() == []
    assert registry.newest_servable() is None


def test_a_checkpoint_becomes_committable_only_once_its_manifest_lands(registry, tmp_path):
    source = make_hf_dir(tmp_path / "src", seed=3)
    # Seal in place, then withdraw the manifest: this is the directory mid-upload.
    uri = save_checkpoint(source, str(source))
    manifest = (source / MANIFEST_NAME).read_bytes()
    (source / MANIFEST_NAME).unlink()
    with pytest.raises(CheckpointIncomplete):
        registry.commit(1, uri)
    assert registry.versions() == []
    (source / MANIFEST_NAME).write_bytes(manifest)
    assert registry.commit(1, uri).policy_version == 1


def test_commit_retry_returns_the_existing_version(registry, tmp_path):
    uri = committed_checkpoint(tmp_path, 1)
    first = registry.commit(1, uri, tags={"a": 1})
    again = registry.commit(1, uri, tags={"a": 1})
    assert again.model_version == first.model_version
    assert [v.policy_version for v in registry.versions()] == [1]


def test_retry_after_a_crash_before_the_alias_moved_finishes_the_commit(
    registry, tmp_path, monkeypatch
):
    registry.commit(1, committed_checkpoint(tmp_path, 1))
    uri2 = committed_checkpoint(tmp_path, 2)

    def crash(_committed):
        raise ConnectionError("trainer killed")

    with monkeypatch.context() as patch:
        patch.setattr(registry, "_move_alias_forward", crash)
        with pytest.raises(ConnectionError):
            registry.commit(2, uri2)
    assert registry.newest_servable().policy_version == 1  # version 2 exists, alias did not move

    retried = registry.commit(2, uri2)
    assert registry.newest_servable() == retried
    assert [v.policy_version for v in registry.versions()] == [1, 2]


def test_sync_alias_moves_a_lagging_alias_to_the_newest_version(registry, tmp_path, monkeypatch):
    registry.commit(1, committed_checkpoint(tmp_path, 1))
    with monkeypatch.context() as patch:
        patch.setattr(registry, "_move_alias_forward", lambda _c: None)
        registry.commit(2, committed_checkpoint(tmp_path, 2))
    assert registry.newest_servable().policy_version == 1
    assert registry.sync_alias().policy_version == 2
    assert registry.newest_servable().policy_version == 2


def test_alias_never_moves_backwards(registry, tmp_path):
    registry.commit(3, committed_checkpoint(tmp_path, 3))
    for stale in (2, 3):
        uri = committed_checkpoint(tmp_path, 100 + stale, seed=100 + stale)
        with pytest.raises(PolicyVersionConflict, match="only move forward|already committed"):
            registry.commit(stale, uri)
    assert registry.newest_servable().policy_version == 3
    assert [v.policy_version for v in registry.versions()] == [3]


def test_a_committed_policy_version_cannot_be_re_pointed_at_other_weights(registry, tmp_path):
    registry.commit(1, committed_checkpoint(tmp_path, 1))
    registry.commit(2, committed_checkpoint(tmp_path, 2))
    other = committed_checkpoint(tmp_path, 50, seed=50)
    with pytest.raises(PolicyVersionConflict, match="policy version 1 is already committed"):
        registry.commit(1, other)


def test_bad_commit_arguments_give_clear_errors(registry, tmp_path):
    uri = committed_checkpoint(tmp_path, 1)
    with pytest.raises(ValueError, match="policy_version must be an int >= 0"):
        registry.commit(-1, uri)
    with pytest.raises(ValueError, match="set by the registry itself"):
        registry.commit(1, uri, tags={"sluice.policy_version": "9"})
    assert registry.versions() == []


def test_set_tag_annotates_a_committed_version(registry, tmp_path):
    registry.commit(1, committed_checkpoint(tmp_path, 1))
    registry.set_tag(1, eval_tag("pass_at_1"), 0.41)
    assert registry.get(1).tags["sluice.eval.pass_at_1"] == "0.41"
    with pytest.raises(RegistryError, match="policy version 7 .* is not committed"):
        registry.set_tag(7, eval_tag("pass_at_1"), 0.1)
    with pytest.raises(ValueError, match="cannot be changed"):
        registry.set_tag(1, "sluice.policy_version", "5")


def test_evaluation_tags_of_runs_scored_before_the_sluice_prefix_are_still_read(registry, tmp_path):
    registry.commit(1, committed_checkpoint(tmp_path, 1))
    registry.commit(2, committed_checkpoint(tmp_path, 2))
    registry.set_tag(1, "eval.reward", "0.25")  # as the evaluate role tagged versions before
    registry.set_tag(1, "eval.pass_at_4", "0.5")
    registry.set_tag(2, "eval.reward", "0.1")
    registry.set_tag(2, TAG_EVAL_REWARD, "0.3")  # scored again since: the new tag wins
    old, rescored = registry.versions()
    assert old.tags[TAG_EVAL_REWARD] == "0.25" and old.tags["eval.reward"] == "0.25"
    assert old.tags[eval_tag("pass_at_4")] == "0.5"
    assert rescored.tags[TAG_EVAL_REWARD] == "0.3"


@pytest.fixture
def mlflow_uri(tracking_uri):
    """MLflow's own process-wide tracking URI, which `models:/` URIs resolve against (what a
    user's script sets with `mlflow.set_tracking_uri`); restored afterwards."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(tracking_uri):
        yield tracking_uri


def checkpoint_files(uri: str) -> dict[str, bytes]:
    root = Path(uri.removeprefix("file://"))
    return {p.name: p.read_bytes() for p in root.iterdir()}


def test_the_default_alias_resolves_as_typed_in_a_models_uri(registry, tmp_path, mlflow_uri):
    import mlflow

    registry.commit(1, committed_checkpoint(tmp_path, 1))
    newest = registry.commit(2, committed_checkpoint(tmp_path, 2))
    assert registry.alias == registry.mlflow_alias == "newest"
    uri = f"models:/{registry.model_name}@newest"
    path = mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "download"))
    assert checkpoint_files(path) == checkpoint_files(newest.checkpoint_uri)


def test_a_run_from_before_newest_still_resolves_through_sluice_latest(tracking_uri, tmp_path):
    name = f"policy-{uuid.uuid4().hex[:8]}"
    before = CheckpointRegistry(tracking_uri, name, alias="latest")  # the old default
    assert before.mlflow_alias == "sluice-latest"
    before.commit(1, committed_checkpoint(tmp_path, 1))
    # Runs of that time had no durable alias (every version was durable).
    before._client.delete_registered_model_alias(name, before.durable_alias)

    now = CheckpointRegistry(tracking_uri, name)  # opened under the new default
    assert now.newest_servable().policy_version == 1
    assert now.newest_durable().policy_version == 1  # read through the servable alias
    assert now.aliased_versions() == {"sluice-latest": 1}
    now.commit(2, committed_checkpoint(tmp_path, 2))
    # The configured alias took over at the move, and the other went with it...
    assert now.aliased_versions() == {"newest": 2, "newest-durable": 2}
    assert now.newest_servable().policy_version == 2
    # ...while a reader with the run's old config still finds the newest version.
    assert before.newest_servable().policy_version == 2


def test_a_custom_alias_is_never_read_through_the_default_names(registry, tmp_path):
    registry.commit(1, committed_checkpoint(tmp_path, 1))
    champion = CheckpointRegistry(registry.tracking_uri, registry.model_name, "champion")
    assert champion.newest_servable() is None


def test_reserved_mlflow_alias_names_are_stored_under_a_prefix(tracking_uri):
    assert (
        CheckpointRegistry(tracking_uri, "alias-a", alias="latest").mlflow_alias == "sluice-latest"
    )
    assert CheckpointRegistry(tracking_uri, "alias-a", alias="v3").mlflow_alias == "sluice-v3"
    assert CheckpointRegistry(tracking_uri, "alias-a", alias="champion").mlflow_alias == "champion"
    with pytest.raises(ValueError, match="must be 1-200 letters"):
        CheckpointRegistry(tracking_uri, "alias-a", alias="bad alias")


def test_polling_sees_only_durable_versions_in_increasing_order(registry, tmp_path):
    """A poller never sees a version before its files, nor the version number going back."""
    poller = CheckpointRegistry(registry.tracking_uri, registry.model_name, registry.alias)
    seen: list[tuple[int, str]] = []
    failures: list[str] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            latest = poller.newest_servable()
            if latest is not None:
                try:
                    verify_checkpoint(latest.checkpoint_uri)
                except CheckpointIncomplete as exc:
                    failures.append(str(exc))
                seen.append((latest.policy_version, latest.checkpoint_uri))
            done.wait(0.002)  # poll fast, but leave the committer some CPU

    thread = threading.Thread(target=poll)
    thread.start()
    rng = random.Random(7)
    version = 0
    committed = []
    try:
        for _ in range(8):
            version += rng.randint(1, 3)
            if rng.random() < 0.3:  # an upload that has not finished: must be refused
                broken = tmp_path / f"broken-{version}"
                save_checkpoint(make_hf_dir(tmp_path / f"bsrc-{version}", version), str(broken))
                (broken / MANIFEST_NAME).unlink()
                with pytest.raises(CheckpointIncomplete):
                    registry.commit(version, str(broken))
            committed.append(registry.commit(version, committed_checkpoint(tmp_path, version)))
            assert registry.newest_servable() == committed[-1]
    finally:
        done.set()
        thread.join()

    assert failures == []
    observed = [v for v, _ in seen]
    assert observed == sorted(observed)
    assert set(observed) <= {c.policy_version for c in committed}
    assert [c.policy_version for c in registry.versions()] == [c.policy_version for c in committed]
    assert poller.newest_servable() == committed[-1]


def test_unreachable_tracking_server_gives_one_clear_error(tmp_path):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    with pytest.raises(TrackingUnavailable, match=f"MLflow tracking server {uri} is unreachable"):
        CheckpointRegistry(uri, "policy")
    (tmp_path / "a_file").write_text("")
    bad_sqlite = f"sqlite:///{tmp_path}/a_file/mlflow.db"
    with pytest.raises(TrackingUnavailable, match=bad_sqlite):
        CheckpointRegistry(bad_sqlite, "policy")


# ---------------------------------------------------------------- tracking


def test_experiments_are_marked_as_model_training_for_the_mlflow_ui(tracking_uri):
    client = get_client(tracking_uri)
    run_id = start_or_resume_run(tracking_uri, "exp-kind-new", "r")
    experiment = client.get_experiment_by_name("exp-kind-new")
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    assert run_ui_url(tracking_uri, run_id).endswith(
        f"/#/experiments/{experiment.experiment_id}/runs/{run_id}?workflowType=machine_learning"
    )

    # Made before Sluice tagged them, or marked GenAI: tagged when Sluice next uses them,
    # by name or through a run resumed by id; a kind a person chose for training stays.
    before = client.create_experiment("exp-kind-old")
    genai = client.create_experiment(
        "exp-kind-genai", tags={EXPERIMENT_KIND_TAG: "genai_development"}
    )
    chosen = client.create_experiment("exp-kind-chosen", tags={EXPERIMENT_KIND_TAG: "finetuning"})
    start_or_resume_run(tracking_uri, "exp-kind-old", "r")
    by_id = client.create_run(genai).info.run_id
    start_or_resume_run(tracking_uri, "ignored", "r", run_id=by_id)
    start_or_resume_run(tracking_uri, "exp-kind-chosen", "r")
    kinds = [client.get_experiment(e).tags[EXPERIMENT_KIND_TAG] for e in (before, genai, chosen)]
    assert kinds == [EXPERIMENT_KIND, EXPERIMENT_KIND, "finetuning"]


def test_ui_command_starts_the_ui_without_job_runners():
    from sluice.infra.config.tracking import ui_command

    assert ui_command("sqlite:///.sluice/mlflow.db") == (
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui "
        "--backend-store-uri sqlite:///.sluice/mlflow.db --workers 1"
    )
    assert "'sqlite:////tmp/my runs/mlflow.db'" in ui_command("sqlite:////tmp/my runs/mlflow.db")
    assert ui_command("http://mlflow:5000/").startswith("http://mlflow:5000 ")


def test_runs_resume_by_name_until_finished(tracking_uri):
    name = f"run-{uuid.uuid4().hex[:6]}"
    first = start_or_resume_run(tracking_uri, "exp-resume", name)
    assert start_or_resume_run(tracking_uri, "exp-resume", name) == first
    end_run(tracking_uri, first, "FAILED")  # a crash: the restarted flow picks it up
    assert start_or_resume_run(tracking_uri, "exp-resume", name) == first
    run = get_client(tracking_uri).get_run(first)
    assert run.info.status == "RUNNING"
    assert run.data.tags["sluice.resume_count"] == "2"  # created once, resumed twice

    end_run(tracking_uri, first, "FINISHED")
    second = start_or_resume_run(tracking_uri, "exp-resume", name)
    assert second != first
    assert start_or_resume_run(tracking_uri, "exp-resume", "ignored", run_id=first) == first
    with pytest.raises(TrackingError, match="MLflow run 'nope' not found"):
        start_or_resume_run(tracking_uri, "exp-resume", name, run_id="nope")


def test_log_metrics_skips_undefined_values_and_reads_back(tracking_uri):
    run_id = start_or_resume_run(tracking_uri, "exp-metrics", f"m-{uuid.uuid4().hex[:6]}")
    logged = log_metrics(
        tracking_uri,
        run_id,
        {"reward": 0.25, "acc": None, "kl": math.nan, "ppl": math.inf, "len": np.float32(7.0)},
        step=3,
    )
    assert logged == 2
    log_metrics(tracking_uri, run_id, {"reward": 0.5, "kl": 0.01}, step=4)
    assert get_metric_history(tracking_uri, run_id, "reward") == [(3, 0.25), (4, 0.5)]
    assert get_metric_history(tracking_uri, run_id, "kl") == [(4, 0.01)]
    assert get_metric_history(tracking_uri, run_id, "acc") == []
    assert get_metric_history(tracking_uri, run_id, "len") == [(3, 7.0)]

    with pytest.raises(ValueError, match="metric 'bad' has a non-numeric value 'x'"):
        log_metrics(tracking_uri, run_id, {"bad": "x"}, step=5)
    with pytest.raises(ValueError, match="step must be an int"):
        log_metrics(tracking_uri, run_id, {"reward": 1.0}, step=1.5)  # type: ignore[arg-type]


def test_log_metrics_splits_batches_over_mlflow_limits(tracking_uri):
    run_id = start_or_resume_run(tracking_uri, "exp-metrics", f"b-{uuid.uuid4().hex[:6]}")
    metrics = {f"layer{i}.grad_norm": float(i) for i in range(1500)}
    assert log_metrics(tracking_uri, run_id, metrics, step=0) == 1500
    assert get_client(tracking_uri).get_run(run_id).data.metrics == metrics


def test_log_metrics_from_another_process_lands_in_the_same_run(tracking_uri):
    run_id = start_or_resume_run(tracking_uri, "exp-metrics", f"p-{uuid.uuid4().hex[:6]}")
    code = (
        "from sluice.infra.tracking import log_metrics;"
        f"log_metrics({tracking_uri!r}, {run_id!r}, {{'trainer.loss': 1.25}}, step=9)"
    )
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert get_metric_history(tracking_uri, run_id, "trainer.loss") == [(9, 1.25)]


def test_log_config_flattens_params_and_stores_the_resolved_yaml(tracking_uri, tmp_path):
    import yaml

    run_id = start_or_resume_run(tracking_uri, "exp-config", f"c-{uuid.uuid4().hex[:6]}")
    config = {
        "trainer": {"lr": 0.001, "loss": {"decoupled": True}},
        "rollout": {"urls": ["a", "b"]},
    }
    assert log_config(tracking_uri, run_id, config) == []

    client = get_client(tracking_uri)
    assert client.get_run(run_id).data.params == {
        "trainer.lr": "0.001",
        "trainer.loss.decoupled": "True",
        "rollout.urls": '["a", "b"]',
    }
    path = client.download_artifacts(run_id, "config/resolved_config.yaml", str(tmp_path))
    assert yaml.safe_load(Path(path).read_text()) == config

    # Resumed with a changed learning rate: params are immutable, the change is reported
    # and the new config is kept beside the old one.
    changed = {**config, "trainer": {"lr": 0.002, "loss": {"decoupled": True}}}
    assert log_config(tracking_uri, run_id, changed) == ["trainer.lr"]
    assert client.get_run(run_id).data.params["trainer.lr"] == "0.001"
    names = [a.path for a in client.list_artifacts(run_id, "config")]
    assert "config/resolved_config.yaml" in names and len(names) == 2


def test_flatten_config_accepts_the_run_config_model():
    from sluice.infra.config.run import RunConfig

    flat = flatten_config(RunConfig())
    assert flat["staleness.max_staleness"] == "4"
    assert flat["trainer.loss.decoupled"] == "True"
    assert flat["rollout.server_urls"] == "[]"


def test_artifacts_and_figures_are_stored_in_the_run(tracking_uri, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    run_id = start_or_resume_run(tracking_uri, "exp-artifacts", f"a-{uuid.uuid4().hex[:6]}")
    note = tmp_path / "summary.json"
    note.write_text('{"reward": 0.5}')
    log_artifact_file(tracking_uri, run_id, note, "reports")
    figure, axis = plt.subplots()
    axis.plot([0, 1, 2], [0.1, 0.3, 0.2])
    log_figure_png(tracking_uri, run_id, figure, "plots/reward.png")
    plt.close(figure)

    client = get_client(tracking_uri)
    assert [a.path for a in client.list_artifacts(run_id, "reports")] == ["reports/summary.json"]
    png = Path(client.download_artifacts(run_id, "plots/reward.png", str(tmp_path)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        log_artifact_file(tracking_uri, run_id, tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="must end with .png"):
        log_figure_png(tracking_uri, run_id, figure, "plots/reward.jpg")
