"""The embedded policy: a character tokenizer that round-trips, a tiny model that saves,
loads and computes deterministically, and one clear error for a directory that is not a model."""

import json

import pytest
import torch

from sluice.engines.policy.model import (
    PolicyLoadError,
    build_char_tokenizer,
    build_tiny_policy,
    count_parameters,
    is_tiny_policy_dir,
    load_policy_dir,
)

SMALL = dict(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64
)


@pytest.fixture(scope="module")
def tiny_dir(tiny_policy):
    return tiny_policy(seed=7, **SMALL)


def test_char_tokenizer_round_trips_text_and_prepends_bos():
    tokenizer = build_char_tokenizer()
    text = "a7b3c9:a7b10c19=19\n  tab\there"
    ids = tokenizer(text)["input_ids"]
    # One token per character plus the leading <bos>.
    assert len(ids) == len(text) + 1
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids[1:]


def test_char_tokenizer_maps_unknown_characters_to_unk_and_saves(tmp_path):
    tokenizer = build_char_tokenizer("ab")
    assert [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id] == [0, 1, 2]
    ids = tokenizer("a€b", add_special_tokens=False)["input_ids"]
    assert ids == [
        tokenizer.convert_tokens_to_ids("a"),
        tokenizer.unk_token_id,
        tokenizer.convert_tokens_to_ids("b"),
    ]
    tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert reloaded("ba")["input_ids"] == tokenizer("ba")["input_ids"]


def test_char_tokenizer_rejects_empty_alphabet():
    with pytest.raises(ValueError, match="alphabet"):
        build_char_tokenizer("")


def test_build_then_load_gives_deterministic_logits(tiny_dir, tmp_path):
    model, tokenizer = load_policy_dir(tiny_dir)
    assert not model.training
    assert is_tiny_policy_dir(tiny_dir)
    assert (tiny_dir / "model.safetensors").is_file()
    ids = tokenizer("a1b2:", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        first = model(ids).logits
        again = model(ids).logits
    assert torch.equal(first, again)
    # Same seed, fresh directory: bit-identical weights; another seed differs.
    twin, _ = load_policy_dir(build_tiny_policy(tmp_path / "twin", seed=7, **SMALL))
    other, _ = load_policy_dir(build_tiny_policy(tmp_path / "other", seed=8, **SMALL))
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, first)
        assert not torch.equal(other(ids).logits, first)


def test_default_tiny_policy_is_about_one_million_parameters(tmp_path):
    path = build_tiny_policy(tmp_path / "default")
    model, tokenizer = load_policy_dir(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 0.5e6 < count_parameters(model) < 1.5e6
    assert model.config.vocab_size == len(tokenizer)
    marker = json.loads((path / "sluice_tiny_policy.json").read_text())
    assert marker["num_parameters"] == count_parameters(model)


def test_qwen2_architecture_builds_and_loads(tmp_path):
    model, _ = load_policy_dir(build_tiny_policy(tmp_path / "qwen", arch="qwen2", **SMALL))
    assert type(model).__name__ == "Qwen2ForCausalLM"


def test_bad_shape_is_rejected_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="num_heads"):
        build_tiny_policy(tmp_path / "bad", hidden_size=30, num_heads=4)
    assert not (tmp_path / "bad").exists()


def test_loading_a_missing_or_non_model_directory_names_it(tmp_path):
    with pytest.raises(PolicyLoadError, match="does not exist"):
        load_policy_dir(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PolicyLoadError, match="not a Hugging Face model directory"):
        load_policy_dir(tmp_path / "empty")
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(PolicyLoadError, match="is a file"):
        load_policy_dir(tmp_path / "file.bin")


def test_loading_a_directory_with_broken_weights_names_it(tiny_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(PolicyLoadError, match="broken"):
        load_policy_dir(broken)
