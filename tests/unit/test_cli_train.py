"""`sluice train --resume` and `sluice bench` argument handling: fast, no Prefect started."""

import json
import subprocess
import sys

import pytest

from sluice.flows.bench.async_vs_sync import (
    BENCH_DEFAULTS,
    VariantResult,
    apply_bench_defaults,
    default_variants,
    ratio_table,
)
from sluice.flows.cli import main
from sluice.infra.config.run import load_config
from sluice.tasks.process.ports import free_port


def test_resume_of_an_unknown_run_fails_with_one_line_naming_it(tmp_path, capsys):
    code = main(["train", "--resume", "nope-123", "--set", f"workdir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "run 'nope-123' not found" in err[0]


def test_sync_with_resume_is_refused_with_one_line_before_anything_runs(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    saved = load_config("default", [f"workdir={tmp_path}"])
    (run_dir / "config.json").write_text(json.dumps(saved.model_dump(mode="json")))
    code = main(["train", "--sync", "--resume", "r1", "--set", f"workdir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "--resume" in err[0] and "--sync" in err[0]


def test_sync_with_multi_turn_episodes_is_refused_with_one_line(tmp_path, capsys):
    code = main(["train", "multiturn", "--sync", "--set", f"workdir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "episode.tools" in err[0] and "--sync" in err[0]


def test_resume_loads_the_runs_own_config_then_the_overrides(tmp_path):
    from sluice.flows.cli import parse

    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    saved = load_config("default", [f"workdir={tmp_path}", "trainer.prompts_per_batch=3"])
    (run_dir / "config.json").write_text(json.dumps(saved.model_dump(mode="json")))
    _, config = parse(
        [
            "train",
            "--resume",
            "r1",
            "--set",
            f"workdir={tmp_path}",
            "--set",
            "trainer.total_steps=77",
        ]
    )
    assert config.trainer.prompts_per_batch == 3  # from the run, not the default config
    assert config.trainer.total_steps == 77  # the override on top


def test_bench_defaults_yield_to_explicit_overrides():
    config = load_config("default", ["trainer.total_steps=5"])
    config = apply_bench_defaults(config, ["trainer.total_steps=5"])
    assert config.trainer.total_steps == 5
    assert config.evaluation.every == BENCH_DEFAULTS["evaluation.every"]


def test_bench_variants_cover_sync_and_every_eta_both_ways():
    labels = [v.label for v in default_variants()]
    assert labels[0] == "sync"
    assert {(v.max_staleness, v.interruptible) for v in default_variants()[1:]} == {
        (e, i) for e in (0, 1, 4) for i in (True, False)
    }


def test_ratio_table_divides_by_the_sync_row_of_the_same_invocation():
    def result(label, tps, wall):
        return VariantResult(label, label, 10, tps, wall, wall + 5, 0.2, 0.4, 0.0, 0.1)

    table = ratio_table([result("sync", 100.0, 50.0), result("async η=4 interrupt", 250.0, 20.0)])
    row = next(line for line in table.splitlines() if line.startswith("| async"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "2.50" and cells[5] == "2.50"


def test_unknown_bench_variant_fails_in_the_parser_before_anything_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.flows.cli", "bench", "nope"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_a_ray_head_nothing_answers_at_is_refused_with_one_line_before_anything_is_created(
    tmp_path, capsys
):
    import socket

    with socket.socket() as sock:  # free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = main(
        ["train"]
        + ["--set", "cluster.engine=ray", "--set", f"cluster.address=127.0.0.1:{port}"]
        + ["--set", "storage.url=s3://bucket/runs", "--set", "tracking.uri=http://mlflow:5000"]
        + ["--set", f"workdir={tmp_path / 'work'}"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and f"cannot join the Ray cluster at 127.0.0.1:{port}" in err[0]
    assert list(tmp_path.iterdir()) == []


def _s3_run(tmp_path, port: int) -> list[str]:
    options = json.dumps({"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}})
    return [
        "train",
        "--set",
        f"workdir={tmp_path}",
        "--set",
        "storage.url=s3://bucket/runs",
        "--set",
        f"storage.options={options}",
    ]


def test_s3_storage_without_credentials_is_refused_with_one_line(tmp_path, capsys, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    code = main(_s3_run(tmp_path, free_port()))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1, err
    assert "storage s3://bucket/runs cannot be used: no credentials were found" in err[0]
    assert not (tmp_path / "runs").exists()  # nothing was created


def test_s3_storage_nothing_answers_at_is_refused_with_one_line(tmp_path, capsys, monkeypatch):
    import time

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    started = time.monotonic()
    code = main(_s3_run(tmp_path, free_port()))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1, err
    assert "storage s3://bucket/runs cannot be used: nothing answered" in err[0]
    assert time.monotonic() - started < 60  # the probe's own deadline, not the run's retries


def test_a_bare_key_value_after_the_command_works_as_set(tmp_path):
    from sluice.flows.cli import parse

    args, config = parse(["train", "reasoning_gym", "trainer.lr=1e-5", f"workdir={tmp_path}"])
    assert args.config == "reasoning_gym" and config.name == "reasoning_gym"
    assert config.trainer.lr == 1e-5 and config.workdir == str(tmp_path)


def test_bare_settings_may_come_first_and_a_set_of_the_same_key_wins(tmp_path):
    from sluice.flows.cli import parse

    args, config = parse(
        ["train", "trainer.lr=1e-5", "--sync", "reasoning_gym"]
        + ["--set", "trainer.lr=2e-5", f"workdir={tmp_path}"]
    )
    assert args.sync and config.name == "reasoning_gym"
    assert config.trainer.lr == 2e-5


def test_a_bare_key_value_alone_keeps_the_default_config(tmp_path):
    from sluice.flows.cli import parse

    args, config = parse(["train", "trainer.total_steps=3", f"workdir={tmp_path}"])
    assert args.config == "default" and config.name == "default"
    assert config.trainer.total_steps == 3


def test_two_config_names_are_refused_with_one_line(capsys):
    code = main(["train", "reasoning_gym", "multiturn"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "two config names given, 'reasoning_gym' and 'multiturn'" in err[0]


def test_an_unknown_option_is_still_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["train", "--nope"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --nope" in capsys.readouterr().err


def test_version_prints_the_installed_version_and_exits_0(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"sluice {version('sluice-rl')}"


def test_eval_version_still_names_a_policy_version(tmp_path):
    from sluice.flows.cli import parse

    args, _ = parse(["eval", "--version", "3", f"workdir={tmp_path}"])
    assert args.version == 3


def test_the_start_of_a_run_says_where_to_look_while_it_runs(tmp_path, capsys):
    from sluice.flows.cli_train import mlflow_ui_command, print_start

    config = load_config("default", [f"workdir={tmp_path}"])
    print_start(config, "default-20261127-090000-ab12")
    out = capsys.readouterr().out
    assert out.startswith("Starting run default-20261127-090000-ab12.")
    assert "sluice status default-20261127-090000-ab12" in out
    assert "sluice logs default-20261127-090000-ab12 -f" in out
    assert f"{tmp_path}/runs/default-20261127-090000-ab12/logs/" in out
    command = mlflow_ui_command(config.tracking.uri)
    # The UI's web server alone (no job runners), one worker.
    assert command.startswith("MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui ")
    assert command.endswith("--workers 1") and config.tracking.uri in command
    assert f"MLflow UI:   {command}" in out
    assert "Prefect UI:" in out
