"""The run's credential, attacked: a caller without the run's token, or with a wrong one,
steers nothing.

Each test plays the attacker against real parts on loopback (a built-in server in this
process and one started from its command line, the trainer's weight sender, the
rollout's reader of the sender document) or from a network namespace it creates
itself, and then checks that nothing moved: the served weights, their version, the
sender's groups. `/health` and `/metrics` stay open; the run's own callers, holding the
token, still work. (That the token reaches no log line, MLflow param or Prefect flow-run
parameter of a real run: tests/flows/test_train_flow.py.)
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from sluice.engines.inference.engine import InferenceEngine
from sluice.infra.serving.auth import (
    OPEN_PATHS,
    CredentialError,
    read_token_file,
    sign_document,
)
from sluice.infra.serving.client import InferenceClient
from sluice.infra.serving.server import ServerThread, create_app
from sluice.tasks.rollout.transfer import FastPathFailed, FastWeights, sender_url_of
from sluice.tasks.run.control import SENDER_FILE, SERVERS_FILE
from sluice.tasks.run.credential import (
    mint_run_token,
    run_token,
    token_path,
    verified_servers,
    write_signed_servers,
)
from sluice.tasks.run.paths import read_json, run_paths, write_json
from sluice.tasks.train.sender import WeightSender

pytestmark = pytest.mark.integration

RUN = "credrun"
WRONG = ("", "Bearer wrong", "Bearer", "{token}", "Bearer {token}x", "Basic {token}")
"""Authorization headers an attacker tries ("" sends none; {token} is the real one)."""


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def attack_bodies(model_dir: Path) -> dict[str, Any]:
    """What a caller would send to each control route to take the server over; a route
    not named here gets an empty object."""
    return {
        "/generate": {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
        "/update_weights_from_disk": {"model_path": str(model_dir), "weight_version": "7"},
        "/init_weights_update_group": {
            "master_address": "127.0.0.1",
            "master_port": _closed_port(),
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "evil",
            "backend": "gloo",
        },  # fmt: skip
        "/update_weights_from_distributed": {
            "names": ["lm_head.weight"],
            "dtypes": ["float32"],
            "shapes": [[1]],
            "group_name": "evil",
            "weight_version": "9",
            "load_format": "flattened_bucket",
        },  # fmt: skip
        "/update_weights_from_tensor": {
            "serialized_named_tensors": [base64.b64encode(b"x").decode()],
            "weight_version": "9",
        },
        "/abort_request": {"abort_all": True},
        "/pause_generation": {"mode": "abort"},
        "/load_lora_adapter": {"lora_name": "9", "lora_path": str(model_dir)},
        "/unload_lora_adapter": {"lora_name": "0"},
        "/destroy_weights_update_group": {"group_name": "evil"},
        "/groups": {"group_name": "evil", "world_size": 2, "backend": "gloo"},
        "/groups/sluice_weights/broadcast": {"version": 1, "bucket": 0},
    }


def routes_of(app: Any) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, path parameters filled in: a route added
    later is attacked without anyone listing it here."""
    found = []
    for route in app.routes:
        path = route.path.replace("{version}", "1").replace("{name}", "sluice_weights")
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            if method != "HEAD":
                found.append((method, path))
    return found


def assert_refused(url: str, routes: list[tuple[str, str]], token: str, bodies: dict) -> int:
    """Every route in `routes` (but /health, /metrics) answers 401 to every wrong
    header, in one line; returns how many requests were refused."""
    refused = 0
    with httpx.Client(timeout=10.0) as http:
        for method, path in routes:
            if path in OPEN_PATHS:
                continue
            body = bodies.get(path, {}) if method in ("POST", "PUT", "DELETE") else None
            for header in WRONG:
                headers = {"Authorization": header.format(token=token)} if header else {}
                answer = http.request(method, url + path, json=body, headers=headers)
                assert answer.status_code == 401, (method, path, header, answer.text)
                assert "\n" not in answer.text and token not in answer.text
                refused += 1
    return refused


def checksum(engine: InferenceEngine) -> float:
    with torch.no_grad():
        return float(sum(p.double().sum() for p in engine.model.parameters()))


