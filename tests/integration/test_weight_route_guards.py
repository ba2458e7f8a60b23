"""The weight routes of Sluice's server as a caller on the network uses them against it:
a weight group at an address of the caller's choosing (a port scanner, a stall of every
control route), receive buffers at sizes the caller states, and a sender that truncates
its shared memory between staging and the swap. Real servers on loopback; the last one
in a process of its own, since what it guards against is the process dying."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from sluice.engines.inference.engine import InferenceEngine
from sluice.engines.inference.tensor_handles import SHM_DIR
from sluice.engines.inference.weight_sync import WeightGroup, serialize_named_tensors, shared
from sluice.engines.inference.weights import read_weight_files
from sluice.infra.serving.server import ServerThread, create_app
from tests.integration.conftest import stop_process_group

pytestmark = pytest.mark.integration

GROUP_TIMEOUT_S = 1.0
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Served:
    url: str
    engine: InferenceEngine
    app: Any


@pytest.fixture(scope="module")
def served(one_torch_thread: None, tiny_dir: Path) -> Iterator[Served]:
    engine = InferenceEngine(tiny_dir, max_batch_size=2, max_seq_len=32, seed=0)
    app = create_app(engine, shutdown_engine_on_exit=True, weight_group_timeout_s=GROUP_TIMEOUT_S)
    server = ServerThread(app)
    yield Served(server.start(), engine, app)
    server.stop(timeout_s=10)


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as client:
        yield client


def _group_body(address: str, port: int, name: str = "g", world_size: int = 2) -> dict[str, Any]:
    return {"master_address": address, "master_port": port, "rank_offset": 1,
            "world_size": world_size, "backend": "gloo", "group_name": name}  # fmt: skip


class _Listener:
    """A TCP service on loopback that counts connections and greets each with ``banner``."""

    def __init__(self, host: str = "127.0.0.1", banner: bytes = b"") -> None:
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = int(self.sock.getsockname()[1])
        self.banner, self.accepted, self._stop = banner, 0, False
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            if self.banner:
                conn.sendall(self.banner)
            self._held.append(conn)  # never answers anything else

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        for conn in self._held:
            conn.close()
        self.sock.close()


def test_a_group_at_an_address_outside_the_allowed_set_is_refused_undialled(
    served: Served, http: httpx.Client
) -> None:
    listener = _Listener("127.0.0.2")  # loopback, but not the run's sender's address
    try:
        answer = http.post(
            f"{served.url}/init_weights_update_group", json=_group_body("127.0.0.2", listener.port)
        )
        time.sleep(0.3)
    finally:
        listener.close()
    assert answer.status_code == 403 and answer.json()["success"] is False
    assert "is not the run's weight sender" in answer.json()["message"]
    assert listener.accepted == 0
    for world_size in (1, 100_000):
        body = _group_body("127.0.0.1", 1, world_size=world_size)
        assert http.post(f"{served.url}/init_weights_update_group", json=body).status_code == 400


def test_the_answer_never_carries_what_the_service_at_the_address_said(
    served: Served, http: httpx.Client
) -> None:
    listener = _Listener(banner=b"SSH-2.0-OpenSSH_9.6 secret-host-banner\r\n" * 8)
    try:
        answer = http.post(
            f"{served.url}/init_weights_update_group",
            json=_group_body("127.0.0.1", listener.port, "scan"),
        )
    finally:
        listener.close()
    message = answer.json()["message"]
    assert answer.status_code == 400 and "\n" not in message
    assert message == (
        f"Failed to initialize custom process group: weight group 'scan' did not form at "
        f"127.0.0.1:{listener.port} (rank 1 of 2, gloo) within {GROUP_TIMEOUT_S:g} s"
    )
    assert "scan" not in served.app.state.weight_groups


def test_concurrent_set_ups_at_a_dead_rendezvous_leave_the_control_routes_free(
    served: Served,
) -> None:
    # Before: each set-up held a thread of the default executor for the group deadline,
    # and the control routes (pause, continue, disk updates) waited behind them.
    listener = _Listener()  # accepts, never speaks: a rendezvous that hangs
    url = served.url

    async def control(client: httpx.AsyncClient) -> float:
        started = time.monotonic()
        for _ in range(3):
            await client.post(f"{url}/pause_generation", json={"mode": "in_place"})
            await client.post(f"{url}/continue_generation", json={})
        return time.monotonic() - started

    async def go() -> tuple[list[httpx.Response], float, float]:
        async with httpx.AsyncClient(timeout=30) as client:
            alone_s = await control(client)  # the same calls with nothing else going on
            body = _group_body("127.0.0.1", listener.port, "stuck")
            set_ups = [
                asyncio.create_task(client.post(f"{url}/init_weights_update_group", json=body))
                for _ in range(8)
            ]
            await asyncio.sleep(0.3)
            control_s = await control(client)
            return await asyncio.gather(*set_ups), alone_s, control_s

    try:
        answers, alone_s, control_s = asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        listener.close()
    # Stuck behind the set-ups, the calls would wait out group deadlines (1 s each);
    # compared with the same calls alone, so a busy machine slows both alike.
    assert control_s < alone_s + 0.75 * GROUP_TIMEOUT_S, (alone_s, control_s)
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [400] + [409] * 7, statuses
    busy = [a.json()["message"] for a in answers if a.status_code == 409]
    assert busy[0] == "another weight group is being formed; one at a time"


def test_tensor_specs_are_checked_before_a_receive_buffer_is_allocated(
    served: Served, http: httpx.Client
) -> None:
    root = WeightGroup("127.0.0.1", 0, 0, 2, group_name="specs", timeout_s=GROUP_TIMEOUT_S)
    with ThreadPoolExecutor(1) as pool:
        forming = pool.submit(root.connect)
        joined = http.post(
            f"{served.url}/init_weights_update_group",
            json=_group_body("127.0.0.1", root.port, "specs"),
        )
        assert joined.json()["success"], joined.text
        forming.result(5)
    norm = served.engine.model.state_dict()["model.norm.weight"]
    cases = {
        # 256 MiB for a tensor the model does not have: before, allocated, then a wait
        # for a broadcast until the deadline, and the group dropped.
        "not a tensor of the served model": (["lm_head.stolen"], ["float32"], [[8192, 8192]]),
        "twice": (["model.norm.weight"] * 2, ["float32"] * 2, [list(norm.shape)] * 2),
        "!=": (["model.norm.weight"], ["float32"], [[4096]]),
        "not a floating dtype": (["model.norm.weight"], ["int32"], [list(norm.shape)]),
    }
    try:
        for fragment, (names, dtypes, shapes) in cases.items():
            body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": "specs",
                    "load_format": "flattened_bucket", "weight_version": "1"}  # fmt: skip
            started = time.monotonic()
            answer = http.post(f"{served.url}/update_weights_from_distributed", json=body)
            assert time.monotonic() - started < 1.0, "the server waited for a broadcast"
            assert answer.status_code == 400 and fragment in answer.text, answer.text
        assert "specs" in served.app.state.weight_groups
        assert served.engine.weight_version == 0 and served.engine.staged_tensors == 0
    finally:
        root.close()
        http.post(f"{served.url}/destroy_weights_update_group", json={"group_name": "specs"})


# ------------------------------------------------------------------ a server process


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def server_process(tiny_dir: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    port = _free_port()
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "sluice.infra.serving.server", "--model", str(tiny_dir)]
            + ["--port", str(port), "--log-level", "warning", "--num-threads", "1"]
            + ["--max-batch-size", "2", "--max-seq-len", "32"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO_ROOT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not answer /health in 60 s"
            time.sleep(0.1)
        yield process, url
    finally:
        stop_process_group(process, grace_s=5)


def _handles(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    data = serialize_named_tensors(named)
    return {"serialized_named_tensors": [__import__("base64").b64encode(data).decode()]}


def test_a_sender_truncating_its_segment_before_the_swap_cannot_kill_the_server(
    server_process: tuple[subprocess.Popen, str], tiny_dir: Path, http: httpx.Client
) -> None:
    # Before: staged tensors were mappings of the sender's segments; truncated before
    # the swap, the copy into the served weights died of SIGBUS (exit 135).
    process, url = server_process
    state = {name: shared(t.clone()) for name, t in read_weight_files(tiny_dir).items()}
    names = sorted(state)
    first, last = [(n, state[n]) for n in names[:-1]], [(names[-1], state[names[-1]])]
    staged = http.post(
        f"{url}/update_weights_from_tensor", json={**_handles(first), "weight_version": "1"}
    ).json()
    assert staged["success"] and staged["message"].startswith("Staged "), staged
    segments = {s["segment"] for s in json.loads(serialize_named_tensors(first))["storages"]}
    saved = {}
    for segment in segments:
        saved[segment] = Path(SHM_DIR + segment).read_bytes()
        os.truncate(SHM_DIR + segment, 0)
    try:
        swapped = http.post(
            f"{url}/update_weights_from_tensor", json={**_handles(last), "weight_version": "1"}
        ).json()
        assert swapped["success"], swapped
        assert process.poll() is None
        assert http.get(f"{url}/health").status_code == 200
        assert http.get(f"{url}/get_weight_version").json() == {"weight_version": "1"}
    finally:
        # This process maps the segments too (it is the sender here): freeing them
        # writes their refcount header, which must exist again by then.
        for segment, data in saved.items():
            Path(SHM_DIR + segment).write_bytes(data)
