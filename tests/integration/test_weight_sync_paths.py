"""Weights without files, over real loopback sockets: a trainer's sender
(tasks/train/sender.py) and Sluice's server (infra/serving/weight_routes.py) moving a
policy version by a gloo weight group or by shared-memory handles.

Equivalence: a version that arrives by any path is served bit for bit as the same
version loaded from disk (float32 on a CPU). Faults: a server or a trainer that dies
mid-transfer, and a group that cannot form, each end within a deadline in one line that
names the cause, with the served weights untouched.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.weight_sync import WeightGroup, unique_named_tensors
from sluice.infra.serving.server import ServerThread, create_app
from sluice.tasks.train.sender import WeightSender
from tests.integration.conftest import stop_process_group

pytestmark = pytest.mark.integration

BUCKET_BYTES = 20_000
"""Splits the tiny policy (~95 kB in float32) into several buckets."""
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
SAMPLING = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7}
SENDER_SCRIPT = Path(__file__).with_name("weight_sender_process.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Served:
    engine: InferenceEngine
    app: Any
    server: ServerThread
    url: str


def _serve(model_dir: Path, group_timeout_s: float) -> Served:
    engine = InferenceEngine(model_dir, max_batch_size=4, max_seq_len=32, seed=0)
    app = create_app(engine, weight_group_timeout_s=group_timeout_s)
    server = ServerThread(app)
    return Served(engine, app, server, server.start())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s} s")
        time.sleep(0.05)


def _group_state(http: httpx.Client, sender_url: str, name: str) -> str:
    return http.get(f"{sender_url}/groups/{name}").json()["state"]


def _form_group(
    http: httpx.Client, sender_url: str, server_url: str, name: str, world_size: int = 2
) -> dict[str, Any]:
    """Open group `name` on the sender and join the server to it; the init answer."""
    opened = http.post(
        f"{sender_url}/groups", json={"group_name": name, "world_size": world_size}
    ).json()
    body = {**opened, "rank_offset": 1, "world_size": world_size, "group_name": name}
    answer = http.post(f"{server_url}/init_weights_update_group", json={**body, "backend": "gloo"})
    return {"status": answer.status_code, **answer.json()}


def _bucket_body(meta: dict[str, Any], bucket: int, version: int) -> dict[str, Any]:
    indices = meta["buckets"][bucket]
    body = {key: [meta[key][i] for i in indices] for key in ("names", "dtypes", "shapes")}
    return {**body, "load_format": "flattened_bucket", "weight_version": str(version)}


def _served_version(http: httpx.Client, url: str) -> str:
    return http.get(f"{url}/get_weight_version").json()["weight_version"]


def _generate(http: httpx.Client, url: str) -> list[tuple[list[int], list[float], str]]:
    body = {"input_ids": PROMPTS, "sampling_params": SAMPLING, "return_logprob": True}
    answer = http.post(f"{url}/generate", json=body)
    assert answer.status_code == 200, answer.text
    return [
        (
            one["output_ids"],
            [entry[0] for entry in one["meta_info"]["output_token_logprobs"]],
            one["meta_info"]["weight_version"],
        )
        for one in answer.json()
    ]


def _our_shm_files() -> set[str]:
    """Shared-memory segments torch made for this process (``torch_<pid>_...``): other
    processes' files and the segments of earlier tests are not counted."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def v1_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny policy moved by seeded noise: policy version 1, saved as a trainer would."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    path = tmp_path_factory.mktemp("weights") / "v1"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def v1_state(v1_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(v1_dir).state_dict()


@pytest.fixture(scope="module")
def sender(v1_state: dict[str, torch.Tensor]) -> Iterator[tuple[WeightSender, str]]:
    sender = WeightSender(dtype=torch.float32, bucket_bytes=BUCKET_BYTES, group_timeout_s=10)
    url = sender.start()
    sender.offer(1, v1_state)
    yield sender, url
    sender.stop()


@dataclass
class Fleet:
    """Four servers that started at version 0 and took version 1 by one path each."""

    served: dict[str, Served]
    versions_between_buckets: list[str] = field(default_factory=list)
    """GET /get_weight_version of the bucketed server after each bucket but the last."""
    answers: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


PATHS = ("disk", "bucketed", "per_tensor", "shared_memory")


