"""Test-wide environment and the fixtures many test files share.

Environment: no telemetry, quiet libraries, a patient ephemeral Prefect API.

Fixtures (heavy imports stay inside them, so collecting a pure test imports nothing big):

- models: ``tiny_policy`` builds a policy directory (random tiny causal LM and character
  tokenizer, ``sluice.engines.policy.model.build_tiny_policy``) and ``random_model_dir`` a bare random
  Hugging Face model directory (no tokenizer). Both are session-scoped factories that
  build each distinct model once; the directories are shared, so tests treat them as
  read-only (copy one before altering it). ``tiny_dir`` is the smallest policy the
  engines accept.
- runs: ``local_run_config`` builds a RunConfig whose workdir, streams, checkpoints and
  MLflow store all live under one directory (``local_run_settings`` lists those keys);
  ``tracking_uri`` is a sqlite MLflow store for one module.

Parallel runs (``pytest -n 2``, pytest-xdist with ``--dist loadgroup``, what ``.ci/run``
does): ``pytest_collection_modifyitems`` puts each test file in a group of its own, so a
module's fixtures (a Ray cluster, an MLflow server, a warm sandbox) start once, and every
test that drives the one Docker engine or a Ray instance in one group each, so two
workers never build the same image or join each other's Ray cluster. The slowest groups
are listed first (xdist then orders groups by how many tests they hold: docs/testing.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sluice.infra.config.run import RunConfig

os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Random init gives near-uniform logits; scaling the embeddings up makes the
# distributions peaked enough that greedy/top-p behave like a trained model.
PEAKED_EMBEDDING_SCALE = 20.0


# ---------------------------------------------------------------- parallel runs

DOCKER_FILES = (
    "tests/flows/test_server_containers_flow.py",
    "tests/integration/test_compose_stack.py",
    "tests/integration/test_container_cluster.py",
    "tests/integration/test_deployments.py",
    "tests/integration/test_docker_sandbox.py",
    "tests/integration/test_humaneval_sandboxes.py",
    "tests/integration/test_sandbox_attacks.py",
)
"""Files whose tests drive the Docker engine (build `sluice:local`, start containers)."""
RAY_FILES = ("tests/integration/test_cluster.py", "tests/integration/test_ray_server_actors.py")
"""Files whose tests start Ray: a cluster of nodes, or a one-node instance that
`ray.init()` elsewhere could join."""
SLOWEST_FIRST = (
    "ray",
    "docker",
    "tests/integration/test_outage_resume.py",
    "tests/integration/test_soak.py",
    "tests/flows/test_real_model_flow.py",
    "tests/flows/test_multiturn_flow.py",
    "tests/integration/test_interrupt.py",
    "tests/integration/test_resume_after_kill.py",
    "tests/static/test_static_checks.py",
)
"""Groups that take minutes on a 2-core box (docs/testing.md has the durations), listed
first; every other group follows in collection order."""


def test_group(path: str) -> str:
    """The xdist group of a test file (its path relative to the repository)."""
    if path in DOCKER_FILES:
        return "docker"
    if path in RAY_FILES:
        return "ray"
    return path


# First: xdist's own hook of the same name reads the groups off the marks to key its
# scheduling, and, registered after this file, it would otherwise run before it.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath))
    groups = {}
    for item in items:
        group = test_group(Path(str(item.path)).relative_to(root).as_posix())
        groups[item.nodeid] = group
        item.add_marker(pytest.mark.xdist_group(group))
    rank = {group: i for i, group in enumerate(SLOWEST_FIRST)}
    order = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(groups[item.nodeid], len(rank)), order[item.nodeid]))


# ---------------------------------------------------------------- models


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``tiny_policy(**build_tiny_policy options)`` -> a policy directory.

    Deterministic (the options include the seed), so each distinct set of options is
    built once per session and shared.
    """
    built: dict[tuple[tuple[str, Any], ...], Path] = {}

    def build(**options: Any) -> Path:
        from sluice.engines.policy.model import build_tiny_policy

        key = tuple(sorted(options.items()))
        if key not in built:
            built[key] = build_tiny_policy(tmp_path_factory.mktemp("tiny") / "policy", **options)
        return built[key]

    return build


@pytest.fixture(scope="session")
def tiny_dir(tiny_policy: Callable[..., Path]) -> Path:
    """A random ~40k-parameter policy directory: the smallest the engines accept."""
    return tiny_policy(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)


