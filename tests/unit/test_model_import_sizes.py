"""`sluice model import` believes a file's weights, not its config.

The attack: a 656 KB GGUF (or a model directory with a few KB of safetensors) whose
config declares 512 layers of width 32,768, about 3.8 trillion parameters. Building that
model to load the file would allocate until the node runs out of memory. The import
must refuse it in one line, in seconds, at the memory of an idle interpreter. Each
import runs as the real CLI in a subprocess under an address-space limit (so a
regression fails the test instead of taking the machine down).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from tests.unit.synthetic import SHIPPED

ADDRESS_SPACE_BYTES = 6 << 30  # torch and transformers import within it; the model would not
HUGE = {"layers": 512, "width": 32768, "vocab": 5}


# The import runs as a child of a small launcher, not of this process: Linux carries a
# process's peak RSS across exec, and a child forked from a test worker that has grown to
# gigabytes starts with the worker's peak as its own. A child of a fresh interpreter
# starts from that interpreter's few megabytes, so its peak is the import's.
LAUNCHER = """
import resource, subprocess, sys
limit, peak_file, *command = sys.argv[1:]
resource.setrlimit(resource.RLIMIT_AS, (int(limit), int(limit)))
try:
    code = subprocess.run(command, timeout=180).returncode
except subprocess.TimeoutExpired:
    code = 124
with open(peak_file, "w") as out:
    out.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(code)
"""


def _import(src: Path, dest: Path) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """Run `sluice model import`; (result, seconds, the import's own peak RSS in MiB)."""
    command = [sys.executable, "-m", "sluice.flows.cli", "model", "import", str(src), str(dest)]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        peak_file = Path(scratch) / "peak_kib"
        launcher = [sys.executable, "-c", LAUNCHER, str(ADDRESS_SPACE_BYTES), str(peak_file)]
        done = subprocess.run([*launcher, *command], capture_output=True, text=True, timeout=240)
        peak_kib = float(peak_file.read_text())
    result = subprocess.CompletedProcess(command, done.returncode, done.stdout, done.stderr)
    return result, time.monotonic() - started, peak_kib / 1024


def _assert_refused(result, seconds: float, peak_mib: float, src: Path, dest: Path) -> None:
    err = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(err) == 1 and err[0].startswith("sluice: error:")
    assert "does not match its weights" in err[0] and "num_hidden_layers 512" in err[0]
    assert seconds < 90
    assert peak_mib < 2048, f"peak RSS {peak_mib:.0f} MiB"
    assert not dest.exists() and src.exists()


def test_a_tiny_gguf_declaring_a_huge_model_is_refused_fast(tmp_path):
    gguf = pytest.importorskip("gguf", reason="writing a GGUF needs gguf")
    source = tmp_path / "huge.gguf"
    writer = gguf.GGUFWriter(str(source), arch="llama")
    writer.add_block_count(HUGE["layers"])
    writer.add_context_length(2048)
    writer.add_embedding_length(HUGE["width"])
    writer.add_feed_forward_length(HUGE["width"])
    writer.add_head_count(256)
    writer.add_head_count_kv(256)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(HUGE["vocab"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c", "d", "e"])
    writer.add_token_types([1] * HUGE["vocab"])
    writer.add_token_merges([])
    embeddings = np.zeros((HUGE["vocab"], HUGE["width"]), dtype=np.float32)
    writer.add_tensor("token_embd.weight", embeddings)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert source.stat().st_size < 700_000
    result, seconds, peak = _import(source, tmp_path / "out")
    _assert_refused(result, seconds, peak, source, tmp_path / "out")


def test_a_model_directory_declaring_more_than_its_safetensors_is_refused(tmp_path):
    source = tmp_path / "huge"
    shutil.copytree(SHIPPED, source)
    config = json.loads((source / "config.json").read_text())
    config.update(
        num_hidden_layers=HUGE["layers"],
        hidden_size=HUGE["width"],
        intermediate_size=HUGE["width"],
        num_attention_heads=256,
        num_key_value_heads=256,
    )
    config.pop("head_dim", None)
    (source / "config.json").write_text(json.dumps(config))
    result, seconds, peak = _import(source, tmp_path / "out")
    _assert_refused(result, seconds, peak, source, tmp_path / "out")


def test_a_safetensors_header_claiming_bytes_it_lacks_is_refused(tmp_path):
    from sluice.engines.policy.importer import ModelImportError, safetensors_elements

    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 16]}}
    ).encode()
    (tmp_path / "model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + bytes(16)
    )
    with pytest.raises(ModelImportError, match="do not hold"):
        safetensors_elements(tmp_path)
    assert safetensors_elements(SHIPPED) > 0