@dataclass
class Served:
    url: str
    engine: InferenceEngine
    app: Any
    token: str
    model_dir: Path


@pytest.fixture(scope="module")
def served(one_torch_thread: None, tiny_dir: Path) -> Iterator[Served]:
    token = "t0k3n-" + os.urandom(16).hex()
    engine = InferenceEngine(tiny_dir, max_batch_size=2, seed=0)
    app = create_app(engine, shutdown_engine_on_exit=True, api_key=token)
    server = ServerThread(app)
    url = server.start()
    yield Served(url, engine, app, token, tiny_dir)
    server.stop()


def test_every_control_route_of_the_server_refuses_a_caller_without_the_token(
    served: Served,
) -> None:
    routes = routes_of(served.app)
    paths = {path for _, path in routes}
    expected = {
        "/generate", "/update_weights_from_tensor", "/update_weights_from_disk",
        "/init_weights_update_group", "/update_weights_from_distributed", "/abort_request",
        "/pause_generation", "/continue_generation", "/load_lora_adapter", "/health_generate",
    }  # fmt: skip
    assert expected <= paths  # the attack covers at least these
    before = checksum(served.engine)

    refused = assert_refused(served.url, routes, served.token, attack_bodies(served.model_dir))

    assert refused >= len(expected) * len(WRONG)
    assert served.engine.weight_version == 0  # not 7 or 9
    assert checksum(served.engine) == before  # not a byte of the weights moved
    assert not served.engine.paused
    with httpx.Client(timeout=10.0) as http:  # what a scraper or a probe needs stays open
        assert http.get(served.url + "/health").status_code == 200
        assert http.get(served.url + "/metrics").status_code == 200

    async def as_the_run() -> tuple[int, list[int]]:
        async with InferenceClient([served.url], timeout_s=30, api_key=served.token) as client:
            answer = await client.generate([1, 2, 3], {"max_new_tokens": 3, "temperature": 0})
            info = await client.model_info()
            return int(info[served.url]["weight_version"]), answer.output_token_ids

    version, tokens = asyncio.run(as_the_run())
    assert version == 0 and len(tokens) >= 1


def test_the_server_command_reads_its_token_from_a_0600_file_never_its_argv(
    tmp_path: Path, tiny_dir: Path
) -> None:
    exposed = tmp_path / "exposed.token"
    exposed.write_text("leaky")
    exposed.chmod(0o644)
    with pytest.raises(CredentialError, match="must be 0600"):
        read_token_file(exposed)

    from sluice.infra.config.run import load_config

    config = load_config(None, [f"workdir={tmp_path / 'work'}"])
    path = mint_run_token(config, RUN)
    assert path == token_path(config, RUN)
    assert (path.stat().st_mode & 0o777) == 0o600
    token = run_token(config, RUN)
    port = _closed_port()
    command = [
        sys.executable, "-m", "sluice.infra.serving.server", "--model", str(tiny_dir),
        "--port", str(port), "--num-threads", "1", "--api-key-file", str(path),
        "--log-level", "info",
    ]  # fmt: skip
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        with httpx.Client(timeout=5.0) as http:
            while True:
                assert process.poll() is None, log.read_text()
                try:
                    if http.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the server did not start in 60 s"
                time.sleep(0.2)
            cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{process.pid}/environ").read_bytes()
            assert token.encode() not in cmdline and token.encode() not in environ
            refused = http.post(url + "/update_weights_from_disk", json={"model_path": "/"})
            assert refused.status_code == 401
            version = http.get(
                url + "/get_weight_version", headers={"Authorization": f"Bearer {token}"}
            )
            assert version.status_code == 200 and version.json()["weight_version"] == "0"
    finally:
        process.terminate()
        process.wait(30)
    assert token not in log.read_text()  # uvicorn's access log names paths, not headers


