"""`sluice status [RUN]`: where a run stands, read from the run's own files.

The run folder is built by the functions a run writes it with: the flow's resolved
config (`write_resolved_config`), each role's status document (`StatusReporter`), the
flow's stop marker (`RunControl.mark_done`), and role logs written by real role-like
processes: a child interpreter with the roles' log format (`configure_logging`) whose
output goes to its log file, as the supervisor starts a role, and which may crash.
No Prefect, no MLflow: `sluice status` must answer without them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from sluice.flows import cli_status
from sluice.flows.cli import main
from sluice.flows.run_claim import write_resolved_config
from sluice.infra.config.run import RunConfig
from sluice.tasks.run import metrics_file
from sluice.tasks.run.control import RunControl
from sluice.tasks.run.metrics_file import METRICS_FILE, append_step
from sluice.tasks.run.paths import run_paths
from sluice.tasks.run.state_timer import OTHER, StateTimer
from sluice.tasks.run.status import StatusReporter, flow_reporter

ROLE_PROCESS = """
import json, logging, sys
from sluice.infra.config.run import RunConfig
from sluice.tasks.run.logs import configure_logging
from sluice.tasks.run.paths import run_paths
from sluice.tasks.run.status import StatusReporter

config_path, run_id, role, fields, messages, crash = sys.argv[1:]
config = RunConfig.model_validate_json(open(config_path).read())
configure_logging(role)
if fields != "null":
    StatusReporter(config, run_paths(config, run_id), role).update(force=True, **json.loads(fields))
for message in json.loads(messages):
    logging.getLogger("sluice").info(message)
if crash:
    raise RuntimeError(crash)
"""


def run_role_process(
    config: RunConfig,
    run_id: str,
    role: str,
    status: dict[str, Any] | None = None,
    messages: Sequence[str] = (),
    crash: str = "",
) -> Path:
    """A process that logs like role `role` to the run's log of it (appending, as the
    supervisor opens it), writes `status` as its document and crashes with `crash`."""
    run_dir = Path(config.workdir) / "runs" / run_id
    log = run_dir / "logs" / f"{role}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    args = [str(run_dir / "config.json"), run_id, role, json.dumps(status), json.dumps(messages)]
    with log.open("ab") as output:
        subprocess.run(
            [sys.executable, "-c", ROLE_PROCESS, *args, crash],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            check=False,
            timeout=120,
        )
    return log


def report(config: RunConfig, run_id: str, role: str, **fields: Any) -> None:
    """A role's status document, written by this (living) process."""
    StatusReporter(config, run_paths(config, run_id), role).update(force=True, **fields)


def start_run(config: RunConfig, run_id: str) -> Path:
    """The run's folder as the flow leaves it before any role starts."""
    return write_resolved_config(config, run_id).parent


@pytest.fixture(scope="module")
def failed_run(
    local_run_config: Callable[..., RunConfig], tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunConfig, str]:
    """A run at step 7 whose train role crashed and which the flow is stopping."""
    config = local_run_config(tmp_path_factory.mktemp("status"))
    run_id = "demo-20261127-090000-ab12"
    start_run(config, run_id)
    run_role_process(config, run_id, "rollout", messages=["serving policy version 7"])
    report(
        config, run_id, "rollout", state="running", policy_version=7, tokens_per_s=5231.4,
        idle_ratio=0.4, threads=1,
    )  # fmt: skip
    report(config, run_id, "reward", state="waiting", groups_scored=120)
    report(config, run_id, "evaluate", state="running", last_version=5, last_reward=0.38)
    run_role_process(
        config,
        run_id,
        "train",
        status={
            "state": "running",
            "step": 7,
            "reward_mean": 0.41234,
            "staleness_mean": 1.25,
            "trained_tokens_per_s": 1022.2,
            "idle_ratio": 0.12,
            "newest_servable_version": 7,
            "newest_durable_version": 4,
            "versions_at_risk": 3,
            "durability_lag_s": 12.4,
            "durability_skipped": 1,
        },
        messages=["step 7: reward 0.412, staleness 1.25, loss 0.0100"],
        crash="CUDA out of memory",
    )
    RunControl(config, run_paths(config, run_id)).mark_done("role failed: train")
    return config, run_id


