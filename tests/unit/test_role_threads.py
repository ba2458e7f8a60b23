"""Role processes share the cores instead of each taking all of them."""

import os

from sluice.infra.config.run import load_config
from sluice.tasks.run.threads import role_threads


def test_side_by_side_roles_split_the_cores_and_never_get_zero(monkeypatch):
    config = load_config("default")
    for cores, expected in ((1, 1), (2, 1), (16, 8)):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        assert role_threads(config, "train") == expected
        assert role_threads(config, "rollout") == expected
        assert role_threads(config, "sync") == cores  # the colocated baseline runs alone


def test_an_explicit_thread_count_wins_for_every_role():
    config = load_config("default", ["threads_per_role=3"])
    assert {role_threads(config, r) for r in ("train", "rollout", "evaluate", "sync")} == {3}
