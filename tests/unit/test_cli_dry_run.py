"""`sluice train --dry-run`: the resolved config, the processes the run would start and
an estimate of their memory; nothing started, nothing written, no torch, Prefect or MLflow.

The parameter counts and memory below are worked by hand from the model's shape.
"""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from sluice.flows.cli import main
from sluice.flows.cli_dry_run import dry_run_report
from sluice.infra.config.run import load_config
from sluice.tasks.run.threads import role_threads

# SmolLM2-135M's config.json (the shape; the other keys do not enter the estimate).
SMOLLM2_135M = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}


def dry_run(capsys, *args: str) -> tuple[int, str]:
    code = main(["train", "--dry-run", *args])
    captured = capsys.readouterr()
    return code, captured.out if code == 0 else captured.err


def process_rows(out: str) -> dict[str, list[str]]:
    """The table's rows by process: count, torch threads, memory (the `what` dropped)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["process", "count"])
    rows = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        cells = [cell.strip() for cell in line.strip().split("  ") if cell.strip()]
        rows[cells[0]] = cells[1:4]
    return rows


def test_dry_run_prints_the_resolved_config_the_processes_and_their_memory(tmp_path, capsys):
    code, out = dry_run(capsys, "--set", f"workdir={tmp_path}", "trainer.total_steps=7")
    assert code == 0
    yaml_text = out.split("\n\nWould start (")[0]
    resolved = yaml.safe_load(yaml_text)  # the header line is a YAML comment
    assert resolved["trainer"]["total_steps"] == 7 and resolved["workdir"] == str(tmp_path)
    config = load_config("default", [f"workdir={tmp_path}", "trainer.total_steps=7"])
    assert resolved == config.model_dump(mode="json")

    rows = process_rows(out)
    threads = str(role_threads(config, "train"))
    assert list(rows) == [
        "sluice train",
        "role launcher",
        "rollout",
        "inference server",
        "reward",
        "train",
        "evaluate",
    ]
    # The tiny default: vocab 101 (4 special tokens + 97 printable characters), hidden
    # 128, 4 layers of 4 heads x 32, MLP 384, tied embeddings. Per block: q, k, v, o
    # 4 x 128 x 128 = 65,536, MLP 3 x 128 x 384 = 147,456, two norms 256: 213,248;
    # x 4 = 852,992, + embeddings 101 x 128 = 12,928 + final norm 128 = 866,048.
    assert "866,048 parameters" in out
    # Trainer: float32 weights 4 B + gradients 4 B + AdamW 8 B + the checkpoint copy a
    # background save holds 12 B = 28 B x 866,048 = 24,249,344 B = 23.1 MiB.
    assert rows["train"] == ["1", threads, "23.1 MiB"]
    # Engine: weights 866,048 x 4 B = 3,464,192 B; KV cache 64 slots x 512 tokens (the
    # model's positions) x 4 layers x 2 (K, V) x 4 heads x 32 x 4 B = 134,217,728 B
    # = 128.0 MiB; 137,681,920 B = 131.3 MiB together.
    assert (
        "KV cache (64 slots x 512 tokens x 4 layers x 2 x 4 kv heads x 32 x 4 B) 128.0 MiB" in out
    )
    assert rows["inference server"] == ["1", threads, "131.3 MiB"]
    assert rows["evaluate"][2] == "131.3 MiB"  # the same engine settings
    assert rows["reward"][2] == "-" and rows["rollout"][2] == "-"  # no model of their own
    assert "estimate" in out
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_dry_run_of_the_sync_baseline_starts_one_colocated_process(tmp_path, capsys):
    code, out = dry_run(capsys, "--sync", f"workdir={tmp_path}", "evaluation.during_run=false")
    assert code == 0
    rows = process_rows(out)
    assert list(rows) == ["sluice train", "role launcher", "sync"]
    config = load_config("default", [f"workdir={tmp_path}"])
    # One process trains and generates: 24,249,344 B of trainer + 137,681,920 B of
    # engine = 161,931,264 B = 154.4 MiB.
    assert rows["sync"] == ["1", str(role_threads(config, "sync")), "154.4 MiB"]


def test_dry_run_counts_only_the_adapters_gradients_and_optimizer_state_under_lora(
    tmp_path, capsys
):
    code, out = dry_run(capsys, f"workdir={tmp_path}", "trainer.lora.rank=8")
    assert code == 0
    # r (in + out) per adapted layer: q, k, v, o 8 x (128 + 128) = 2,048 each; gate,
    # up, down 8 x (128 + 384) = 4,096 each: 20,480 a block, x 4 blocks = 81,920.
    # Gradients 81,920 x 4 B = 320.0 KiB; AdamW 2 x that = 640.0 KiB.
    assert "gradients (81,920 adapter parameters) 320.0 KiB" in out
    assert "AdamW state (2 x 81,920 adapter parameters) 640.0 KiB" in out


def test_a_model_directory_s_config_gives_its_shape_and_kv_cache(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_135M))
    config = load_config("reasoning_gym", [f"model.path={tmp_path}"])
    out = dry_run_report(config, "reasoning_gym", sync=False, resume=None)
    # Per block: q 576 x 576 = 331,776, k and v 576 x 192 (3 kv heads x 64) = 110,592
    # each, o 331,776, MLP 3 x 576 x 1536 = 2,654,208, norms 1,152: 3,540,096; x 30 =
    # 106,202,880, + embeddings 49,152 x 576 = 28,311,552 + 576 = 134,515,008
    # (SmolLM2-135M's published count).
    assert "134,515,008 parameters: llama, 30 layers" in out
    # KV cache: 64 slots x 128 tokens (the config's max_seq_len) x 30 layers x 2 x 3
    # kv heads x 64 x 4 B = 377,487,360 B = 360.0 MiB.
    assert (
        "KV cache (64 slots x 128 tokens x 30 layers x 2 x 3 kv heads x 64 x 4 B) 360.0 MiB" in out
    )


def test_a_split_trainer_starts_its_other_ranks_and_a_mode_is_spelled_out(tmp_path, capsys):
    code, out = dry_run(
        capsys,
        f"workdir={tmp_path}",
        "trainer.backend=megatron",
        "trainer.tensor_parallel=2",
        "trainer.data_parallel=2",
        "mode=stale",
    )
    assert code == 0
    rows = process_rows(out)
    assert rows["train"][0] == "1" and rows["train ranks"][0] == "3"
    assert "rank 0 of 4" in out
    assert "mode stale: staleness.max_staleness=5" in out


def test_dry_run_imports_neither_torch_nor_prefect_nor_mlflow(tmp_path):
    probe = (
        "import sys; from sluice.flows.cli import main; "
        f"code = main(['train', '--dry-run', 'workdir={tmp_path}']); "
        "print('RESULT', code, [m for m in ('torch', 'prefect', 'mlflow') if m in sys.modules])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.splitlines()[-1] == "RESULT 0 []", proc.stderr


def test_a_supervised_pass_is_planned_in_the_command_with_every_weight_training(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_135M))
    overrides = [f"model.path={tmp_path}", "model.supervised.minutes=24", "trainer.lora.rank=8"]
    out = dry_run_report(load_config("reasoning_gym", overrides), "x", sync=False, resume=None)
    # Under LoRA too, the pass trains all 134,515,008 parameters: 4 B of weights, 4 of
    # gradients, 8 of AdamW state each: 2,152,240,128 B = 2.0 GiB.
    assert "supervised pass: weights, gradients and AdamW state (float32) 2.0 GiB" in out
    assert "first: 24 min on the answers, its result version 0" in out
    plain = load_config("reasoning_gym", [f"model.path={tmp_path}"])
    assert "supervised pass" not in dry_run_report(plain, "x", sync=False, resume=None)
