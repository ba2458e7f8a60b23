"""Validating SGLang ``/generate`` bodies (and an update's weight version) on the server side.

Everything the server refuses is a ``BadRequestError`` (HTTP 400). Schema
violations answer with SGLang's flat ``{"error": str}`` body, as its own contract
check does; an unknown sampling key reads ``unknown field `key`, expected one of
...``. SGLang features this server does not implement (stop strings, penalties,
constrained decoding, streaming, ...) are accepted only with the values that leave
them off, so a request never silently means something else here than on SGLang.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.engines.inference.types import GenerationRequest, SamplingParams
from sluice.infra.serving.limits import ServerLimits
from sluice.infra.serving.protocol import SGLANG_SAMPLING_KEYS, contract_error_body, error_body

if TYPE_CHECKING:
    from fastapi import Request

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

    def body(self) -> dict[str, Any]:
        return contract_error_body(str(self)) if self.contract else error_body(str(self), 400)


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
    """A finite JSON number (``Infinity`` and ``NaN`` never reach here: ``parse_json``)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class GenerateItem:
    """One prompt of a /generate call before expansion into n samples."""

    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    return_logprob: bool
    rid: str | None


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
            params[key] = float(
                _expect(value, _is_number, f"{where}.{key} must be a finite number")
            )
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


def parse_generate_body(
    body: Any, tokenizer: Any, limits: ServerLimits | None = None, max_context: int | None = None
) -> tuple[list[GenerateItem], int, bool]:
    """Validate a /generate body; return the prompts, n, and whether the input was batched.
    ``limits`` bounds n and prompts per call before any prompt is tokenized or expanded;
    ``max_new_tokens`` may not exceed ``max_context`` (the model's context: no more can
    ever be generated, and the engine stops a sequence at its slot's length anyway)."""
    limits = limits or ServerLimits()
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
        _check_prompt_count(len(prompts), limits)
        for p in prompts:
            if not all(_is_int(t) for t in p):
                raise BadRequestError("input_ids entries must be integers", contract=True)
    else:
        if isinstance(text, str):
            batched, texts = False, [text]
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            batched, texts = True, text
        else:
            raise BadRequestError("text must be a string or a list of strings", contract=True)
        _check_prompt_count(len(texts), limits)
        if tokenizer is None:
            raise BadRequestError(
                "text input needs a tokenizer, and the model directory has none; send input_ids"
            )
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
    if n > limits.max_n:
        raise BadRequestError(f"sampling_params.n is {n}, over this server's bound {limits.max_n}")
    if n * count > limits.max_queued_requests:
        raise BadRequestError(
            f"{count} prompts x n={n} is {n * count} samples, over this server's queue bound "
            f"{limits.max_queued_requests}"
        )
    for index, (params, _) in enumerate(parsed):
        asked = params.get("max_new_tokens")
        if max_context is not None and asked is not None and asked > max_context:
            where = f"prompt {index}: " if count > 1 else ""
            raise BadRequestError(
                f"{where}max_new_tokens={asked} is over the model's context of {max_context} tokens"
            )
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
        GenerateItem(
            prompt_token_ids=prompts[i],
            sampling=parsed[i][0],
            return_logprob=bool(logprob_flags[i]),
            rid=rids[i],
        )
        for i in range(count)
    ]
    return items, n, batched or n > 1


def _check_prompt_count(count: int, limits: ServerLimits) -> None:
    if count > limits.max_prompts_per_call:
        raise BadRequestError(
            f"the call holds {count} prompts, over this server's bound "
            f"{limits.max_prompts_per_call}"
        )


def expand_samples(
    items: list[GenerateItem], n: int
) -> list[tuple[GenerationRequest, GenerateItem, str]]:
    """One engine request per sample, with the id each answer is shown under.

    With ``n > 1`` and a ``sampling_seed``, sample j uses seed ``sampling_seed + j``;
    a caller's ``rid`` names sample j ``{rid}-{j}``.
    """
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


async def json_body(request: Request, *, allow_empty: bool) -> Any:
    """A request's JSON body (`{}` for an empty one when `allow_empty`); 400 if it is none.
    Its size is bounded before it is read (``limits.BodyLimit``)."""
    return parse_json(await request.body(), allow_empty=allow_empty)


def parse_json(raw: bytes, *, allow_empty: bool) -> Any:
    """``raw`` as JSON; BadRequestError in one line for anything else, ``NaN`` and
    ``Infinity`` included (Python's parser takes them; JSON has no such numbers)."""
    if not raw.strip():
        if allow_empty:
            return {}
        raise BadRequestError("the request body is empty; expected a JSON object")
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError as exc:
        raise BadRequestError("the request body is nested too deeply") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from exc


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