@pytest.fixture(scope="module")
def fleet(
    one_torch_thread: None,
    tiny_dir: Path,
    v1_dir: Path,
    v1_state: dict[str, torch.Tensor],
    sender: tuple[WeightSender, str],
    http: httpx.Client,
) -> Iterator[Fleet]:
    _, sender_url = sender
    fleet = Fleet({path: _serve(tiny_dir, group_timeout_s=10) for path in PATHS})
    url = {path: s.url for path, s in fleet.served.items()}
    pool = ThreadPoolExecutor(2)
    try:
        answer = http.post(
            f"{url['disk']}/update_weights_from_disk",
            json={"model_path": str(v1_dir), "weight_version": "1"},
        )
        fleet.answers["disk"] = [answer.json()]

        # Distributed, flattened buckets: the sender broadcasts each while the server receives.
        assert _form_group(http, sender_url, url["bucketed"], "bucketed")["success"]
        _wait_for(lambda: _group_state(http, sender_url, "bucketed") == "ready", 10, "ready")
        meta = http.get(f"{sender_url}/versions/1").json()
        fleet.answers["bucketed"] = []
        for bucket in range(len(meta["buckets"])):
            receiving = pool.submit(
                http.post,
                f"{url['bucketed']}/update_weights_from_distributed",
                json={**_bucket_body(meta, bucket, 1), "group_name": "bucketed"},
            )
            sent = http.post(
                f"{sender_url}/groups/bucketed/broadcast", json={"version": 1, "bucket": bucket}
            )
            assert sent.status_code == 200, sent.text
            fleet.answers["bucketed"].append(receiving.result(30).json())
            if bucket < len(meta["buckets"]) - 1:
                fleet.versions_between_buckets.append(_served_version(http, url["bucketed"]))

        # Distributed, one broadcast per tensor in its own dtype (SGLang's default format),
        # from a rank 0 the test holds: a trainer that does not use Sluice's sender.
        root = WeightGroup("127.0.0.1", 0, 0, 2, group_name="per_tensor", timeout_s=10)
        forming = pool.submit(root.connect)
        body = {"master_address": "127.0.0.1", "master_port": root.port, "rank_offset": 1}
        body.update(world_size=2, backend="gloo", group_name="per_tensor")
        assert http.post(f"{url['per_tensor']}/init_weights_update_group", json=body).json()[
            "success"
        ]
        forming.result(10)
        named = unique_named_tensors(v1_state)
        receiving = pool.submit(
            http.post,
            f"{url['per_tensor']}/update_weights_from_distributed",
            json={
                "names": [n for n, _ in named],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named],
                "group_name": "per_tensor",
                "weight_version": "1",
            },
        )
        for _, tensor in named:
            root.broadcast(tensor.contiguous())
        fleet.answers["per_tensor"] = [receiving.result(30).json()]
        root.close()

        # Shared memory: the sender's handles, mapped by the server (same host).
        handles = http.get(f"{sender_url}/versions/1/handles").json()
        answer = http.post(
            f"{url['shared_memory']}/update_weights_from_tensor",
            json={**handles, "weight_version": "1"},
        )
        fleet.answers["shared_memory"] = [answer.json()]
        yield fleet
    finally:
        pool.shutdown()
        for served in fleet.served.values():
            served.server.stop(timeout_s=10)
            served.engine.shutdown()


# ------------------------------------------------------------------ equivalence


def test_every_path_reports_the_version_applied(fleet: Fleet) -> None:
    for path in PATHS:
        last = fleet.answers[path][-1]
        assert last["success"] is True, (path, last)
        assert last["message"] == "Succeeded to update model weights to version 1.", path


@pytest.mark.parametrize("path", PATHS[1:])
def test_a_version_sent_without_files_serves_the_same_tokens_and_logprobs_as_from_disk(
    fleet: Fleet, http: httpx.Client, path: str
) -> None:
    from_disk = _generate(http, fleet.served["disk"].url)
    assert {version for _, _, version in from_disk} == {"1"}
    assert _generate(http, fleet.served[path].url) == from_disk  # bit for bit


@pytest.mark.parametrize("path", PATHS[1:])
def test_a_version_sent_without_files_leaves_the_engine_with_the_disk_weights(
    fleet: Fleet, path: str
) -> None:
    from_disk = fleet.served["disk"].engine.model.state_dict()
    received = fleet.served[path].engine.model.state_dict()
    assert received.keys() == from_disk.keys()
    for name, tensor in from_disk.items():
        assert torch.equal(received[name], tensor), name


