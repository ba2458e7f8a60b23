"""SGLang-compatible HTTP server around the Sluice inference engine.

Serves ``sluice.engines.inference`` over the routes and bodies of
``sluice.infra.serving.protocol`` (SGLang 0.5.x native API), so the rollout side drives
this server and a real SGLang server with the same client. Request validation
lives in ``request_parsing``.

Departures from SGLang: weight versions are policy steps, or ``r<incarnation>/v<step>``
labels (SGLang accepts any string), and an update older in (incarnation, step) order
than what is served is refused (``versions``); ``update_weights_from_disk`` without
``weight_version`` serves the current version + 1; ``n``, prompts per call, body bytes
and the waiting queue are bounded (``limits``); there is no streaming, no stop strings,
no penalties or constrained decoding (asking for them is a 400, not a silent no-op);
with ``n > 1`` and a ``sampling_seed`` sample j uses seed ``sampling_seed + j``.
An unknown sampling key is a 400 whose body, like SGLang's contract check,
is ``{"error": "unknown field `key`, expected one of ..."}``. ``/metrics`` (Prometheus
text, ``server_metrics``) is always on, where SGLang needs ``--enable-metrics``.

Run: ``python -m sluice.infra.serving.server --model DIR --port N``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sluice.engines.inference.types import PauseMode, WeightLoadError
from sluice.infra.process_stats import peak_rss_mb
from sluice.infra.serving import protocol
from sluice.infra.serving.adapters import add_adapter_routes
from sluice.infra.serving.auth import read_token_file, require_token
from sluice.infra.serving.generate_route import add_generate_route
from sluice.infra.serving.limits import BodyLimit, ServerLimits, add_limit_arguments, limits_of
from sluice.infra.serving.request_parsing import BadRequestError, json_body
from sluice.infra.serving.server_metrics import (
    CONTENT_TYPE,
    METRICS_ROUTE,
    RecordingEngine,
    ServingMetrics,
)
from sluice.infra.serving.versions import VersionOrder, parse_label
from sluice.infra.serving.weight_routes import add_weight_routes

if TYPE_CHECKING:
    from sluice.engines.inference.engine import InferenceEngine


@dataclass
class _ServerState:
    engine: InferenceEngine
    tokenizer: Any
    model_path: str
    served_model_name: str
    tokenizer_path: str
    rid_to_engine_ids: dict[str, list[str]] = field(default_factory=dict)
    adapters: dict[str, str] = field(default_factory=dict)
    """LoRA adapters loaded (name -> directory; infra/serving/adapters.py)."""


def create_app(
    engine: InferenceEngine,
    *,
    tokenizer: Any = None,
    served_model_name: str | None = None,
    shutdown_engine_on_exit: bool = False,
    weight_group_timeout_s: float = 60.0,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """FastAPI app serving ``engine``; starts its scheduler thread on startup. A weight
    group's collectives (``weight_routes``) end within ``weight_group_timeout_s``. With
    `api_key`, every route but /health and /metrics needs it as a bearer token (auth.py).
    `limits` bounds what one request may ask (``limits.ServerLimits``)."""
    from contextlib import asynccontextmanager

    limits = limits or ServerLimits()
    order = VersionOrder()  # updates only move forward in (incarnation, step): versions.py

    state = _ServerState(
        engine=engine,
        tokenizer=tokenizer,
        model_path=engine.model_dir,
        served_model_name=served_model_name or engine.model_dir,
        tokenizer_path=engine.model_dir if tokenizer is not None else "",
    )
    metrics = ServingMetrics(engine, state.served_model_name)
    # What the update routes call: the engine, with each applied update also counted.
    updates = cast("InferenceEngine", RecordingEngine(engine, metrics))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        engine.start()
        yield
        if shutdown_engine_on_exit:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="Sluice inference server", lifespan=lifespan)
    require_token(app, api_key)
    app.add_middleware(BodyLimit, max_bytes=limits.max_request_bytes)

    @app.exception_handler(BadRequestError)
    async def _bad_request(_: Request, exc: BadRequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            protocol.error_body(f"internal error: {type(exc).__name__}: {exc}", 500),
            status_code=500,
        )

    def _decode(token_ids: list[int]) -> str:
        if state.tokenizer is None:
            return ""
        return str(state.tokenizer.decode(token_ids, skip_special_tokens=True))

    add_generate_route(app, engine, state, limits, _decode)

    @app.post(protocol.PAUSE_GENERATION)
    async def pause_generation(request: Request) -> JSONResponse:
        body = await json_body(request, allow_empty=True)
        if not isinstance(body, dict):
            raise BadRequestError("the /pause_generation body must be a JSON object", contract=True)
        mode = body.get("mode", PauseMode.ABORT.value)
        if mode not in protocol.PAUSE_MODES:
            listed = ", ".join(repr(m) for m in protocol.PAUSE_MODES)
            raise BadRequestError(f"mode must be one of {listed}, got {mode!r}")
        await asyncio.to_thread(engine.pause, mode)
        metrics.paused()
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post(protocol.CONTINUE_GENERATION)
    async def continue_generation(request: Request) -> JSONResponse:
        await json_body(request, allow_empty=True)
        await asyncio.to_thread(engine.continue_generation)
        metrics.continued()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post(protocol.UPDATE_WEIGHTS_FROM_DISK)
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await json_body(request, allow_empty=False)
        if not isinstance(body, dict):
            raise BadRequestError(
                "the /update_weights_from_disk body must be a JSON object", contract=True
            )
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise BadRequestError("model_path must be a non-empty string")
        load_format = body.get("load_format")
        if load_format not in (None, "auto", "safetensors", "pt"):
            raise BadRequestError(
                f"load_format={load_format!r} is not supported by the Sluice inference server"
            )
        abort_all = body.get("abort_all_requests", False)
        if not isinstance(abort_all, bool):
            raise BadRequestError("abort_all_requests must be a boolean")
        label = parse_label(body.get("weight_version"), engine.weight_version)
        version = order.admit(label, engine.weight_version)
        try:
            report = await asyncio.to_thread(
                updates.update_weights_from_disk, model_path, version, abort_all_requests=abort_all
            )
        except (WeightLoadError, ValueError, RuntimeError) as exc:
            failed = protocol.UpdateWeightsAnswer(
                success=False, message=str(exc), num_paused_requests=0
            )
            return JSONResponse(failed, status_code=400)
        state.model_path = model_path
        order.served(label)
        return JSONResponse(
            protocol.UpdateWeightsAnswer(
                success=True,
                message=f"Succeeded to update model weights to version {report.weight_version}.",
                num_paused_requests=report.num_recomputed_requests,
            )
        )

    @app.post(protocol.ABORT_REQUEST)
    async def abort_request(request: Request) -> JSONResponse:
        body = await json_body(request, allow_empty=False)
        if not isinstance(body, dict):
            raise BadRequestError("the /abort_request body must be a JSON object", contract=True)
        if body.get("abort_all"):
            await asyncio.to_thread(engine.abort_all)
            return JSONResponse({"success": True})
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise BadRequestError("rid must be a string (or set abort_all)")
        ids = list(state.rid_to_engine_ids.get(rid, []))
        aborted = [await asyncio.to_thread(engine.abort, i) for i in ids]
        return JSONResponse({"success": any(aborted)})

    def _model_info() -> dict[str, Any]:
        config = engine.model.config
        return {
            "model_path": state.model_path,
            "served_model_name": state.served_model_name,
            "tokenizer_path": state.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": protocol.version_label(engine.weight_version),
            "load_format": None,
            "reasoning_parser": None,
            "tool_call_parser": None,
            "model_type": engine.model_type,
            "architectures": list(getattr(config, "architectures", None) or []),
        }

    @app.get(protocol.MODEL_INFO)
    async def model_info() -> JSONResponse:
        return JSONResponse(_model_info())

    @app.get(protocol.GET_MODEL_INFO)
    async def get_model_info() -> JSONResponse:
        return JSONResponse(_model_info())

    @app.get(protocol.SERVER_INFO)
    async def server_info() -> JSONResponse:
        return JSONResponse(
            {
                "model_path": state.model_path,
                "served_model_name": state.served_model_name,
                "tokenizer_path": state.tokenizer_path,
                "max_context_length": engine.max_seq_len,
                "max_total_num_tokens": engine.max_seq_len * engine.max_batch_size,
                "device": str(engine.device),
                "dtype": str(engine.dtype).removeprefix("torch."),
                "version": "sluice",
                "internal_states": [
                    {
                        "num_running_reqs": engine.num_running,
                        "num_waiting_reqs": engine.num_waiting,
                        "paused": engine.paused,
                        "weight_version": protocol.version_label(engine.weight_version),
                        # Sluice's own: measured step costs for the capacity planner.
                        "step_profile": engine.profile.as_dict(),
                        "peak_rss_mb": peak_rss_mb(),
                    }
                ],
            }
        )

    @app.get(protocol.GET_WEIGHT_VERSION)
    async def get_weight_version() -> JSONResponse:
        return JSONResponse({"weight_version": protocol.version_label(engine.weight_version)})

    @app.get(METRICS_ROUTE)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    add_adapter_routes(app, updates, state.adapters)
    add_weight_routes(app, updates, weight_group_timeout_s, limits, order)

    @app.get(protocol.HEALTH)
    @app.get(protocol.HEALTH_GENERATE)
    async def health() -> Response:
        return Response(status_code=200 if engine.is_serving else 503)

    return app


def load_tokenizer(model_dir: str) -> Any:
    """The model directory's tokenizer, or None when it has none."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError):
        return None


