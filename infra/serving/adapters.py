"""SGLang's LoRA routes on Sluice's server: ``/load_lora_adapter``, ``/unload_lora_adapter``
and the ``lora_path`` a ``/generate`` request names.

SGLang holds several adapters and serves each request with the one it names. Sluice's
engine holds one, folded into the base weights (``InferenceEngine.update_weights_from_disk``
on an adapter directory): loading an adapter is a weight update, interruptible like any
other, and a request naming an adapter this server loaded earlier is served by the newest
one, its ``weight_versions`` saying so, as an in-flight request is after a full update.
A request naming an adapter never loaded (or unloaded) is refused, as SGLang refuses it.
Adapters are named by the policy version they are ("7"), which is the version the
server reports for the tokens they produce.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sluice.engines.inference.types import WeightLoadError
from sluice.infra.serving import protocol
from sluice.infra.serving.request_parsing import BadRequestError, json_body

if TYPE_CHECKING:
    from sluice.engines.inference.engine import InferenceEngine


def _answer(adapters: dict[str, str], error: str | None = None) -> JSONResponse:
    body = protocol.LoraUpdateAnswer(
        success=error is None, error_message=error, loaded_adapters=dict(adapters)
    )
    return JSONResponse(body, status_code=200 if error is None else 400)


def _name(body: Any, route: str) -> str:
    if not isinstance(body, dict):
        raise BadRequestError(f"the {route} body must be a JSON object", contract=True)
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise BadRequestError("lora_name must be a non-empty string")
    return name


def add_adapter_routes(app: FastAPI, engine: InferenceEngine, adapters: dict[str, str]) -> None:
    """Serve the LoRA routes; `adapters` (name -> path) is what the server has loaded."""

    @app.post(protocol.LOAD_LORA_ADAPTER)
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body = await json_body(request, allow_empty=False)
        name = _name(body, protocol.LOAD_LORA_ADAPTER)
        path = body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise BadRequestError("lora_path must be a non-empty string")
        version = protocol.parse_version_label(name)
        if version is None:
            return _answer(
                adapters,
                f"lora_name {name!r}: Sluice's server names an adapter by the integer "
                "policy version it is",
            )
        try:
            await asyncio.to_thread(engine.load_adapter, path, version)
        except (WeightLoadError, ValueError, RuntimeError) as exc:
            return _answer(adapters, str(exc))
        adapters[name] = path
        return _answer(adapters)

    @app.post(protocol.UNLOAD_LORA_ADAPTER)
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        name = _name(await json_body(request, allow_empty=False), protocol.UNLOAD_LORA_ADAPTER)
        if adapters.pop(name, None) is None:
            return _answer(adapters, f"LoRA adapter {name!r} is not loaded")
        return _answer(adapters)


def check_adapter_names(body: Any, adapters: dict[str, str]) -> Any:
    """`body` without its ``lora_path``, once every adapter it names is loaded."""
    if not isinstance(body, dict) or body.get("lora_path") is None:
        return body
    named = body["lora_path"]
    for name in named if isinstance(named, list) else [named]:
        if name is not None and name not in adapters:
            loaded = ", ".join(sorted(adapters)) or "none"
            raise BadRequestError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
    return {key: value for key, value in body.items() if key != "lora_path"}