def test_a_version_in_buckets_is_not_served_until_its_last_bucket_arrives(fleet: Fleet) -> None:
    answers = fleet.answers["bucketed"]
    assert len(answers) >= 3, "the version should span several buckets"
    assert fleet.versions_between_buckets == ["0"] * (len(answers) - 1)
    for answer in answers[:-1]:
        assert answer["success"] is True
        assert (
            answer["message"].startswith("Staged ") and "of weight version 1" in answer["message"]
        )
    assert fleet.served["bucketed"].engine.staged_tensors == 0


# ------------------------------------------------------------------ shared memory


def _assert_released(sender: WeightSender, before: set[str]) -> None:
    """Once the (stopped) sender lets its versions go, none of their segments is left."""
    sender.held.clear()
    gc.collect()
    assert _our_shm_files() - before == set()


def test_shared_memory_is_released_once_the_sender_lets_go(
    one_torch_thread: None, tiny_dir: Path, v1_state: dict[str, torch.Tensor], http: httpx.Client
) -> None:
    before = _our_shm_files()
    served = _serve(tiny_dir, group_timeout_s=10)
    sender = WeightSender(
        dtype=torch.float32, bucket_bytes=BUCKET_BYTES, group_timeout_s=10, keep=1
    )
    sender_url = sender.start()
    try:
        for version in (1, 2, 3):  # keep=1: each lets the one before go
            sender.offer(version, v1_state)
            handles = http.get(f"{sender_url}/versions/{version}/handles").json()
            answer = http.post(
                f"{served.url}/update_weights_from_tensor",
                json={**handles, "weight_version": str(version)},
            ).json()
            assert answer["success"] is True, answer
            # The one version held: a segment per bucket.
            assert len(_our_shm_files() - before) == len(sender.get(version).flat)
    finally:
        sender.stop()
        served.server.stop(timeout_s=10)
        served.engine.shutdown()
    _assert_released(sender, before)


def test_shared_memory_mapped_by_two_servers_is_released_once_the_sender_lets_go(
    one_torch_thread: None, tiny_dir: Path, v1_state: dict[str, torch.Tensor], http: httpx.Client
) -> None:
    # The rollout fetches handles of their own for every server of the host: a handle
    # is mapped once (tasks/rollout/transfer.py).
    before = _our_shm_files()
    servers = [_serve(tiny_dir, group_timeout_s=10) for _ in range(2)]
    sender = WeightSender(dtype=torch.float32, bucket_bytes=BUCKET_BYTES, group_timeout_s=10)
    sender_url = sender.start()
    try:
        sender.offer(1, v1_state)
        for served in servers:
            handles = http.get(f"{sender_url}/versions/1/handles").json()
            answer = http.post(
                f"{served.url}/update_weights_from_tensor", json={**handles, "weight_version": "1"}
            ).json()
            assert answer["success"] is True, answer
    finally:
        sender.stop()
        for served in servers:
            served.server.stop(timeout_s=10)
            served.engine.shutdown()
    _assert_released(sender, before)


# ------------------------------------------------------------------ a server process


@pytest.fixture(scope="module")
def server_process(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Sluice's server as its own process (a 5 s weight-group deadline); a test may kill it."""
    port = _free_port()
    log = tmp_path_factory.mktemp("server-process") / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "sluice.infra.serving.server", "--model", str(tiny_dir)]
            + ["--port", str(port), "--weight-group-timeout-s", "5", "--log-level", "warning"]
            + ["--max-batch-size", "2", "--max-seq-len", "32", "--num-threads", "1"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO_ROOT,
        )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"the server exited:\n{log.read_text()[-2000:]}")
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait_for(healthy, 60, "the server process answering /health")
        process.url = url  # type: ignore[attr-defined]
        yield process
    finally:
        stop_process_group(process, grace_s=5)


def test_a_versions_handles_map_in_every_server_process_of_the_host(
    server_process: Any, v1_state: dict[str, torch.Tensor], http: httpx.Client
) -> None:
    # Three server processes on one host (or one server given the version again after a
    # retry), each with handles of its own: each maps, copies, and lets go.
    sender = WeightSender(dtype=torch.float32, bucket_bytes=BUCKET_BYTES, group_timeout_s=10)
    sender_url = sender.start()
    try:
        sender.offer(1, v1_state)
        answers = [
            http.post(
                f"{server_process.url}/update_weights_from_tensor",
                json={
                    **http.get(f"{sender_url}/versions/1/handles").json(),
                    "weight_version": "1",
                },
            ).json()
            for _ in range(3)
        ]
        assert [a["success"] for a in answers] == [True] * 3, answers[-1]["message"]
    finally:
        sender.stop()


