"""The wire schema Sluice's inference server and client share: SGLang's native HTTP API.

The reinforcement-learning subset of SGLang 0.5.x, with its field names, so the
rollout side drives Sluice's own server (``sluice.infra.serving.server``) and a real SGLang
server with one client (``sluice.infra.serving.client``). This module states once what
both sides speak: the routes, the request bodies, the pause modes, how a
``/generate`` answer encodes tokens, logprobs, finish reasons and policy versions,
and how errors are shaped. The server encodes with these functions and the client
decodes with them.

- ``POST /generate``: ``input_ids`` (or ``text``), single or batched,
  ``sampling_params`` (one object or one per prompt, ``n`` samples each),
  ``return_logprob``, ``rid``. The answer carries ``output_ids`` and ``meta_info``
  with ``finish_reason``, ``output_token_logprobs`` (``[logprob, token_id, null]``)
  and ``weight_versions`` spans (``[start, end)`` over output tokens).
- ``POST /pause_generation`` (``mode``: see ``PauseMode``), ``POST
  /continue_generation``, ``POST /update_weights_from_disk``, ``POST
  /abort_request``, ``GET /model_info``, ``GET /server_info``, ``GET /health``,
  ``GET /get_weight_version``.
- Weights from a trainer process: ``POST /init_weights_update_group``, ``POST
  /update_weights_from_distributed``, ``POST /update_weights_from_tensor``, ``POST
  /destroy_weights_update_group`` (``sluice.infra.serving.weight_routes``).
- LoRA: ``POST /load_lora_adapter`` (``lora_name``, ``lora_path``), ``POST
  /unload_lora_adapter``, and ``lora_path`` on ``/generate`` naming the adapter a
  request is served with.

SGLang labels weight versions with strings; Sluice's are integer policy versions
sent as decimal strings. A server started without ``--weight-version`` reports
``"default"``, which the client maps to a version it is told.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict, get_args

from sluice.engines.inference.types import FinishReason, GenerationOutput, PauseMode
from sluice.engines.trajectory import version_bounds

# ------------------------------------------------------------------ routes

GENERATE = "/generate"
PAUSE_GENERATION = "/pause_generation"
CONTINUE_GENERATION = "/continue_generation"
UPDATE_WEIGHTS_FROM_DISK = "/update_weights_from_disk"
ABORT_REQUEST = "/abort_request"
MODEL_INFO = "/model_info"
GET_MODEL_INFO = "/get_model_info"
SERVER_INFO = "/server_info"
GET_WEIGHT_VERSION = "/get_weight_version"
HEALTH = "/health"
HEALTH_GENERATE = "/health_generate"
LOAD_LORA_ADAPTER = "/load_lora_adapter"
UNLOAD_LORA_ADAPTER = "/unload_lora_adapter"
INIT_WEIGHTS_UPDATE_GROUP = "/init_weights_update_group"
DESTROY_WEIGHTS_UPDATE_GROUP = "/destroy_weights_update_group"
UPDATE_WEIGHTS_FROM_DISTRIBUTED = "/update_weights_from_distributed"
UPDATE_WEIGHTS_FROM_TENSOR = "/update_weights_from_tensor"

# ------------------------------------------------------------ vocabularies

PAUSE_MODES: tuple[str, ...] = tuple(mode.value for mode in PauseMode)
"""``/pause_generation`` modes, in ``PauseMode``'s order (``abort`` is SGLang's default)."""

FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)
"""``meta_info.finish_reason.type`` values."""

DEFAULT_VERSION_LABEL = "default"
"""The weight version SGLang reports when started without ``--weight-version``."""

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

# ----------------------------------------------------------- request bodies

_BASE_REQ_FIELDS = ("rid", "http_worker_ipc")
INIT_GROUP_FIELDS: tuple[str, ...] = (
    "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend",
    *_BASE_REQ_FIELDS,
)  # fmt: skip
"""``/init_weights_update_group`` (SGLang's ``InitWeightsUpdateGroupReqInput``)."""
DESTROY_GROUP_FIELDS: tuple[str, ...] = ("group_name", *_BASE_REQ_FIELDS)
"""``/destroy_weights_update_group`` (``DestroyWeightsUpdateGroupReqInput``)."""
DISTRIBUTED_FIELDS: tuple[str, ...] = (
    "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
    "weight_version", "load_format", "selector", "torch_empty_cache", *_BASE_REQ_FIELDS,
)  # fmt: skip
"""``/update_weights_from_distributed`` (``UpdateWeightsFromDistributedReqInput``)."""
TENSOR_FIELDS: tuple[str, ...] = (
    "serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
    "weight_version", "selector", "torch_empty_cache", *_BASE_REQ_FIELDS,
)  # fmt: skip
"""``/update_weights_from_tensor`` (``UpdateWeightsFromTensorReqInput``)."""


class GenerateBody(TypedDict, total=False):
    """``POST /generate`` as the client sends it (the server also takes ``text``): one
    prompt, or a batch of prompts with one ``sampling_params`` each."""

    input_ids: list[int] | list[list[int]]
    sampling_params: dict[str, Any] | list[dict[str, Any]]
    return_logprob: bool
    rid: str
    lora_path: str


class PauseBody(TypedDict):
    """``POST /pause_generation``."""

    mode: str


class UpdateWeightsBody(TypedDict, total=False):
    """``POST /update_weights_from_disk``; ``weight_version`` is a label (a string)."""

    model_path: str
    weight_version: str
    abort_all_requests: bool
    load_format: str


class LoadLoraAdapterBody(TypedDict):
    """``POST /load_lora_adapter``: a PEFT adapter directory, named. Sluice names an
    adapter by the policy version it is (``version_label``)."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterBody(TypedDict):
    """``POST /unload_lora_adapter``."""

    lora_name: str


class LoraUpdateAnswer(TypedDict):
    """The answer to both (SGLang's ``LoRAUpdateOutput``)."""

    success: bool
    error_message: str | None
    loaded_adapters: dict[str, str]


class UpdateWeightsAnswer(TypedDict):
    """The ``/update_weights_from_disk`` answer."""

    success: bool
    message: str
    num_paused_requests: int


# --------------------------------------------------------- weight versions


def version_label(version: int, incarnation: int | None = None) -> str:
    """The wire label of policy step ``version``; with ``incarnation``, ``r<r>/v<k>``,
    the form an update names its (incarnation, step) in (``versions``)."""
    return str(version) if incarnation is None else f"r{int(incarnation)}/v{int(version)}"


def parse_version_label(label: Any) -> int | None:
    """The integer policy step ``label`` names (an int, a decimal string, or the step of
    an ``r<r>/v<k>`` label, as SGLang echoes an update's label back), else None."""
    if isinstance(label, int) and not isinstance(label, bool):
        return int(label)
    if isinstance(label, str):
        text = label.strip()
        head, slash, step = text.partition("/v")
        if slash and head[:1] == "r" and head[1:].isdigit() and step.isdigit():
            return int(step)
        if text.lstrip("-").isdigit():
            return int(text)
    return None


def weight_version_spans(token_versions: list[int], current_version: int) -> list[dict[str, Any]]:
    """Collapse per-token versions into SGLang ``weight_versions`` spans (half-open)."""
    if not token_versions:
        return [{"version": version_label(current_version), "start": 0, "end": 0}]
    spans: list[dict[str, Any]] = []
    for index, version in enumerate(token_versions):
        if spans and spans[-1]["version"] == version_label(version):
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": version_label(version), "start": index, "end": index + 1})
    return spans


# ------------------------------------------------------- /generate answers


def _finish_reason(output: GenerationOutput) -> dict[str, Any]:
    if output.finish_reason == "stop":
        return {"type": "stop", "matched": output.matched_stop_token_id}
    if output.finish_reason == "length":
        return {"type": "length", "length": len(output.output_token_ids)}
    return {"type": "abort", "message": output.abort_message}


def encode_generate_response(
    output: GenerationOutput,
    *,
    display_id: str,
    return_logprob: bool,
    current_version: int,
    text: str,
) -> dict[str, Any]:
    """One SGLang ``/generate`` answer object for one sample."""
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
    return {"text": text, "output_ids": list(output.output_token_ids), "meta_info": meta}


@dataclass(frozen=True)
class GenerateResponse:
    """One sampled response as a client decodes it from any SGLang-compatible server.

    Not the engine's ``GenerationOutput``: this is what crossed the wire, so it
    carries the answering server and the decoded text, and none of the engine's
    scheduling record (steps, latency, matched stop token).
    """

    output_token_ids: list[int]
    """Generated token ids (including a final stop/EOS token, as SGLang returns them)."""
    behaviour_logprobs: list[float]
    """Logprob of each output token under the sampling policy (empty if not requested)."""
    token_versions: list[int]
    """Policy version that generated each output token."""
    finish_reason: str
    """``stop``, ``length`` or ``abort``."""
    prompt_tokens: int
    """Number of prompt tokens the server saw."""
    request_id: str
    """The server's id for the request (``meta_info.id``)."""
    server_url: str
    """Base URL of the server that answered."""
    text: str = ""
    """Decoded output text when the server has a tokenizer, else empty."""
    weight_version: int | None = None
    """The server's ``meta_info.weight_version`` (version at finish)."""

    @property
    def version_start(self) -> int | None:
        bounds = version_bounds(self.token_versions)
        return None if bounds is None else bounds[0]

    @property
    def version_end(self) -> int | None:
        bounds = version_bounds(self.token_versions)
        return None if bounds is None else bounds[1]


class ResponseSchemaError(ValueError):
    """A ``/generate`` answer does not follow the schema; the message says what is wrong."""


def decode_generate_response(
    payload: Any,
    *,
    return_logprob: bool,
    server_url: str,
    version_of: Callable[[Any], int],
) -> GenerateResponse:
    """Read one ``/generate`` answer object; ``version_of`` maps a version label to an int.

    Raises ResponseSchemaError naming the first unusable field.
    """
    if not isinstance(payload, dict) or not isinstance(payload.get("meta_info"), dict):
        raise ResponseSchemaError("expected an object with meta_info")
    meta = payload["meta_info"]
    output_ids = payload.get("output_ids")
    if not isinstance(output_ids, list):
        raise ResponseSchemaError("output_ids is missing")
    count = len(output_ids)
    finish = meta.get("finish_reason")
    finish_type = finish.get("type") if isinstance(finish, dict) else finish
    if finish_type not in FINISH_REASONS:
        raise ResponseSchemaError(f"finish_reason {finish!r}")

    versions: list[int | None] = [None] * count
    spans = meta.get("weight_versions")
    if spans:
        for span in spans:
            if not isinstance(span, dict):
                raise ResponseSchemaError(f"weight_versions entry {span!r} is not an object")
            version = version_of(span.get("version"))
            for index in range(
                max(0, int(span.get("start", 0))), min(count, int(span.get("end", 0)))
            ):
                versions[index] = version
    elif meta.get("weight_version") is not None:
        versions = [version_of(meta["weight_version"])] * count
    else:
        raise ResponseSchemaError("neither weight_versions nor weight_version is present")
    if any(v is None for v in versions):
        raise ResponseSchemaError(
            f"weight_versions spans {spans!r} do not cover all {count} output tokens"
        )

    logprobs: list[float] = []
    if return_logprob:
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list) or len(entries) != count:
            raise ResponseSchemaError(
                f"output_token_logprobs has {len(entries) if isinstance(entries, list) else 'no'} entries for {count} tokens"
            )
        for index, entry in enumerate(entries):
            if not isinstance(entry, list) or len(entry) < 2 or entry[0] is None:
                raise ResponseSchemaError(f"output_token_logprobs[{index}] is {entry!r}")
            if entry[1] != output_ids[index]:
                raise ResponseSchemaError(
                    f"output_token_logprobs[{index}] is for token {entry[1]}, not {output_ids[index]}"
                )
            logprobs.append(float(entry[0]))

    weight_version = meta.get("weight_version")
    return GenerateResponse(
        output_token_ids=[int(t) for t in output_ids],
        behaviour_logprobs=logprobs,
        token_versions=[int(v) for v in versions if v is not None],
        finish_reason=str(finish_type),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        request_id=str(meta.get("id", "")),
        server_url=server_url,
        text=str(payload.get("text") or ""),
        weight_version=None if weight_version is None else version_of(weight_version),
    )


# ------------------------------------------------------------------ errors


def error_body(message: str, code: int) -> dict[str, Any]:
    """An error answer: ``{"error": {"message", "code"}}``."""
    return {"error": {"message": message, "code": code}}


def contract_error_body(message: str) -> dict[str, Any]:
    """A schema violation, shaped as SGLang's contract check answers it: ``{"error": str}``."""
    return {"error": message}


def error_message(body: Any) -> str:
    """The human-readable message of an error answer in any of the shapes servers use."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, str):
            return error
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("error_message", "message", "detail"):
            if key in body:
                return str(body[key])
    return str(body)[:500]
