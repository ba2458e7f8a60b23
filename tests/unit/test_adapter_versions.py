"""A LoRA run's versions on storage: an adapter names its base by URL and digest; a
reader that needs a whole model gets base and adapter merged; an adapter whose base is
not the one a reader holds is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.engines.policy.adapter import AdapterError
from sluice.engines.policy.model import load_policy_dir
from sluice.infra.checkpoints import read_manifest, save_checkpoint
from sluice.infra.config.run import RunConfig, load_config
from sluice.infra.registry import CommittedVersion
from sluice.tasks.rollout.weights import ServedWeights
from sluice.tasks.run.versions import fetch_model_uri, write_base_reference
from tests.unit.synthetic import SHIPPED
from tests.unit.test_lora import logits, samples, trainer


def committed(version: int, uri: str) -> CommittedVersion:
    return CommittedVersion(
        policy_version=version,
        checkpoint_uri=uri,
        model_version=version + 1,
        trainer_step=version,
        run_id=None,
        checkpoint_digest=None,
        created_at_ms=0,
        tags={},
    )


@pytest.fixture
def published(tmp_path: Path) -> tuple[RunConfig, str, str, torch.nn.Module]:
    """Version 0 (the base) and version 1 (an adapter naming it) on file:// storage,
    and the trainer's model that version 1 is."""
    config = load_config(
        "default",
        [f"workdir={tmp_path}/work", f"storage.url=file://{tmp_path}/store", "trainer.lora.rank=4"],
    )
    # Where run `lora-run` keeps its versions: a run's registry reads no other source.
    checkpoints = f"{tmp_path}/store/lora-run/checkpoints"
    base_uri = save_checkpoint(SHIPPED, f"{checkpoints}/v000000")
    lora = trainer()
    lora.train_step(samples(0))
    adapter = lora.save(tmp_path / "v1", state_dir=tmp_path / "state")
    digest = read_manifest(base_uri).digest
    write_base_reference(adapter, {"base_version": 0, "base_uri": base_uri, "base_digest": digest})
    return config, base_uri, save_checkpoint(adapter, f"{checkpoints}/v000001"), lora.model


def test_a_reader_gets_base_and_adapter_merged_once(published, tmp_path: Path) -> None:
    config, _base, adapter_uri, model = published
    cache = tmp_path / "cache"
    merged = fetch_model_uri(config, adapter_uri, cache, keep_latest=1)
    assert (merged / "config.json").is_file() and not (merged / "adapter_config.json").exists()
    plain, _ = load_policy_dir(merged)
    torch.testing.assert_close(logits(plain), logits(model), rtol=1e-5, atol=1e-5)
    stamp = (merged / "model.safetensors").stat().st_mtime_ns
    assert fetch_model_uri(config, adapter_uri, cache, keep_latest=1) == merged
    assert (merged / "model.safetensors").stat().st_mtime_ns == stamp  # merged once


def test_an_adapter_on_another_base_is_refused_in_one_line(published, tmp_path: Path) -> None:
    config, base_uri, adapter_uri, _model = published
    servers = ServedWeights(config, tmp_path / "rollout")
    servers.start(committed(0, base_uri))
    servers.check(committed(1, adapter_uri))  # the base the servers hold: accepted
    # The same adapter against servers started on other weights (another run's base).
    other = save_checkpoint(
        Path(fetch_model_uri(config, adapter_uri, tmp_path / "c")), f"{tmp_path}/other"
    )
    servers.start(committed(0, other))
    with pytest.raises(AdapterError) as caught:
        servers.check(committed(1, adapter_uri))
    message = str(caught.value)
    assert "\n" not in message and "policy version 1's adapter was trained on base" in message
    assert "not on the base the inference servers were started on" in message
    # A reader merging it finds its base URL holding other weights than it names.
    Path(adapter_uri.removeprefix("file://"), "sluice_adapter.json").write_text(
        f'{{"base_version": 0, "base_uri": "{other}", '
        f'"base_digest": "{read_manifest(base_uri).digest}"}}'
    )
    with pytest.raises(AdapterError, match="not on what that URL holds"):
        fetch_model_uri(config, save_checkpoint(
            Path(adapter_uri.removeprefix("file://")), f"{tmp_path}/store/v1b"
        ), tmp_path / "d")  # fmt: skip


def test_lora_servers_start_on_the_base(published) -> None:
    from sluice.tasks.run.versions import serving_start

    config, base_uri, adapter_uri, _model = published

    class Registry:
        def get(self, version: int) -> CommittedVersion:
            return committed(version, base_uri)

        def newest_durable(self) -> CommittedVersion:
            return committed(1, adapter_uri)

    assert serving_start(config, Registry()).policy_version == 0  # type: ignore[arg-type]
    full = config.model_copy(update={"trainer": config.trainer.model_copy(deep=True)})
    full.trainer.lora.rank = 0
    assert serving_start(full, Registry()).policy_version == 1  # type: ignore[arg-type]


def test_sluice_model_merge_writes_the_model_the_trainer_holds(published, tmp_path, capsys):
    from sluice.flows.cli import main

    _config, base_uri, adapter_uri, model = published
    base, adapter = (Path(uri.removeprefix("file://")) for uri in (base_uri, adapter_uri))
    assert main(["model", "merge", str(base), str(adapter), str(tmp_path / "merged")]) == 0
    plain, _ = load_policy_dir(tmp_path / "merged")
    torch.testing.assert_close(logits(plain), logits(model), rtol=1e-5, atol=1e-5)
    # An adapter in the place of the base: one line, nothing written.
    capsys.readouterr()
    assert main(["model", "merge", str(adapter), str(adapter), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a Hugging Face model directory" in err[0]
    assert not (tmp_path / "x").exists()