def small_llama_config(**overrides: Any) -> PretrainedConfig:
    """The suite's small Llama: 40-token vocabulary, 2 layers, grouped-query attention
    (4 query heads, 2 key/value heads); token 0 is BOS, 1 EOS, 2 padding."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = {
        "vocab_size": 40,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }
    fields.update(overrides)
    return LlamaConfig(**fields)


def small_qwen2_config(**overrides: Any) -> PretrainedConfig:
    """The small Llama's shape as a Qwen2 (q/k/v biases); same vocabulary and heads."""
    from transformers import Qwen2Config

    fields = small_llama_config().to_dict()
    fields = {k: fields[k] for k in ("vocab_size", "hidden_size", "intermediate_size")}
    fields.update(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=1,
    )
    fields.update(overrides)
    return Qwen2Config(**fields)


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``random_model_dir(seed, config=None, *, peaked=True, **overrides)``.

    Saves a randomly initialised causal LM (weights and config, no tokenizer) seeded by
    `seed`: `config` (a Llama or Qwen2 config) or else ``small_llama_config(**overrides)``.
    `peaked` scales the input embeddings by ``PEAKED_EMBEDDING_SCALE``. Each distinct
    model is built once per session; the global torch RNG is left as it was.
    """
    built: dict[tuple[str, str, int, bool], Path] = {}

    def build(
        seed: int, config: PretrainedConfig | None = None, *, peaked: bool = True, **overrides: Any
    ) -> Path:
        import torch
        from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

        if config is None:
            config = small_llama_config(**overrides)
        elif overrides:
            raise TypeError("pass either a config or overrides of the small Llama, not both")
        key = (type(config).__name__, config.to_json_string(), seed, peaked)
        if key not in built:
            model_cls = Qwen2ForCausalLM if isinstance(config, Qwen2Config) else LlamaForCausalLM
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = model_cls(config).eval()
            if peaked:
                with torch.no_grad():
                    model.get_input_embeddings().weight.mul_(PEAKED_EMBEDDING_SCALE)
            path = tmp_path_factory.mktemp("random-model") / "model"
            model.save_pretrained(path)
            built[key] = path
        return built[key]

    return build


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Bit-exact comparisons hold at one thread count: pin it for a whole module."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ---------------------------------------------------------------- runs


_EMPTY_MLFLOW_STORE: list[Path] = []  # one per test process, made on first use


def empty_mlflow_store() -> Path:
    """An empty sqlite MLflow store with its tables created, made once per test process.
    Creating the tables runs MLflow's migrations (seconds, more on a loaded machine); a
    copy (``copy_sqlite``) is a store MLflow opens as it would a fresh one it migrated."""
    if not _EMPTY_MLFLOW_STORE:
        import atexit
        import shutil
        import tempfile

        from sluice.infra.tracking import get_client

        folder = Path(tempfile.mkdtemp(prefix="sluice-empty-mlflow-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        get_client(f"sqlite:///{folder}/mlflow.db")
        _EMPTY_MLFLOW_STORE.append(folder / "mlflow.db")
    return _EMPTY_MLFLOW_STORE[0]


def copy_sqlite(source: Path, destination: Path) -> None:
    """A consistent copy of a sqlite database: through sqlite's backup API, which
    includes what its write-ahead log holds (Sluice opens stores in WAL mode, so the
    main file alone can be behind)."""
    import sqlite3

    with sqlite3.connect(source) as src, sqlite3.connect(destination) as dst:
        src.backup(dst)
    src.close()
    dst.close()


def local_run_settings(root: Path) -> dict[str, str]:
    """Config keys that keep every file of a run under `root`: the workdir, the streams
    and checkpoints, and a sqlite MLflow store with its artifacts. The store starts as a
    copy of ``empty_mlflow_store()`` where `root` has none (a run that migrates its own
    store on first use is tested by the CLI tests, which choose their own stores)."""
    store = root / "mlflow.db"
    if not store.exists():
        root.mkdir(parents=True, exist_ok=True)
        copy_sqlite(empty_mlflow_store(), store)
    return {
        "workdir": str(root / "work"),
        "storage.url": f"file://{root}/store",
        "tracking.uri": f"sqlite:///{store}",
        "tracking.artifact_location": str(root / "mlartifacts"),
    }


@pytest.fixture(scope="session")
def local_run_config() -> Callable[..., RunConfig]:
    """Factory: ``local_run_config(root, *overrides)`` -> the built-in defaults, every
    file under `root` (``local_run_settings``), then `overrides` ("key=value")."""

    def make(root: Path, *overrides: str) -> RunConfig:
        from sluice.infra.config.run import load_config

        settings = [f"{key}={value}" for key, value in local_run_settings(root).items()]
        return load_config(None, [*settings, *overrides])

    return make


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A sqlite MLflow store for one test module, its tables already created (a copy of
    ``empty_mlflow_store()``)."""
    store = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    copy_sqlite(empty_mlflow_store(), store)
    return f"sqlite:///{store}"


# ---------------------------------------------------------------- docker


REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def sluice_image() -> str:
    """Sluice's own image, `sluice:local`, built from this checkout by
    `infra/docker/image.sh` (minutes the first time; nothing when it is up to date).
    Skips with the reason where no Docker engine answers."""
    import subprocess

    from sluice.infra.docker_servers import ServerLaunchError, docker_client

    try:
        docker_client()
    except ServerLaunchError as exc:
        pytest.skip(str(exc))
    subprocess.run(["bash", "infra/docker/image.sh"], cwd=REPO_ROOT, check=True, timeout=1800)
    return "sluice:local"
