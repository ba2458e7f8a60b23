"""The warm-started policy that ships with Sluice: its bytes, its rebuild, its use."""

import pytest

from sluice.engines.policy import shipped_policy
from sluice.engines.policy.shipped_policy import (
    BUILD,
    PREFIX_CHECK_FINGERPRINT,
    PREFIX_CHECK_MACHINE,
    PREFIX_CHECK_RTOL,
    PREFIX_CHECK_SHA256,
    PREFIX_CHECK_STEPS,
    SHIPPED_DIR,
    build,
    file_digests,
    machine_key,
    prefix_fingerprint,
    verify,
)
from sluice.infra.config.run import load_config
from sluice.tasks.run.prepare import initial_policy_dir, shipped_policy_applies


def test_shipped_policy_files_match_their_recorded_sha256():
    assert (SHIPPED_DIR / "model.safetensors").is_file()
    assert verify() == []


def test_a_changed_byte_in_the_shipped_policy_is_caught(tmp_path):
    import shutil

    copy = tmp_path / "policy"
    shutil.copytree(SHIPPED_DIR, copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert verify(copy) == ["model.safetensors"]


@pytest.mark.slow
def test_the_first_steps_of_a_rebuild_reproduce_the_recorded_weights(tmp_path):
    # The whole rebuild takes ~10 minutes (python -m sluice.engines.policy.shipped_policy
    # build); its first steps exercise the same seeds, data order, threads and optimiser.
    # Bit for bit where that can hold: the recorded digest on the machine that recorded it
    # (another CPU's kernels round differently), and two builds alike on any other. Within
    # PREFIX_CHECK_RTOL (1e-5) everywhere: the fingerprint, which the CPU kernels moved by
    # at most 2e-7 and a 1% change of learning rate or two batches trading places by 4e-3
    # or more (numbers at PREFIX_CHECK_RTOL).
    out = build(tmp_path / "prefix", steps=PREFIX_CHECK_STEPS, num_eval_prompts=4, progress=str)
    assert prefix_fingerprint(out) == pytest.approx(
        PREFIX_CHECK_FINGERPRINT, rel=PREFIX_CHECK_RTOL, abs=0
    )
    digest = file_digests(out)["model.safetensors"]
    if machine_key() == PREFIX_CHECK_MACHINE:
        assert digest == PREFIX_CHECK_SHA256
    else:
        again = build(
            tmp_path / "again", steps=PREFIX_CHECK_STEPS, num_eval_prompts=4, progress=str
        )
        assert file_digests(again)["model.safetensors"] == digest


def test_the_default_run_starts_from_the_shipped_policy_without_training(tmp_path):
    config = load_config("default", [f"workdir={tmp_path}"])
    path, facts = initial_policy_dir(config)
    assert path == SHIPPED_DIR
    assert facts["source"] == "shipped-warm-policy"
    assert not (tmp_path / "models").exists()


def test_another_shape_or_task_does_not_get_the_shipped_policy():
    assert shipped_policy_applies(load_config("default"))
    assert not shipped_policy_applies(load_config("default", ["model.tiny.hidden_size=64"]))
    assert not shipped_policy_applies(load_config("default", ["model.shipped_policy=false"]))
    assert not shipped_policy_applies(load_config("default", ["model.path=/some/model"]))


def test_the_shipped_build_recipe_matches_the_default_tiny_shape():
    config = load_config("default")
    assert config.model.tiny.model_dump() == BUILD.tiny_shape()
    assert shipped_policy.BUILD.problem == config.problem.name
