"""SGLang-compatible HTTP server around the Sluice inference engine.

Implements the reinforcement-learning subset of SGLang's native HTTP API
(0.5.x field names), so the rollout side drives this server and a real SGLang
server with the same client:

- ``POST /generate``: ``input_ids`` (or ``text`` when the model directory has
  a tokenizer), single or batched, ``sampling_params`` (one object or one per
  prompt, ``n`` samples each), ``return_logprob``, ``rid``. The response
  carries ``output_ids`` and ``meta_info`` with ``finish_reason``,
  ``output_token_logprobs`` (``[logprob, token_id, null]``) and
  ``weight_versions`` spans (``[start, end)`` over output tokens).
- ``POST /pause_generation`` (``abort`` | ``retract`` | ``in_place``),
  ``POST /continue_generation``, ``POST /update_weights_from_disk``,
  ``POST /abort_request``, ``GET /model_info``, ``GET /server_info``,
  ``GET /health``, ``GET /get_weight_version``.

Departures from SGLang: weight versions are integers (SGLang accepts any
string); ``update_weights_from_disk`` without ``weight_version`` serves the
current version + 1; there is no streaming, no stop strings, no penalties or
constrained decoding (asking for them is a 400, not a silent no-op); with
``n > 1`` and a ``sampling_seed`` sample j uses seed ``sampling_seed + j``.
An unknown sampling key is a 400 whose body, like SGLang's contract check,
is ``{"error": "unknown field `key`, expected one of ..."}``.

Run: ``python -m engines.server --model DIR --port N``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

if TYPE_CHECKING:
    from engines.inference import GenerationOutput, GenerationRequest, InferenceEngine

# SGLang 0.5.x SamplingParams fields, in its order (for error messages).
SGLANG_SAMPLING_KEYS: tuple[str, ...] = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)

# Keys that only shape text/streaming output: accepted with any value.
_INERT_SAMPLING_KEYS = frozenset(
    {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
)

# SGLang features this server does not implement, and the values that mean "off".
_NEUTRAL_SAMPLING_VALUES: dict[str, tuple[Any, ...]] = {
    "stop": (None, "", []),
    "stop_regex": (None, "", []),
    "min_p": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_new_tokens": (None, 0),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None, {}),
    "custom_params": (None,),
    "beam_width": (None, 0, 1),
    "watermark": (None,),
    "choice": (None, []),
}

_NEUTRAL_REQUEST_VALUES: dict[str, tuple[Any, ...]] = {
    "stream": (None, False),
    "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None,),
    "return_hidden_states": (None, False),
    "lora_path": (None,),
    "image_data": (None,),
    "video_data": (None,),
    "audio_data": (None,),
    "custom_logit_processor": (None,),
    "session_params": (None,),
}


class BadRequestError(ValueError):
    """A request the server refuses with HTTP 400."""

    def __init__(self, message: str, *, contract: bool = False) -> None:
        super().__init__(message)
        self.contract = contract
        """True for schema violations, answered with SGLang's flat ``{"error": str}`` body."""

    def response(self) -> JSONResponse:
        body: dict[str, Any] = (
            {"error": str(self)}
            if self.contract
            else {"error": {"message": str(self), "code": 400}}
        )
        return JSONResponse(body, status_code=400)


