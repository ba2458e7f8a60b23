"""The registry behind `mlflow server`, as a cluster runs it (docs/design.md §2.1).

A remote tracking server validates every model version's source. On object storage it
accepts a source whose bytes are not there yet, so a servable version is registered
the moment it is served and tagged `pending` (which says, honestly, that its checkpoint
is not on storage); it becomes durable once the files land. A local `file://` source is
refused for every version, servable or durable: such a server needs object storage
(or a shared path inside its runs' artifact roots), whatever the durability cadence."""

from __future__ import annotations

import uuid

import pytest

from sluice.infra.checkpoints import save_checkpoint
from sluice.infra.policy_version import TAG_DURABLE
from sluice.infra.registry import CheckpointRegistry, RegistryError
from tests.soak.soak import MlflowServer
from tests.unit.test_registry import make_hf_dir

pytestmark = pytest.mark.integration


def test_a_servable_version_registers_on_a_remote_server_before_its_files_exist(s3_root, tmp_path):
    root, options = s3_root
    server = MlflowServer(tmp_path / "mlflow")
    try:
        registry = CheckpointRegistry(
            server.url, f"remote-{uuid.uuid4().hex[:8]}", storage_options=options
        )
        registry.commit(0, save_checkpoint(make_hf_dir(tmp_path / "a", 1), f"{root}/v0", options))

        served = registry.commit(1, f"{root}/v1", incarnation=1, durable=False)
        assert served.tags[TAG_DURABLE] == "pending"
        assert registry.newest_servable().identity == (1, 1)
        assert registry.newest_durable().identity == (0, 0)

        save_checkpoint(make_hf_dir(tmp_path / "b", 2), f"{root}/v1", options)
        registry.mark_durable(1, incarnation=1)
        assert registry.newest_durable().identity == (1, 1)
        assert registry.get(1).checkpoint_digest  # the digest of the files that landed

        local = save_checkpoint(make_hf_dir(tmp_path / "c", 3), str(tmp_path / "v2"))
        with pytest.raises(RegistryError, match="Invalid model version source"):
            registry.commit(2, local, incarnation=1, durable=False)
        assert registry.newest_servable().identity == (1, 1)
    finally:
        server.stop()
