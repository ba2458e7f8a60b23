"""Promoting a run's committed version into a long-lived registered model (a model line),
against a real MLflow sqlite store: the version, its tags and alias, loading it through
``models:/NAME@ALIAS``, the refusals, `tracking.promote_final_to` and `sluice promote`.

One sqlite store per module (``tracking_uri``); every test promotes from its own run
into its own line, so tests stay independent.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from sluice.flows.cli import main
from sluice.flows.promote import promote, promote_final
from sluice.infra.checkpoints import save_checkpoint
from sluice.infra.config.overrides import ConfigError
from sluice.infra.model_line import (
    TAG_SOURCE_MODEL_VERSION,
    TAG_SOURCE_POLICY_VERSION,
    TAG_SOURCE_RUN,
    PromotionError,
)
from sluice.infra.policy_version import TAG_CHECKPOINT_DIGEST
from sluice.infra.tracking import get_client
from sluice.tasks.run.paths import registered_model_name, run_paths, run_registry
from tests.unit.test_registry import checkpoint_files, make_hf_dir


@pytest.fixture
def config(local_run_config, tracking_uri, tmp_path):
    return local_run_config(tmp_path, f"tracking.uri={tracking_uri}")


@pytest.fixture
def run(config, tmp_path):
    """A run with policy versions 0, 1 and 2 committed."""
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    registry = run_registry(config, run_id)
    checkpoints = run_paths(config, run_id)  # a run's registry reads no other source
    for version in range(3):
        source = make_hf_dir(tmp_path / f"src-{run_id}-{version}", version)
        uri = save_checkpoint(source, checkpoints.checkpoint(version))
        registry.commit(version, uri, run_id=None)
    return run_id


def line_name() -> str:
    return f"line-{uuid.uuid4().hex[:8]}"


def test_promote_adds_a_tagged_version_whose_alias_loads_the_checkpoint(config, run, tmp_path):
    import mlflow
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    line = line_name()
    promoted = promote(config, run, 1, f"{line}@champion")

    source = run_registry(config, run).get(1)
    client = get_client(config.tracking.uri)
    version = client.get_model_version_by_alias(line, "champion")
    assert int(version.version) == promoted.model_version == 1 and promoted.created
    assert version.source == source.checkpoint_uri
    assert version.tags == {
        TAG_SOURCE_RUN: run,
        TAG_SOURCE_POLICY_VERSION: "1",
        TAG_SOURCE_MODEL_VERSION: f"models:/{registered_model_name(config, run)}/2",
        TAG_CHECKPOINT_DIGEST: source.checkpoint_digest,
    }
    assert source.kept  # retention keeps what the line points at
    with _use_tracking_uri(config.tracking.uri):
        path = mlflow.artifacts.download_artifacts(
            f"models:/{line}@champion", dst_path=str(tmp_path / "download")
        )
    assert checkpoint_files(path) == checkpoint_files(source.checkpoint_uri)
    # The run's own books are untouched: a line's version is no committed policy version.
    assert [v.policy_version for v in run_registry(config, run).versions()] == [0, 1, 2]


def test_promoting_again_reuses_the_version_and_aliases_move_anywhere(config, run):
    line = line_name()
    newest = promote(config, run, None, f"{line}@champion")  # None: the newest version
    older = promote(config, run, 0, f"{line}@champion")  # a rollback
    again = promote(config, run, None, line)
    assert (newest.source.policy_version, older.source.policy_version) == (2, 0)
    assert again.model_version == newest.model_version and not again.created
    client = get_client(config.tracking.uri)
    assert client.get_registered_model(line).aliases == {"champion": older.model_version}
    assert len(client.search_model_versions(f"name = '{line}'")) == 2


def test_a_version_retention_deleted_is_refused_in_one_line(config, run):
    run_registry(config, run).mark_deleted(0)
    line = line_name()
    with pytest.raises(PromotionError, match="retention deleted its checkpoint") as refused:
        promote(config, run, 0, f"{line}@champion")
    assert "\n" not in str(refused.value)
    assert not get_client(config.tracking.uri).search_registered_models(f"name = '{line}'")


def test_bad_targets_runs_and_versions_are_refused(config, run, local_run_config, tmp_path):
    with pytest.raises(ValueError, match="reserved by MLflow"):
        promote(config, run, 1, "line@latest")
    with pytest.raises(PromotionError, match="own registered model"):
        promote(config, run, 1, registered_model_name(config, run))
    with pytest.raises(PromotionError, match="no policy version 9"):
        promote(config, run, 9, line_name())
    with pytest.raises(PromotionError, match="has no registered model"):
        promote(config, "no-such-run", None, line_name())
    with pytest.raises(ConfigError, match="reserved by MLflow"):
        local_run_config(tmp_path, "tracking.promote_final_to=line@v2")


def test_promote_final_to_promotes_the_final_version_when_set(config, run, capsys):
    assert promote_final(config, run) is None  # the key unset: nothing
    line = line_name()
    config.tracking.promote_final_to = f"{line}@candidate"
    promoted = promote_final(config, run)
    assert promoted.source.policy_version == 2 and promoted.target.alias == "candidate"
    assert f"models:/{line}@candidate" in capsys.readouterr().out

    run_registry(config, run).mark_deleted(2)  # fails: reported, the run is not failed
    config.tracking.promote_final_to = line_name()
    assert promote_final(config, run) is None
    assert f"sluice promote {run} --to" in capsys.readouterr().err


def test_sluice_promote_prints_what_it_did_or_one_error_line(config, run, capsys):
    saved = Path(config.workdir) / "runs" / run / "config.json"
    saved.parent.mkdir(parents=True)
    saved.write_text(json.dumps(config.model_dump(mode="json")))
    where = [f"--set=workdir={config.workdir}"]
    line = line_name()

    assert main(["promote", run, "--version", "1", "--to", f"{line}@a", *where]) == 0
    assert f'download_artifacts("models:/{line}@a")' in capsys.readouterr().out

    run_registry(config, run).mark_deleted(0)
    # RUN and the workdir as bare words work too, as for `sluice status`.
    assert main(["promote", f"workdir={config.workdir}", run, "--version", "0", "--to", line]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sluice: error: policy version 0 of run") and err.count("\n") == 1
    with pytest.raises(SystemExit):
        main(["promote", "--to", "a/b"])