def test_a_server_killed_mid_transfer_fails_the_senders_broadcast_and_drops_the_group(
    server_process: Any, sender: tuple[WeightSender, str], http: httpx.Client
) -> None:
    _, sender_url = sender
    formed = _form_group(http, sender_url, server_process.url, "doomed")
    assert formed["success"], formed
    _wait_for(lambda: _group_state(http, sender_url, "doomed") == "ready", 10, "ready")
    meta = http.get(f"{sender_url}/versions/1").json()
    with ThreadPoolExecutor(1) as pool:
        # The server is receiving a bucket when it dies.
        receiving: Future = pool.submit(
            http.post,
            f"{server_process.url}/update_weights_from_distributed",
            json={**_bucket_body(meta, 0, 1), "group_name": "doomed"},
        )
        time.sleep(0.5)
        os.killpg(server_process.pid, signal.SIGKILL)
        server_process.wait(10)
        started = time.monotonic()
        sent = http.post(f"{sender_url}/groups/doomed/broadcast", json={"version": 1, "bucket": 0})
        elapsed = time.monotonic() - started
        with pytest.raises(httpx.HTTPError):
            receiving.result(10)
    assert sent.status_code == 400 and sent.json()["success"] is False
    message = sent.json()["message"]
    assert "broadcast in weight group 'doomed'" in message and "\n" not in message
    assert elapsed < 10
    assert _group_state(http, sender_url, "doomed") == "absent"


# ------------------------------------------------------------------ a trainer process


@pytest.fixture
def sender_process(v1_dir: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """The trainer's sender as its own process, holding version 1 (a 5 s group deadline)."""
    url_file, log = tmp_path / "sender.url", tmp_path / "sender.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, str(SENDER_SCRIPT), str(v1_dir), str(url_file)]
            + [str(BUCKET_BYTES), "5"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO_ROOT,
        )

    def started() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"the sender exited:\n{log.read_text()[-2000:]}")
        return url_file.exists()

    try:
        _wait_for(started, 60, "the sender process writing its URL")
        yield process, url_file.read_text()
    finally:
        stop_process_group(process, grace_s=5)


def test_a_trainer_killed_mid_transfer_fails_the_servers_receive_and_keeps_its_weights(
    one_torch_thread: None,
    tiny_dir: Path,
    sender_process: tuple[subprocess.Popen, str],
    http: httpx.Client,
) -> None:
    process, sender_url = sender_process
    served = _serve(tiny_dir, group_timeout_s=3)
    before = {n: t.clone() for n, t in served.engine.model.state_dict().items()}
    url = served.url
    try:
        assert _form_group(http, sender_url, url, "orphaned")["success"]
        _wait_for(lambda: _group_state(http, sender_url, "orphaned") == "ready", 10, "ready")
        meta = http.get(f"{sender_url}/versions/1").json()
        with ThreadPoolExecutor(1) as pool:
            # The first bucket arrives and is staged; the trainer dies during the second.
            first = pool.submit(
                http.post,
                f"{url}/update_weights_from_distributed",
                json={**_bucket_body(meta, 0, 1), "group_name": "orphaned"},
            )
            http.post(f"{sender_url}/groups/orphaned/broadcast", json={"version": 1, "bucket": 0})
            assert first.result(10).json()["success"]
            second = pool.submit(
                http.post,
                f"{url}/update_weights_from_distributed",
                json={**_bucket_body(meta, 1, 1), "group_name": "orphaned"},
            )
            time.sleep(0.5)
            os.killpg(process.pid, signal.SIGKILL)
            started = time.monotonic()
            answer = second.result(10)
            elapsed = time.monotonic() - started
        assert answer.status_code == 400 and answer.json()["success"] is False
        message = answer.json()["message"]
        assert "weight group 'orphaned'" in message and "dropped" in message
        assert "\n" not in message
        assert elapsed < 3 + 2  # the group's deadline, and some slack
        assert _served_version(http, url) == "0"
        after = served.engine.model.state_dict()
        assert all(torch.equal(after[n], t) for n, t in before.items())
        later = http.post(
            f"{url}/update_weights_from_distributed",
            json={**_bucket_body(meta, 0, 1), "group_name": "orphaned"},
        )
        assert later.status_code == 400
        assert "weight group 'orphaned' does not exist" in later.json()["message"]
    finally:
        served.server.stop(timeout_s=10)
        served.engine.shutdown()


