"""Test-wide environment: no telemetry, quiet libraries, a patient ephemeral Prefect API."""

import os

import pytest

os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random ~40k-parameter policy directory: the smallest the engines accept."""
    from engines.model import build_tiny_policy

    return build_tiny_policy(
        tmp_path_factory.mktemp("tiny") / "policy",
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        seed=0,
    )


@pytest.fixture(scope="module")
def one_torch_thread():
    """Bit-exact comparisons hold at one thread count: pin it for a whole module."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