def sections(lines: list[str]) -> list[list[str]]:
    """The output's blocks: the run's numbers, the roles' table, each failed role's line."""
    blocks: list[list[str]] = [[]]
    for line in lines:
        if line:
            blocks[-1].append(line)
        else:
            blocks.append([])
    return blocks


def status_lines(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    code = main(["status", *args])
    captured = capsys.readouterr()
    return code, (captured.out if code == 0 else captured.err).splitlines()


def test_status_prints_the_progress_numbers_each_role_and_the_failed_roles_newest_line(
    failed_run, capsys
):
    config, run_id = failed_run
    code, lines = status_lines(capsys, "--set", f"workdir={config.workdir}")  # newest run
    assert code == 0
    numbers, roles = sections(lines)[:2]
    rows = {line.split("  ", 1)[0]: line.split("  ", 1)[1].strip() for line in numbers}
    assert rows["run"] == run_id
    assert rows["step"] == f"7/{config.trainer.total_steps}"
    assert rows["policy version"] == "7"
    assert rows["reward"] == "0.412 (training batch mean)"
    assert rows["held-out reward"] == "0.380 at version 5"
    assert rows["staleness"] == "1.25 versions (batch mean)"
    assert rows["tokens/s"] == "5231 generated, 1022 trained"
    assert rows["idle"].startswith("trainer 12% (waiting for data), rollout 40%")
    assert rows["versions"] == (
        "servable 7, durable 4 (3 at risk; durability 12 s behind, 1 skipped)"
    )
    assert rows["stopping"].startswith("role failed: train")  # the flow stops the others
    assert {line.split()[0]: line.split()[1] for line in roles[1:]} == {
        "rollout": "running",
        "reward": "waiting",
        "train": "failed",
        "evaluate": "running",
    }
    failed = lines.index(next(line for line in lines if line.startswith("train failed;")))
    assert lines[failed + 1].strip() == "RuntimeError: CUDA out of memory"
    assert "rollout failed" not in "\n".join(lines)  # only failed roles show their log


def test_a_role_whose_process_is_gone_without_a_stop_marker_is_shown_as_died(
    local_run_config, tmp_path, capsys
):
    config = local_run_config(tmp_path)
    start_run(config, "r1")
    run_role_process(
        config, "r1", "reward", status={"state": "running"}, messages=["scoring"], crash="boom"
    )
    report(config, "r1", "train", state="running", step=2)  # this process: alive
    code, lines = status_lines(capsys, "r1", f"workdir={config.workdir}")  # bare KEY=VALUE
    assert code == 0
    roles = {line.split()[0]: line.split()[1] for line in sections(lines)[1][1:]}
    assert roles == {"reward": "died", "train": "running"}
    assert lines[-1].strip() == "RuntimeError: boom"


def test_a_run_no_role_has_reported_for_says_so(local_run_config, tmp_path, capsys):
    config = local_run_config(tmp_path)
    start_run(config, "fresh")
    code, lines = status_lines(capsys, "fresh", "--set", f"workdir={config.workdir}")
    assert code == 0
    assert lines[0].split() == ["run", "fresh"]
    assert lines[-1] == "no role has reported yet"


def test_a_run_that_does_not_exist_gives_one_error_line_and_exit_2(failed_run, capsys):
    config, run_id = failed_run
    code, lines = status_lines(capsys, "nope-123", "--set", f"workdir={config.workdir}")
    assert code == 2
    assert len(lines) == 1 and "run 'nope-123' not found" in lines[0] and run_id in lines[0]
    # With no run at all, the line says what a run was wanted for.
    code, lines = status_lines(capsys, "--set", f"workdir={config.workdir}/empty")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("sluice: error: no runs to show")


def test_status_answers_within_a_second_without_prefect_mlflow_or_torch(failed_run):
    config, run_id = failed_run
    # CPU seconds, not wall: the answer must not depend on how busy the machine is.
    probe = (
        "import sys, time; from sluice.flows.cli import main; started = time.process_time(); "
        f"code = main(['status', {run_id!r}, 'workdir={config.workdir}']); "
        "took = time.process_time() - started; "
        "heavy = [m for m in ('prefect', 'mlflow', 'torch') if m in sys.modules]; "
        "print('RESULT', code, took, heavy)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    _, code, took, heavy = result.split(" ", 3)
    assert (code, heavy) == ("0", "[]"), proc.stderr
    assert float(took) < 1.0  # finding and reading the run; the interpreter's start-up on top


def test_before_any_role_reports_status_says_what_the_flow_is_doing(
    local_run_config, tmp_path, capsys
):
    config = local_run_config(tmp_path)
    start_run(config, "sft")
    # What the flow's supervised pass writes with each progress line (tasks/run/prepare.py).
    flow_reporter(config, run_paths(config, "sft")).update(
        state="preparing", activity="supervised pass: step 40, minute 3, loss 1.2345"
    )
    code, lines = status_lines(capsys, "sft", "--set", f"workdir={config.workdir}")
    assert code == 0
    assert lines[-2].startswith("no role has reported yet; the flow is preparing, for ")
    assert lines[-1].startswith("  supervised pass: step 40, minute 3, loss 1.2345 (updated ")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_status_shows_each_roles_time_split_and_the_mean_training_step(
    local_run_config, tmp_path, capsys
):
    config = local_run_config(tmp_path)
    run_dir = start_run(config, "timed")
    clock, cpu = Clock(), Clock()
    rollout = StateTimer(("generate", "idle"), clock=clock, cpu_clock=cpu, cores=2)
    train = StateTimer(("wait_data", "train"), clock=clock, cpu_clock=cpu, cores=2)
    steps = []
    for wait, step in ((1.0, 3.0), (0.0, 4.0)):  # two training steps, the rollout generating
        rollout.enter("generate")
        train.enter("wait_data")
        clock.now += wait
        train.enter("train")
        clock.now += step
        train.enter(OTHER)
        clock.now += 0.5  # step bookkeeping no state names
        steps.append(train.lap_metrics())
    rollout.enter("idle")
    train.enter("train")
    clock.now += 1.0  # the gate holds the rollout while the trainer trains
    cpu.now = 9.0  # the processes' CPU together: 0.9 of a core, of the 2
    for step, metrics in enumerate(steps, start=1):
        append_step(run_dir / METRICS_FILE, metrics, step, 0.0)
    report(config, "timed", "rollout", state="running", **rollout.report())
    report(config, "timed", "train", state="running", **train.report())

    code, lines = status_lines(capsys, "timed", "--set", f"workdir={config.workdir}")
    assert code == 0
    split = sections(lines)[2]
    assert split[0].startswith("time since each role started")
    # Of 10 s, rollout: 9 generating, 1 idle; train: 1 waiting, 8 training, 1 unnamed.
    assert split[1].split() == [
        "rollout", "10s:", "generate", "90%", "idle", "10%", "other", "0%;", "CPU", "0.9",
        "cores",
    ]  # fmt: skip
    assert split[2].split()[:8] == ["train", "10s:", "train", "80%", "wait_data", "10%", "other", "10%;"]  # fmt: skip
    assert "(other over 5%: time no state accounts for)" in split[2]
    # The two steps' mean: (4.5 + 4.5) / 2 s, parts (1 + 0) / 2, (3 + 4) / 2, (0.5 + 0.5) / 2.
    assert split[3].split() == [
        "step", "4.50", "s", "=", "train", "3.50", "+", "wait_data", "0.50", "+", "other",
        "0.50", "(mean", "of", "2)",
    ]  # fmt: skip


def test_status_reads_the_metrics_file_the_train_role_writes():
    assert cli_status.METRICS_FILE == metrics_file.METRICS_FILE