class ServerThread:
    """Runs an app under uvicorn in a daemon thread (port 0 picks a free port)."""

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        import uvicorn

        self._server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level=log_level)
        )
        self._thread = threading.Thread(target=self._server.run, name="sluice-http", daemon=True)
        self.host = host
        self.port = port

    def start(self, timeout_s: float = 30.0) -> str:
        """Start serving and return the base URL."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the HTTP server on {self.host}:{self.port} failed to start")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the HTTP server on {self.host}:{self.port} did not start in {timeout_s} s"
                )
            time.sleep(0.01)
        self.port = int(self._server.servers[0].sockets[0].getsockname()[1])
        return self.url

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=timeout_s)


def serve(
    model_dir: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    max_batch_size: int = 64,
    max_seq_len: int | None = None,
    seed: int = 0,
    weight_version: int = 0,
    num_threads: int | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    weight_noise_std: float = 0.0,
    weight_group_timeout_s: float = 60.0,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
) -> None:
    """Load ``model_dir`` and serve it until interrupted."""
    import uvicorn

    from sluice.engines.inference.engine import InferenceEngine

    engine = InferenceEngine(
        model_dir,
        device=device,
        dtype=dtype,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        seed=seed,
        weight_version=weight_version,
        num_threads=num_threads,
        weight_noise_std=weight_noise_std,
    )
    app = create_app(
        engine,
        tokenizer=load_tokenizer(model_dir),
        served_model_name=served_model_name,
        shutdown_engine_on_exit=True,
        weight_group_timeout_s=weight_group_timeout_s,
        api_key=api_key,
        limits=limits,
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> threading.Thread:
    """SIGTERM this process (a graceful shutdown) once `parent_pid` is no longer its parent."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.infra.serving.server",
        description="Serve a Hugging Face causal LM over SGLang's native HTTP API.",
    )
    parser.add_argument("--model", required=True, help="local Hugging Face model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", default="cpu", help="cpu, cuda[:i], or auto (cuda if present)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--max-batch-size", type=int, default=64, help="KV slots (sequences decoded together)"
    )
    parser.add_argument(
        "--max-seq-len", type=int, default=None, help="prompt + response tokens per slot"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--weight-version", type=int, default=0, help="policy version of the initial weights"
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="shut down when the process that started this one is gone (a role killed "
        "with SIGKILL cannot stop its server itself)",
    )
    parser.add_argument(
        "--weight-noise-std",
        type=float,
        default=0.0,
        help="relative std of Gaussian noise added to every weight loaded, seeded by "
        "(--seed, weight version): injects train-inference mismatch on purpose (0 = off)",
    )
    parser.add_argument(
        "--weight-group-timeout-s",
        type=float,
        default=60.0,
        help="deadline of every collective in a weight group (/init_weights_update_group): "
        "forming it, and each broadcast a trainer sends",
    )
    parser.add_argument(
        "--api-key-file", help="0600 file with the bearer token (SGLang's --api-key)"
    )
    add_limit_arguments(parser)
    args = parser.parse_args(argv)
    api_key = read_token_file(args.api_key_file) if args.api_key_file else None
    if args.exit_with_parent:
        exit_with_parent(os.getppid())
    from sluice.engines.policy.model import resolve_device

    device = resolve_device(args.device)
    serve(
        args.model,
        args.host,
        args.port,
        device=device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        seed=args.seed,
        weight_version=args.weight_version,
        num_threads=args.num_threads,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
        weight_noise_std=args.weight_noise_std,
        weight_group_timeout_s=args.weight_group_timeout_s,
        api_key=api_key,
        limits=limits_of(args),
    )


if __name__ == "__main__":
    main()