# ------------------------------------------------------------------ groups that cannot form


@pytest.fixture(scope="module")
def impatient(tiny_dir: Path) -> Iterator[Served]:
    """A server whose weight groups form, or fail, within 1.5 s."""
    served = _serve(tiny_dir, group_timeout_s=1.5)
    yield served
    served.server.stop(timeout_s=10)
    served.engine.shutdown()


def test_a_group_of_the_wrong_world_size_fails_on_both_ends_within_the_deadline(
    impatient: Served, http: httpx.Client
) -> None:
    sender = WeightSender(dtype=torch.float32, bucket_bytes=BUCKET_BYTES, group_timeout_s=1.5)
    sender_url = sender.start()
    try:
        started = time.monotonic()
        # The sender expects 3 ranks; only this server joins.
        answer = _form_group(http, sender_url, impatient.url, "crowd", world_size=3)
        elapsed = time.monotonic() - started
        state = _wait_for(
            lambda: (s := _group_state(http, sender_url, "crowd")) != "forming" and s,
            5,
            "the sender giving up",
        )
    finally:
        sender.stop()
    assert answer["status"] == 400 and answer["success"] is False
    assert "weight group 'crowd' did not form" in answer["message"]
    assert "rank 1 of 3" in answer["message"] and "\n" not in answer["message"]
    assert elapsed < 1.5 + 3
    assert state.startswith("weight group 'crowd' did not form")
    assert "crowd" not in impatient.app.state.weight_groups


@pytest.mark.parametrize("listener", ["nobody", "not-a-store"])
def test_a_rendezvous_that_cannot_be_reached_fails_in_one_line(
    impatient: Served, sender: tuple[WeightSender, str], http: httpx.Client, listener: str
) -> None:
    # A closed port, or one where something else (the sender's HTTP API) listens.
    _, sender_url = sender
    port = _free_port() if listener == "nobody" else int(sender_url.rsplit(":", 1)[1])
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1}
    body.update(world_size=2, backend="gloo", group_name="lost")
    started = time.monotonic()
    answer = http.post(f"{impatient.url}/init_weights_update_group", json=body)
    elapsed = time.monotonic() - started
    assert answer.status_code == 400 and answer.json()["success"] is False
    message = answer.json()["message"]
    assert message.startswith("Failed to initialize custom process group: ")
    assert "weight group 'lost'" in message and f"127.0.0.1:{port}" in message
    assert "\n" not in message
    assert elapsed < 3 * 1.5 + 2  # torch's store tries twice before it gives up


def test_a_misaligned_bucket_is_refused_before_any_broadcast_and_keeps_the_group(
    impatient: Served, http: httpx.Client
) -> None:
    root = WeightGroup("127.0.0.1", 0, 0, 2, group_name="strict", timeout_s=1.5)
    with ThreadPoolExecutor(1) as pool:
        forming = pool.submit(root.connect)
        body = {"master_address": "127.0.0.1", "master_port": root.port, "rank_offset": 1}
        body.update(world_size=2, backend="gloo", group_name="strict")
        assert http.post(f"{impatient.url}/init_weights_update_group", json=body).json()["success"]
        forming.result(5)
    try:
        # 3 uint8 bytes put the float32 norm weight at byte 3: no receiver can view it.
        misaligned = {
            "names": ["model.norm.weight", "model.layers.0.input_layernorm.weight"],
            "dtypes": ["uint8", "float32"],
            "shapes": [[3], [32]],
            "group_name": "strict",
            "load_format": "flattened_bucket",
            "weight_version": "1",
        }
        started = time.monotonic()
        answer = http.post(f"{impatient.url}/update_weights_from_distributed", json=misaligned)
        elapsed = time.monotonic() - started
        assert answer.status_code == 400
        assert "starts at byte 3" in str(answer.json())
        assert elapsed < 1.0, "the server waited for a broadcast"
        assert "strict" in impatient.app.state.weight_groups
    finally:
        root.close()
        http.post(f"{impatient.url}/destroy_weights_update_group", json={"group_name": "strict"})
