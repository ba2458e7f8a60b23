"""Async client for SGLang-compatible inference servers.

The rollout side talks to inference servers only through this client: Sluice's
own ``sluice.infra.serving.server`` on a laptop, real SGLang servers at scale. It
therefore sends only fields SGLang 0.5.x defines (``input_ids``,
``sampling_params``, ``return_logprob``, ``rid``; ``mode``; ``model_path``,
``weight_version``, ``abort_all_requests``) and reads only fields SGLang returns;
``sluice.infra.serving.protocol`` states both.

Per-token policy versions come from ``meta_info.weight_versions`` (half-open
``[start, end)`` spans over output tokens). A server started without
``--weight-version`` reports ``"default"``, read as ``default_weight_version``; any
other non-integer label is an error rather than a guess. Requests go to the server
with the fewest requests in flight from this client, ties broken round-robin.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from sluice.infra.serving import protocol
from sluice.infra.serving.auth import bearer_headers
from sluice.infra.serving.client_weights import WeightGroupCalls
from sluice.infra.serving.errors import (  # noqa: F401  (importable from here as before)
    InferenceServerError,
    InferenceServerUnreachableError,
    error_message,
)
from sluice.infra.serving.protocol import GenerateResponse, PauseMode


class InferenceClient(WeightGroupCalls):
    """Async client over one or more SGLang-compatible servers."""

    def __init__(
        self,
        base_urls: Sequence[str],
        timeout_s: float = 600.0,
        *,
        default_weight_version: int = 0,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
    ) -> None:
        """`base_urls`: server roots such as ``http://10.0.0.5:30000`` (at least one);
        `timeout_s`: per request (long responses take minutes); `default_weight_version`:
        the version SGLang's ``"default"`` label means; `transport`: an httpx transport;
        `api_key`: the run's token, sent as a bearer token (SGLang's ``--api-key``)."""
        urls = [u.rstrip("/") for u in base_urls]
        if not urls:
            raise ValueError("InferenceClient needs at least one base URL")
        bad = [url for url in urls if not url.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"inference server URL {bad[0]!r} must start with http:// or https://")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.base_urls = urls
        self.timeout_s = timeout_s
        self.default_weight_version = default_weight_version
        # Two connection pools. A paused server holds every in-flight /generate open, and
        # a rollout keeps more of them in flight than httpx's default pool of 100
        # connections: a pause, weight update or continue queued behind them in one pool
        # would wait for a connection that only the continue can free (a deadlock seen
        # with 128 requests in flight). Control calls get a small pool of their own, and
        # the generation pool is unbounded (its size is the rollout's in-flight limit).
        # Idle keep-alive connections stay at httpx's default 20: the pool probes every
        # idle one on each request, and 256 of them cost the rollout ~70% of a core.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            transport=transport,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=20),
            headers=bearer_headers(api_key),
        )
        self._control = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            transport=transport,
            limits=httpx.Limits(max_connections=8, max_keepalive_connections=8),
            headers=bearer_headers(api_key),
        )
        self._in_flight = dict.fromkeys(urls, 0)
        self._cursor = itertools.count()
        self.adapter: int | None = None
        """The policy version of the LoRA adapter requests are served with (named in
        each request's ``lora_path``), or None for the base weights; see `use_adapter`."""

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._control.aclose()

    def set_urls(self, base_urls: Sequence[str]) -> None:
        """Serve from `base_urls` from now on (a restarted server may answer elsewhere).
        Requests in flight to a server no longer listed finish or fail as they would."""
        urls = [u.rstrip("/") for u in base_urls]
        if not urls:
            raise ValueError("InferenceClient needs at least one base URL")
        self.base_urls = urls
        for url in urls:
            self._in_flight.setdefault(url, 0)

    # ------------------------------------------------------------ transport

    def _pick_server(self) -> str:
        fewest = min(self._in_flight[u] for u in self.base_urls)
        candidates = [u for u in self.base_urls if self._in_flight[u] == fewest]
        return candidates[next(self._cursor) % len(candidates)]

    async def _request(
        self, url: str, method: str, path: str, body: Mapping[str, Any] | None = None
    ) -> Any:
        pool = self._http if path == protocol.GENERATE else self._control
        try:
            response = await pool.request(method, url + path, json=body)
        except httpx.TimeoutException as exc:
            raise InferenceServerUnreachableError(
                url,
                f"inference server {url} did not answer {path} within {self.timeout_s} s ({type(exc).__name__})",
            ) from exc
        except httpx.TransportError as exc:
            raise InferenceServerUnreachableError(
                url, f"inference server {url} is unreachable ({path}): {type(exc).__name__}: {exc}"
            ) from exc
        if not response.is_success:
            raise InferenceServerError(
                url,
                f"inference server {url} answered {path} with HTTP {response.status_code}: {error_message(response)}",
                status_code=response.status_code,
            )
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise InferenceServerError(
                url,
                f"inference server {url} answered {path} with a body that is not JSON",
                response.status_code,
            ) from exc

    async def _broadcast(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        urls: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        targets = self.base_urls if urls is None else [u.rstrip("/") for u in urls]
        unknown = [u for u in targets if u not in self.base_urls]
        if unknown:
            raise ValueError(f"not servers of this client: {', '.join(unknown)}")
        results = await asyncio.gather(
            *(self._request(url, method, path, body) for url in targets),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return dict(zip(targets, results, strict=True))

    # ------------------------------------------------------------ generation

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = True,
        *,
        rid: str | None = None,
    ) -> GenerateResponse:
        """Sample one response to ``input_ids`` on the least-loaded server."""
        if (sampling_params or {}).get("n", 1) not in (1, None):
            raise ValueError("generate() samples one response; use generate_group() for n > 1")
        body = protocol.GenerateBody(
            input_ids=[int(t) for t in input_ids],
            sampling_params=dict(sampling_params or {}),
            return_logprob=return_logprob,
        )
        if rid is not None:
            body["rid"] = rid
        adapter = self._name_adapter(body)
        url = self._pick_server()
        self._in_flight[url] += 1
        try:
            payload = await self._request(url, "POST", protocol.GENERATE, body)
        finally:
            self._in_flight[url] -= 1
        if isinstance(payload, list) and len(payload) == 1:
            payload = payload[0]
        return self._parse_generate(url, payload, return_logprob, adapter)

    async def generate_group(
        self,
        input_ids: Sequence[int],
        n: int,
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = True,
    ) -> list[GenerateResponse]:
        """Sample ``n`` responses to one prompt in one request (SGLang's ``n``; a GRPO group).

        One HTTP round trip per group instead of one per sample: on a small machine the
        client's and the server's per-request bookkeeping is CPU the engine does not get.
        With ``sampling_seed`` set, sample j uses ``sampling_seed + j`` (the server's rule).
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        body = protocol.GenerateBody(
            input_ids=[int(t) for t in input_ids],
            sampling_params={**(sampling_params or {}), "n": n},
            return_logprob=return_logprob,
        )
        return await self._generate_samples(body, n, return_logprob)

    async def generate_groups(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling_params: Sequence[dict[str, Any]],
        return_logprob: bool = True,
    ) -> list[list[GenerateResponse]]:
        """Sample ``n`` responses to each of ``prompts`` in one request (SGLang's batched
        ``input_ids`` with ``n``); answer i holds prompt i's ``n`` responses, sampled under
        ``sampling_params[i]`` (each group its own ``sampling_seed``, say).

        One request for a whole batch of groups: a server queues it as one arrival, so
        its engine schedules the batch as the synchronous loop's in-process engine does
        (the responses come back in (prompt, sample) order, as SGLang expands ``n``).
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not prompts or len(sampling_params) != len(prompts):
            raise ValueError(
                f"need one sampling_params per prompt: {len(prompts)} prompts, "
                f"{len(sampling_params)} sampling_params"
            )
        body = protocol.GenerateBody(
            input_ids=[[int(t) for t in ids] for ids in prompts],
            sampling_params=[{**params, "n": n} for params in sampling_params],
            return_logprob=return_logprob,
        )
        answers = await self._generate_samples(body, len(prompts) * n, return_logprob)
        return [answers[i : i + n] for i in range(0, len(answers), n)]

    async def _generate_samples(
        self, body: protocol.GenerateBody, count: int, return_logprob: bool
    ) -> list[GenerateResponse]:
        """Send one /generate `body` that asks for `count` samples; its answers, in order."""
        adapter = self._name_adapter(body)
        url = self._pick_server()
        self._in_flight[url] += count
        try:
            payload = await self._request(url, "POST", protocol.GENERATE, body)
        finally:
            self._in_flight[url] -= count
        if count == 1 and isinstance(payload, dict):
            payload = [payload]
        if not isinstance(payload, list) or len(payload) != count:
            raise InferenceServerError(
                url,
                f"inference server {url} answered a request for {count} samples with "
                f"{len(payload) if isinstance(payload, list) else 'a non-list'} responses",
            )
        return [self._parse_generate(url, item, return_logprob, adapter) for item in payload]

    def _name_adapter(self, body: protocol.GenerateBody) -> int | None:
        """Name the adapter in use in `body`; its version (None: the base weights)."""
        adapter = self.adapter
        if adapter is not None:
            body["lora_path"] = protocol.version_label(adapter)
        return adapter

    def _version(self, url: str, label: Any) -> int:
        if isinstance(label, str) and label.strip() == protocol.DEFAULT_VERSION_LABEL:
            return self.default_weight_version
        version = protocol.parse_version_label(label)
        if version is None:
            raise InferenceServerError(
                url,
                f"inference server {url} reported weight version {label!r}, which is not an integer policy version",
            )
        return version

    def _parse_generate(
        self, url: str, payload: Any, return_logprob: bool, adapter: int | None = None
    ) -> GenerateResponse:
        def version_of(label: Any) -> int:
            # SGLang reports its base weights' label for tokens an adapter produced;
            # Sluice's server reports the adapter's version (or a newer one that
            # replaced it in flight). Either way no token is older than its adapter.
            version = self._version(url, label)
            return version if adapter is None else max(version, adapter)

        try:
            return protocol.decode_generate_response(
                payload,
                return_logprob=return_logprob,
                server_url=url,
                version_of=version_of,
            )
        except protocol.ResponseSchemaError as exc:
            raise InferenceServerError(
                url, f"inference server {url} sent an unusable /generate response: {exc}"
            ) from exc

    # --------------------------------------------------------------- control

    async def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """Pause generation on every server (SGLang ``/pause_generation``)."""
        if mode not in protocol.PAUSE_MODES:
            *first, last = (repr(m) for m in protocol.PAUSE_MODES)
            raise ValueError(f"pause mode must be {', '.join(first)} or {last}, got {mode!r}")
        body = protocol.PauseBody(mode=PauseMode(mode).value)
        await self._broadcast("POST", protocol.PAUSE_GENERATION, body)

    async def continue_(self) -> None:
        """Resume generation on every server."""
        await self._broadcast("POST", protocol.CONTINUE_GENERATION, {})

    async def update_weights_from_disk(
        self,
        path: str,
        version: int,
        *,
        abort_all_requests: bool = False,
        urls: Sequence[str] | None = None,
        label: str | None = None,
    ) -> dict[str, int]:
        """Load the checkpoint at ``path`` (visible to every server) as policy ``version``
        on every server, or on ``urls`` only. `label`: the update's ``weight_version``
        in (incarnation, step) form (infra/serving/versions.py); default the bare step.

        Returns each server's count of requests paused across the update.
        """
        body = protocol.UpdateWeightsBody(
            model_path=str(path),
            weight_version=label or protocol.version_label(int(version)),
            abort_all_requests=abort_all_requests,
        )
        answers = await self._broadcast("POST", protocol.UPDATE_WEIGHTS_FROM_DISK, body, urls)
        paused: dict[str, int] = {}
        for url, answer in answers.items():
            if not isinstance(answer, dict) or not answer.get("success"):
                message = answer.get("message") if isinstance(answer, dict) else answer
                raise InferenceServerError(
                    url, f"inference server {url} failed to load {path}: {message}"
                )
            paused[url] = int(answer.get("num_paused_requests", 0))
        return paused

    async def load_lora_adapter(
        self, path: str, version: int, *, urls: Sequence[str] | None = None
    ) -> None:
        """Load the LoRA adapter directory `path` (visible to every server) as policy
        `version` on every server, or on `urls` only (SGLang's ``/load_lora_adapter``).
        Requests go on naming the adapter in use until `use_adapter` switches them."""
        body = protocol.LoadLoraAdapterBody(
            lora_name=protocol.version_label(int(version)), lora_path=str(path)
        )
        answers = await self._broadcast("POST", protocol.LOAD_LORA_ADAPTER, body, urls)
        for url, answer in answers.items():
            if not isinstance(answer, dict) or not answer.get("success"):
                raise InferenceServerError(
                    url,
                    f"inference server {url} failed to load adapter {path}: "
                    f"{protocol.error_message(answer)}",
                )

    async def unload_lora_adapter(self, version: int, *, urls: Sequence[str] | None = None) -> None:
        """Unload adapter `version` from every server (or `urls`); one not loaded is fine."""
        body = protocol.UnloadLoraAdapterBody(lora_name=protocol.version_label(int(version)))
        try:
            await self._broadcast("POST", protocol.UNLOAD_LORA_ADAPTER, body, urls)
        except InferenceServerError as exc:
            if exc.status_code != 400:  # 400: that server did not hold it
                raise

    def use_adapter(self, version: int | None) -> None:
        """Serve every request sent from now on with adapter `version` (None: the base)."""
        self.adapter = version

    async def health(self) -> dict[str, bool]:
        """Whether each server answers ``/health`` with 2xx."""

        async def check(url: str) -> bool:
            try:
                await self._request(url, "GET", protocol.HEALTH)
            except InferenceServerError:
                return False
            return True

        results = await asyncio.gather(*(check(u) for u in self.base_urls))
        return dict(zip(self.base_urls, results, strict=True))

    async def wait_until_healthy(
        self, timeout_s: float = 300.0, poll_interval_s: float = 1.0
    ) -> None:
        """Block until every server is healthy; raise naming the ones that are not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            status = await self.health()
            down = [u for u, ok in status.items() if not ok]
            if not down:
                return
            if loop.time() >= deadline:
                raise InferenceServerUnreachableError(
                    down[0], f"inference servers not healthy after {timeout_s} s: {', '.join(down)}"
                )
            await asyncio.sleep(poll_interval_s)

    async def server_states(self) -> dict[str, dict[str, Any]]:
        """Each server's own state from ``/server_info`` (the first of its
        ``internal_states``): Sluice's servers add their measured step costs
        (``step_profile``) and peak memory (``peak_rss_mb``); an SGLang server has neither."""
        infos = await self._broadcast("GET", protocol.SERVER_INFO)
        out: dict[str, dict[str, Any]] = {}
        for url, info in infos.items():
            states = info.get("internal_states") or [{}]
            out[url] = states[0] if isinstance(states[0], dict) else {}
        return out

    async def model_info(self) -> dict[str, dict[str, Any]]:
        """Each server's ``/model_info`` (model path, weight version, ...)."""
        return await self._broadcast("GET", protocol.MODEL_INFO)
