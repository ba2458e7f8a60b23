"""One trainer per run, on real storage: a second train process on a run whose lease
is held exits with one line naming the holder; on S3 (moto's server) a second
claimant is refused and a released lease is taken at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sluice.infra.lease import LeaseHeld, StorageLease
from sluice.infra.storage import open_filesystem
from sluice.tasks.run.control import LEASE_FILE
from sluice.tasks.run.paths import filesystem, run_paths

pytestmark = pytest.mark.integration


def test_a_second_train_process_on_a_held_run_is_refused(local_run_config, tmp_path) -> None:
    config = local_run_config(tmp_path)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config.model_dump(mode="json")))
    fs, path = filesystem(config, f"{run_paths(config, 'held').control}/{LEASE_FILE}")
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with StorageLease(fs, path, what="the trainer lease of run held", ttl_s=6.0):
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "sluice.tasks.process.worker",
                "train",
                "--config",
                str(config_path),
            ]
            + ["--run-id", "held", "--mlflow-run-id", "none"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert second.returncode != 0
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith("sluice.infra.lease.LeaseHeld: the trainer lease of run held is held by")
    assert f"process {os.getpid()} on" in last


def test_the_lease_on_s3_refuses_a_second_claimant_and_passes_on_release(s3_root) -> None:
    root, options = s3_root
    fs, path = open_filesystem(f"{root}/_control/{LEASE_FILE}", options)
    first = StorageLease(fs, path, what="the trainer lease of run s3", ttl_s=3.0)
    first.acquire()
    with pytest.raises(LeaseHeld):
        StorageLease(fs, path, what="the trainer lease of run s3", ttl_s=3.0).acquire()
    first.release()
    second = StorageLease(fs, path, what="the trainer lease of run s3", ttl_s=3.0)
    second.acquire()
    assert json.loads(fs.cat_file(path))["owner"] == second.owner
    second.release()