@pytest.fixture(scope="module")
def sender_state(tiny_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()


def open_sender(
    state: dict[str, torch.Tensor], token: str, host: str = "127.0.0.1"
) -> tuple[WeightSender, str]:
    sender = WeightSender(
        dtype=torch.float32, bucket_bytes=1 << 20, group_timeout_s=5, bind_host=host,
        api_key=token,
    )  # fmt: skip
    url = sender.start()
    sender.offer(1, state)
    return sender, url


def test_the_sender_gives_nothing_to_a_caller_without_the_token_and_signs_its_handles(
    tmp_path: Path, local_run_config: Callable[..., Any], sender_state: dict[str, torch.Tensor]
) -> None:
    config = local_run_config(tmp_path)
    token = run_token(config, RUN)
    sender, url = open_sender(sender_state, token)
    try:
        refused = assert_refused(url, routes_of(sender.app()), token, attack_bodies(tmp_path))
        assert refused >= 6 * len(WRONG)
        assert sender.groups == {} and sender.forming == {}  # no group the attacker opened
        assert sorted(sender.held) == [1]
        with httpx.Client(timeout=10.0) as http:
            assert http.get(url + "/health").status_code == 200
            own = {"Authorization": f"Bearer {token}"}
            assert http.get(f"{url}/versions/1", headers=own).json()["version"] == 1
            answer = http.get(f"{url}/versions/1/handles", headers=own).json()

        fast = FastWeights(config, RUN, "shared_memory", "gloo")
        try:
            assert fast.signed_handles(answer, 1) == answer["serialized_named_tensors"]
            with pytest.raises(FastPathFailed, match="not signed"):  # replayed as another
                fast.signed_handles(answer, 2)
            forged = dict(answer, serialized_named_tensors=[base64.b64encode(b"evil").decode()])
            with pytest.raises(FastPathFailed, match="not signed with this run's credential"):
                fast.signed_handles(forged, 1)
            with pytest.raises(FastPathFailed, match="carry no signature"):
                fast.signed_handles(
                    {"serialized_named_tensors": answer["serialized_named_tensors"]}, 1
                )
        finally:
            asyncio.run(fast.aclose())
    finally:
        sender.stop()


def test_a_forged_sender_or_servers_document_is_refused_before_a_url_sees_the_token(
    tmp_path: Path, local_run_config: Callable[..., Any]
) -> None:
    config = local_run_config(tmp_path)
    token = run_token(config, RUN)
    where = f"{run_paths(config, RUN).control}/{SENDER_FILE}"
    trap = socket.socket()  # the attacker's "sender": counts who connects
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.settimeout(0.2)
    document = {"url": f"http://127.0.0.1:{trap.getsockname()[1]}", "pid": 1, "path": "x"}
    try:
        for forged in (document, sign_document("not-the-run-token", document)):
            write_json(config, where, forged)
            with pytest.raises(FastPathFailed, match="not signed with this run's credential"):
                sender_url_of(read_json(config, where), where, lambda: token)
            fast = FastWeights(config, RUN, "shared_memory", "gloo")

            async def attempt(fast: FastWeights = fast) -> None:
                async with InferenceClient(["http://127.0.0.1:9"]) as client:
                    try:
                        await fast.load(client, 1)
                    finally:
                        await fast.aclose()

            with pytest.raises(FastPathFailed, match="not signed"):
                asyncio.run(attempt())
            with pytest.raises(socket.timeout):
                trap.accept()  # nobody ever called the forged URL
        write_json(config, where, sign_document(token, document))
        assert sender_url_of(read_json(config, where), where, lambda: token) == document["url"]
    finally:
        trap.close()

    # The launched servers' document, which names where the token goes with every request.
    servers = f"{run_paths(config, RUN).control}/{SERVERS_FILE}"
    write_signed_servers(config, RUN, ["http://127.0.0.1:1"], actors=["a"])
    assert verified_servers(config, RUN, read_json(config, servers))["urls"] == [
        "http://127.0.0.1:1"
    ]
    redirected = dict(read_json(config, servers) or {}, urls=["http://203.0.113.9:1"])
    with pytest.raises(CredentialError, match="not signed with this run's credential"):
        verified_servers(config, RUN, redirected)


# ---------------------------------------------------------------- another host


@pytest.fixture
def namespace() -> Iterator[tuple[str, str]]:
    """A network namespace joined to this one by a veth pair: (its name, the address of
    this side as the namespace sees it), the way another machine of the cluster would."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("creating a network namespace needs root and iproute2")
    tag = f"{os.getpid() % 100000}"
    name, here, there = f"sluicecred{tag}", f"scr{tag}a", f"scr{tag}b"
    octet = os.getpid() % 200 + 20
    host, peer = f"10.213.{octet}.1", f"10.213.{octet}.2"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    try:
        ip("netns", "add", name)
        ip("link", "add", here, "type", "veth", "peer", "name", there)
        ip("link", "set", there, "netns", name)
        ip("addr", "add", f"{host}/30", "dev", here)
        ip("link", "set", here, "up")
        ip("-n", name, "addr", "add", f"{peer}/30", "dev", there)
        ip("-n", name, "link", "set", there, "up")
        yield name, host
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def from_namespace(name: str, method: str, url: str, token: str | None = None) -> str:
    """The HTTP status a caller inside namespace `name` gets ("000": no connection)."""
    command = ["ip", "netns", "exec", name, "curl", "-s", "-o", "/dev/null", "-X", method]
    command += ["-w", "%{http_code}", "--max-time", "3", url]
    if token is not None:
        command += ["-H", f"Authorization: Bearer {token}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.strip()


def test_a_caller_on_another_host_cannot_reach_the_server_or_steer_the_sender(
    served: Served, namespace: tuple[str, str], sender_state: dict[str, torch.Tensor]
) -> None:
    if shutil.which("curl") is None:
        pytest.skip("needs curl")
    name, host = namespace
    port = served.url.rsplit(":", 1)[1]
    # A server of one node listens on loopback: from another host there is nothing there.
    assert from_namespace(name, "POST", f"http://{host}:{port}/pause_generation") == "000"
    # A sender on a cluster binds the node's private address: reachable, and it refuses.
    sender, url = open_sender(sender_state, served.token, host=host)
    try:
        assert url.startswith(f"http://{host}:")
        assert from_namespace(name, "GET", url + "/health") == "200"
        assert from_namespace(name, "GET", url + "/versions/1") == "401"
        assert from_namespace(name, "POST", url + "/groups") == "401"
        assert from_namespace(name, "GET", url + "/versions/1", token="wrong") == "401"
        assert sender.groups == {} and not served.engine.paused
    finally:
        sender.stop()


def test_a_launched_server_is_handed_the_token_file_and_sglang_gets_api_key_off_its_argv(
    tmp_path: Path,
) -> None:
    from sluice.infra.docker_servers import ServerSpec

    token = "sglang-" + os.urandom(8).hex()
    token_file = tmp_path / "run.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    spec = dict(image="i", model_dir="/m", port=1, weight_version=0, mounts=(str(tmp_path),))
    sluice = ServerSpec(engine="sluice", api_key_file=str(token_file), **spec)  # type: ignore[arg-type]
    assert sluice.command()[-2:] == ["--api-key-file", str(token_file)]
    assert sluice.run_options("r", 0)["user"] == f"{os.getuid()}:{os.getgid()}"  # reads 0600
    sglang = ServerSpec(engine="sglang", api_key_file=str(token_file), **spec)  # type: ignore[arg-type]
    argv = sglang.command()
    assert token not in " ".join(argv + [str(v) for v in sglang.run_options("r", 0).values()])

    # The prologue, run against a stand-in `sglang.launch_server` that reports what it
    # was given and what its own command line shows.
    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(
        "import os, sys\n"
        "cmdline = open(f'/proc/{os.getpid()}/cmdline', 'rb').read().decode()\n"
        "print(repr(sys.argv[1:]), '|', repr(cmdline))\n"
    )
    shown = subprocess.run(
        [sys.executable, *argv[1:]],
        capture_output=True, text=True, timeout=30,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "fake")},
    )  # fmt: skip
    given, cmdline = shown.stdout.split(" | ")
    assert f"'--api-key', '{token}'" in given and "'--model-path', '/m'" in given
    assert token not in cmdline and str(token_file) in cmdline
