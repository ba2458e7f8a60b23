"""Two runs never share a run id: generated ids differ within one second, and a new run
under an id that already has files is refused before anything is written."""

from __future__ import annotations

import pytest

from sluice.flows.run_claim import RunIdTaken, claim_new_run, new_run_id
from sluice.tasks.run.paths import read_json, run_paths


def test_two_runs_of_one_name_started_together_get_two_ids(local_run_config, tmp_path) -> None:
    config = local_run_config(tmp_path)
    ids = {new_run_id(config) for _ in range(20)}
    assert len(ids) == 20
    assert all(i.startswith(f"{config.name}-") for i in ids)


def test_a_new_run_under_a_used_id_is_refused_and_the_old_run_keeps_its_files(
    local_run_config, tmp_path
) -> None:
    config = local_run_config(tmp_path)
    claim_new_run(config, "r1")
    claim = read_json(config, f"{run_paths(config, 'r1').control}/run.json")
    assert claim is not None
    with pytest.raises(RunIdTaken, match="already has files .* --resume r1"):
        claim_new_run(config, "r1")
    assert read_json(config, f"{run_paths(config, 'r1').control}/run.json") == claim
    claim_new_run(config, "r2")  # another id is free
