"""The GPU run's script on this machine's CPU: the same commands, to the first training step.

`bash tests/gpu/device_run.sh --cpu` runs what the GPU machine runs after its wheels are
installed (`sluice model import`, `sluice train`, `sluice train --sync`, the table), with
this Python, on the shipped tiny policy and the `default` job, each run stopped after its
first step (trainer.total_steps=1). It starts the temporary Prefect API and the roles'
processes, hence `integration`, and takes about a minute and a half on two idle cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import stop_process_group

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def table_rows(summary: str) -> dict[str, list[str]]:
    """The run table's rows by label: `| label | exit | steps | ... |`."""
    rows = {}
    for line in summary.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 12 and cells[0] in ("async", "sync"):
            rows[cells[0]] = cells
    return rows


def test_the_device_script_reaches_the_first_training_step_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = {
        **os.environ,
        "SLUICE_DEVICE_STATE": str(tmp_path / "state"),
        "SLUICE_DEVICE_PYTHON": sys.executable,
        "OUT": str(out),
    }
    env.pop("PREFECT_HOME", None)  # the script gives the runs a fresh one
    process = subprocess.Popen(
        ["bash", "tests/gpu/device_run.sh", "--cpu"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=900)
    finally:
        stop_process_group(process)
    assert process.returncode == 0, output[-4000:]
    assert "DONE: the table is in summary.md" in output
    rows = table_rows((out / "summary.md").read_text())
    assert set(rows) == {"async", "sync"}, output[-4000:]
    for label, cells in rows.items():
        assert cells[1].startswith("0 "), (label, cells)  # exit status 0
        assert cells[2] == "1", (label, cells)  # the first training step, and no more
        assert cells[5] != "-", (label, cells)  # trained tokens per second
        assert cells[9] != "-", (label, cells)  # held-out reward at versions 0 and 1
    for phase in ("import", "train-async", "train-sync", "report"):
        assert f"[phase {phase}]" in output
    assert {p.name for p in out.iterdir()} == {"device.log", "summary.md", "logs.tar.gz"}