def _unknown_field(key: str) -> BadRequestError:
    listed = ", ".join(f"`{k}`" for k in SGLANG_SAMPLING_KEYS)
    return BadRequestError(
        f"unknown field `{key}` in sampling_params, expected one of {listed}", contract=True
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_neutral(value: Any, neutrals: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of the values that leave an unsupported feature off."""
    if value is None:
        return None in neutrals
    return any(type(value) is type(n) and value == n for n in neutrals if n is not None)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class _Item:
    """One prompt of a /generate call before expansion into n samples."""

    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    return_logprob: bool
    rid: str | None


@dataclass
class _ServerState:
    engine: InferenceEngine
    tokenizer: Any
    model_path: str
    served_model_name: str
    tokenizer_path: str
    rid_to_engine_ids: dict[str, list[str]] = field(default_factory=dict)


def _expect(value: Any, check: Any, message: str) -> Any:
    if not check(value):
        raise BadRequestError(message, contract=True)
    return value


def parse_sampling_params(raw: Any, index: int | None = None) -> tuple[dict[str, Any], int]:
    """Validate one SGLang ``sampling_params`` object; return engine kwargs and ``n``."""
    where = "sampling_params" if index is None else f"sampling_params[{index}]"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequestError(f"{where} must be a JSON object", contract=True)
    for key, value in raw.items():
        if key not in SGLANG_SAMPLING_KEYS:
            raise _unknown_field(key)
        if key in _NEUTRAL_SAMPLING_VALUES and not _is_neutral(
            value, _NEUTRAL_SAMPLING_VALUES[key]
        ):
            raise BadRequestError(
                f"{where}.{key}={value!r} is not supported by the Sluice inference server"
            )
    params: dict[str, Any] = {}
    value = raw.get("max_new_tokens")
    if value is not None:
        params["max_new_tokens"] = _expect(
            value, _is_int, f"{where}.max_new_tokens must be an integer"
        )
    for key in ("temperature", "top_p"):
        value = raw.get(key)
        if value is not None:
            params[key] = float(_expect(value, _is_number, f"{where}.{key} must be a number"))
    value = raw.get("top_k")
    if value is not None:
        params["top_k"] = _expect(value, _is_int, f"{where}.top_k must be an integer")
    value = raw.get("stop_token_ids")
    if value is not None:
        _expect(
            value,
            lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
            f"{where}.stop_token_ids must be a list of integers",
        )
        params["stop_token_ids"] = tuple(value)
    value = raw.get("ignore_eos")
    if value is not None:
        params["ignore_eos"] = _expect(
            value, lambda v: isinstance(v, bool), f"{where}.ignore_eos must be a boolean"
        )
    value = raw.get("sampling_seed")
    if value is not None:
        params["seed"] = _expect(value, _is_int, f"{where}.sampling_seed must be an integer")
    n = raw.get("n")
    n = 1 if n is None else _expect(n, _is_int, f"{where}.n must be an integer")
    if n < 1:
        raise BadRequestError(f"{where}.n must be >= 1, got {n}")
    return params, n


def _per_item(value: Any, count: int, name: str, batched: bool) -> list[Any]:
    """Broadcast a scalar-or-list request field over the batch."""
    if batched and isinstance(value, list):
        if len(value) != count:
            raise BadRequestError(
                f"{name} has {len(value)} entries but the batch has {count} prompts"
            )
        return value
    return [value] * count


def parse_generate_body(body: Any, tokenizer: Any) -> tuple[list[_Item], int, bool]:
    """Validate a /generate body; return the prompts, n, and whether the input was batched."""
    if not isinstance(body, dict):
        raise BadRequestError("the /generate body must be a JSON object", contract=True)
    for key, neutral in _NEUTRAL_REQUEST_VALUES.items():
        if key in body and not _is_neutral(body[key], neutral):
            raise BadRequestError(
                f"{key}={body[key]!r} is not supported by the Sluice inference server"
            )
    input_ids, text = body.get("input_ids"), body.get("text")
    if (input_ids is None) == (text is None):
        raise BadRequestError("give exactly one of input_ids or text")
    prompts: list[list[int]]
    if input_ids is not None:
        if (
            isinstance(input_ids, list)
            and input_ids
            and all(isinstance(p, list) for p in input_ids)
        ):
            batched, prompts = True, input_ids
        elif isinstance(input_ids, list):
            batched, prompts = False, [input_ids]
        else:
            raise BadRequestError(
                "input_ids must be a list of token ids or a list of such lists", contract=True
            )
        for p in prompts:
            if not all(_is_int(t) for t in p):
                raise BadRequestError("input_ids entries must be integers", contract=True)
    else:
        if tokenizer is None:
            raise BadRequestError(
                "text input needs a tokenizer, and the model directory has none; send input_ids"
            )
        if isinstance(text, str):
            batched, texts = False, [text]
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            batched, texts = True, text
        else:
            raise BadRequestError("text must be a string or a list of strings", contract=True)
        prompts = [list(tokenizer.encode(t)) for t in texts]
    if not prompts:
        raise BadRequestError("the batch holds no prompts")
    count = len(prompts)
    raw_params = body.get("sampling_params")
    if isinstance(raw_params, list) and not batched:
        raise BadRequestError("sampling_params is a list but input is a single prompt")
    param_list = _per_item(raw_params, count, "sampling_params", batched)
    parsed = [
        parse_sampling_params(p, i if isinstance(raw_params, list) else None)
        for i, p in enumerate(param_list)
    ]
    ns = {n for _, n in parsed}
    if len(ns) != 1:
        raise BadRequestError("every sampling_params entry of a batch must use the same n")
    n = ns.pop()
    logprob_flags = _per_item(body.get("return_logprob"), count, "return_logprob", batched)
    for flag in logprob_flags:
        if flag is not None and not isinstance(flag, bool):
            raise BadRequestError(
                "return_logprob must be a boolean or a list of booleans", contract=True
            )
    raw_rid = body.get("rid")
    if raw_rid is None:
        rids: list[Any] = [None] * count
    elif batched and isinstance(raw_rid, list):
        rids = _per_item(raw_rid, count, "rid", batched)
    elif not batched and isinstance(raw_rid, str):
        rids = [raw_rid]
    else:
        raise BadRequestError(
            "rid must be a string for a single prompt or a list of strings for a batch",
            contract=True,
        )
    for rid in rids:
        if rid is not None and not isinstance(rid, str):
            raise BadRequestError("rid entries must be strings", contract=True)
    items = [
        _Item(
            prompt_token_ids=prompts[i],
            sampling=parsed[i][0],
            return_logprob=bool(logprob_flags[i]),
            rid=rids[i],
        )
        for i in range(count)
    ]
    return items, n, batched or n > 1


def weight_version_spans(token_versions: list[int], current_version: int) -> list[dict[str, Any]]:
    """Collapse per-token versions into SGLang ``weight_versions`` spans (half-open)."""
    if not token_versions:
        return [{"version": str(current_version), "start": 0, "end": 0}]
    spans: list[dict[str, Any]] = []
    for index, version in enumerate(token_versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": str(version), "start": index, "end": index + 1})
    return spans


def _finish_reason(output: GenerationOutput) -> dict[str, Any]:
    if output.finish_reason == "stop":
        return {"type": "stop", "matched": output.matched_stop_token_id}
    if output.finish_reason == "length":
        return {"type": "length", "length": len(output.output_token_ids)}
    return {"type": "abort", "message": output.abort_message}


def build_generate_response(
    output: GenerationOutput,
    *,
    display_id: str,
    return_logprob: bool,
    current_version: int,
    tokenizer: Any,
) -> dict[str, Any]:
    """One SGLang ``/generate`` response object."""
    spans = weight_version_spans(output.token_versions, current_version)
    meta: dict[str, Any] = {
        "id": display_id,
        "finish_reason": _finish_reason(output),
        "prompt_tokens": output.prompt_length,
        "completion_tokens": len(output.output_token_ids),
        "cached_tokens": 0,
        "e2e_latency": output.e2e_latency_s,
        "weight_version": spans[-1]["version"],
        "weight_versions": spans,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [logprob, token, None]
            for logprob, token in zip(
                output.behaviour_logprobs, output.output_token_ids, strict=True
            )
        ]
    text = (
        tokenizer.decode(output.output_token_ids, skip_special_tokens=True)
        if tokenizer is not None
        else ""
    )
    return {"text": text, "output_ids": list(output.output_token_ids), "meta_info": meta}


async def _json_body(request: Request, *, allow_empty: bool) -> Any:
    raw = await request.body()
    if not raw.strip():
        if allow_empty:
            return {}
        raise BadRequestError("the request body is empty; expected a JSON object")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from exc


def _parse_version(value: Any, current: int) -> int:
    if value is None:
        return current + 1
    if _is_int(value):
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    raise BadRequestError(f"weight_version must be an integer policy version, got {value!r}")


def create_app(
    engine: InferenceEngine,
    *,
    tokenizer: Any = None,
    served_model_name: str | None = None,
    shutdown_engine_on_exit: bool = False,
) -> FastAPI:
    """FastAPI app serving ``engine``; starts its scheduler thread on startup."""
    from contextlib import asynccontextmanager

    from engines.inference import (
        EngineShutdownError,
        GenerationRequest,
        SamplingParams,
        WeightLoadError,
    )

    state = _ServerState(
        engine=engine,
        tokenizer=tokenizer,
        model_path=engine.model_dir,
        served_model_name=served_model_name or engine.model_dir,
        tokenizer_path=engine.model_dir if tokenizer is not None else "",
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        engine.start()
        yield
        if shutdown_engine_on_exit:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="Sluice inference server", lifespan=lifespan)

    @app.exception_handler(BadRequestError)
    async def _bad_request(_: Request, exc: BadRequestError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": f"internal error: {type(exc).__name__}: {exc}", "code": 500}},
            status_code=500,
        )

    def _expand(items: list[_Item], n: int) -> list[tuple[GenerationRequest, _Item, str]]:
        expanded = []
        for item in items:
            for j in range(n):
                sampling = dict(item.sampling)
                if j and sampling.get("seed") is not None:
                    sampling["seed"] = sampling["seed"] + j
                display = item.rid if item.rid is not None and n == 1 else None
                if display is None:
                    display = f"{item.rid}-{j}" if item.rid is not None else uuid.uuid4().hex
                request = GenerationRequest(
                    prompt_token_ids=item.prompt_token_ids,
                    sampling=SamplingParams(**sampling),
                    request_id=uuid.uuid4().hex,
                )
                expanded.append((request, item, display))
        return expanded

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> JSONResponse:
        body = await _json_body(request, allow_empty=False)
        items, n, as_list = parse_generate_body(body, state.tokenizer)
        expanded = _expand(items, n)
        # Validate everything before queueing anything: a bad prompt in a
        # batch rejects the whole call and leaves nothing half-submitted.
        for index, (gen_request, _, _) in enumerate(expanded):
            try:
                engine.validate_request(gen_request)
            except ValueError as exc:
                where = f"prompt {index // n}: " if len(items) > 1 else ""
                raise BadRequestError(f"{where}{exc}") from exc
        engine_ids: list[str] = []
        try:
            for gen_request, _, display in expanded:
                engine_ids.append(engine.submit(gen_request))
                state.rid_to_engine_ids.setdefault(display, []).append(engine_ids[-1])
            outputs = await asyncio.gather(
                *(asyncio.wrap_future(engine.future(i)) for i in engine_ids)
            )
        except EngineShutdownError as exc:
            return JSONResponse({"error": {"message": str(exc), "code": 503}}, status_code=503)
        except asyncio.CancelledError:
            for engine_id in engine_ids:
                engine.abort(engine_id, "client disconnected")
            raise
        finally:
            for engine_id in engine_ids:
                engine.forget(engine_id)
            for _, _, display in expanded:
                state.rid_to_engine_ids.pop(display, None)
        responses = [
            build_generate_response(
                output,
                display_id=display,
                return_logprob=item.return_logprob,
                current_version=engine.weight_version,
                tokenizer=state.tokenizer,
            )
            for output, (_, item, display) in zip(outputs, expanded, strict=True)
        ]
        return JSONResponse(responses if as_list else responses[0])

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        body = await _json_body(request, allow_empty=True)
        if not isinstance(body, dict):
            raise BadRequestError("the /pause_generation body must be a JSON object", contract=True)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequestError(
                f"mode must be one of 'abort', 'retract', 'in_place', got {mode!r}"
            )
        await asyncio.to_thread(engine.pause, mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> JSONResponse:
        await _json_body(request, allow_empty=True)
        await asyncio.to_thread(engine.continue_generation)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await _json_body(request, allow_empty=False)
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
        version = _parse_version(body.get("weight_version"), engine.weight_version)
        try:
            report = await asyncio.to_thread(
                engine.update_weights_from_disk, model_path, version, abort_all_requests=abort_all
            )
        except (WeightLoadError, ValueError, RuntimeError) as exc:
            return JSONResponse(
                {"success": False, "message": str(exc), "num_paused_requests": 0}, status_code=400
            )
        state.model_path = model_path
        return JSONResponse(
            {
                "success": True,
                "message": f"Succeeded to update model weights to version {report.weight_version}.",
                "num_paused_requests": report.num_recomputed_requests,
            }
        )

    @app.post("/abort_request")
    async def abort_request(request: Request) -> JSONResponse:
        body = await _json_body(request, allow_empty=False)
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
            "weight_version": str(engine.weight_version),
            "load_format": None,
            "reasoning_parser": None,
            "tool_call_parser": None,
            "model_type": engine.model_type,
            "architectures": list(getattr(config, "architectures", None) or []),
        }

    @app.get("/model_info")
    async def model_info() -> JSONResponse:
        return JSONResponse(_model_info())

    @app.get("/get_model_info")
    async def get_model_info() -> JSONResponse:
        return JSONResponse(_model_info())

    @app.get("/server_info")
    async def server_info() -> JSONResponse:
        return JSONResponse(
            {
                "model_path": state.model_path,
                "served_model_name": state.served_model_name,
                "tokenizer_path": state.tokenizer_path,
                "max_context_length": engine.max_seq_len,
                "max_total_num_tokens": engine.max_seq_len * engine.max_batch_size,
                "version": "sluice",
                "internal_states": [
                    {
                        "num_running_reqs": engine.num_running,
                        "num_waiting_reqs": engine.num_waiting,
                        "paused": engine.paused,
                        "weight_version": str(engine.weight_version),
                    }
                ],
            }
        )

    @app.get("/get_weight_version")
    async def get_weight_version() -> JSONResponse:
        return JSONResponse({"weight_version": str(engine.weight_version)})

    @app.get("/health")
    @app.get("/health_generate")
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
) -> None:
    """Load ``model_dir`` and serve it until interrupted."""
    import uvicorn

    from engines.inference import InferenceEngine

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
        prog="python -m engines.server",
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
    args = parser.parse_args(argv)
    if args.exit_with_parent:
        exit_with_parent(os.getppid())
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
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
    )


if __name__ == "__main__":
    main()
