"""``/generate`` on Sluice's server: parse and check off the event loop, bound the queue,
submit a call's samples as one arrival, answer in SGLang's shape.

Parsing, tokenizing and checking a call run in a worker thread, so a large call never
holds up ``/health`` or the control routes; a call whose samples would take the waiting
queue past ``ServerLimits.max_queued_requests`` gets 503 and queues nothing (SGLang's
answer to a full queue), before any of it reaches the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sluice.engines.inference.types import EngineShutdownError, GenerationRequest
from sluice.infra.serving import protocol
from sluice.infra.serving.adapters import check_adapter_names
from sluice.infra.serving.limits import ServerLimits
from sluice.infra.serving.request_parsing import (
    BadRequestError,
    GenerateItem,
    expand_samples,
    parse_generate_body,
    parse_json,
)

if TYPE_CHECKING:
    from sluice.engines.inference.engine import InferenceEngine

Expanded = list[tuple[GenerationRequest, GenerateItem, str]]


def model_context(engine: InferenceEngine) -> int:
    """Tokens the model can attend over (its position embeddings), at least a slot's."""
    positions = getattr(engine.model.config, "max_position_embeddings", None)
    return max(int(positions or 0), engine.max_seq_len)


def add_generate_route(
    app: FastAPI,
    engine: InferenceEngine,
    state: Any,
    limits: ServerLimits,
    decode: Callable[[list[int]], str],
) -> None:
    """Serve ``/generate`` for ``engine``; ``state`` holds the tokenizer, the adapters
    loaded and the caller ids of calls in flight (``server._ServerState``)."""
    context = model_context(engine)

    def prepare(raw: bytes) -> tuple[Expanded, int, bool, int]:
        body = check_adapter_names(parse_json(raw, allow_empty=False), state.adapters)
        items, n, as_list = parse_generate_body(body, state.tokenizer, limits, context)
        expanded = expand_samples(items, n)
        # Validate everything before queueing anything: a bad prompt in a batch rejects
        # the whole call and leaves nothing half-submitted. A prompt's n samples differ
        # in their seeds only, so its first stands for all.
        for index in range(len(items)):
            try:
                engine.validate_request(expanded[index * n][0])
            except ValueError as exc:
                where = f"prompt {index}: " if len(items) > 1 else ""
                raise BadRequestError(f"{where}{exc}") from exc
        return expanded, n, as_list, len(items)

    @app.api_route(protocol.GENERATE, methods=["POST", "PUT"])
    async def generate(request: Request) -> JSONResponse:
        expanded, _, as_list, _ = await asyncio.to_thread(prepare, await request.body())
        if engine.num_waiting + len(expanded) > limits.max_queued_requests:
            message = (
                f"the request queue is full ({engine.num_waiting} waiting, this call "
                f"{len(expanded)}, bound {limits.max_queued_requests}); retry later"
            )
            return JSONResponse(protocol.error_body(message, 503), status_code=503)
        engine_ids: list[str] = []
        try:
            # One arrival: the engine's next step holds the whole call (a GRPO group, or
            # an on-policy batch), scheduled as the in-process loop schedules it.
            engine_ids = engine.submit_many(gen_request for gen_request, _, _ in expanded)
            for engine_id, (_, _, display) in zip(engine_ids, expanded, strict=True):
                state.rid_to_engine_ids.setdefault(display, []).append(engine_id)
            outputs = await asyncio.gather(
                *(asyncio.wrap_future(engine.future(i)) for i in engine_ids)
            )
        except EngineShutdownError as exc:
            return JSONResponse(protocol.error_body(str(exc), 503), status_code=503)
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
            protocol.encode_generate_response(
                output,
                display_id=display,
                return_logprob=item.return_logprob,
                current_version=engine.weight_version,
                text=decode(output.output_token_ids),
            )
            for output, (_, item, display) in zip(outputs, expanded, strict=True)
        ]
        return JSONResponse(responses if as_list else responses[0])
