"""The inference server's `/metrics`: Prometheus text exposition format 0.0.4.

Named after what SGLang's `--enable-metrics` serves (`sglang:num_running_reqs`,
`sglang:num_queue_reqs`, `sglang:generation_tokens_total`, `sglang:gen_throughput`),
as `sluice_*` (Prometheus keeps colons for recording rules), plus what a rollout
server has that a chat server does not: the policy version it serves, the pauses around
weight updates and what they cost, and the tokens recomputed after an interrupt. Every
sample carries a `model_name` label, as SGLang's do.

Most numbers are the engine's own, read at scrape time (queue lengths, token counters,
the weight version); the server adds what only its routes see: `/pause_generation` ..
`/continue_generation` intervals (`ServingMetrics.paused`/`continued`) and each applied
weight update's report (`RecordingEngine`). Written by hand: the format is a few lines
of text, and `prometheus_client` would be a dependency for them.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.engines.inference.engine import InferenceEngine
    from sluice.engines.inference.types import WeightUpdateReport

METRICS_ROUTE = "/metrics"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
THROUGHPUT_WINDOW_S = 10.0
"""`sluice_gen_throughput` averages over at least this many seconds once the server is
that old (a Prometheus `rate()` over the token counter is the exact alternative)."""


@dataclass(frozen=True)
class Sample:
    """One metric family with one sample: name, `counter` or `gauge`, help, value."""

    name: str
    kind: str
    help: str
    value: float


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def exposition(samples: Iterable[Sample], labels: Mapping[str, str]) -> str:
    """`samples` in the text format: HELP and TYPE lines, then the sample, per family."""
    label_text = ",".join(f'{k}="{_label_value(v)}"' for k, v in labels.items())
    suffix = f"{{{label_text}}}" if label_text else ""
    lines = []
    for s in samples:
        help_text = s.help.replace("\\", "\\\\").replace("\n", "\\n")
        lines += [
            f"# HELP {s.name} {help_text}",
            f"# TYPE {s.name} {s.kind}",
            f"{s.name}{suffix} {_number(s.value)}",
        ]
    return "\n".join(lines) + "\n"


class ServingMetrics:
    """What `/metrics` reports about one engine, and the counters only the routes feed.

    Thread-safe: routes run on the event loop and in worker threads.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        model_name: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self._clock = clock
        self._lock = threading.Lock()
        self.pauses = 0
        self._paused_s = 0.0
        self._paused_since: float | None = None
        self.weight_updates = 0
        self.weight_update_stall_s = 0.0
        self.recomputed_requests = 0
        self._token_samples = deque([(clock(), engine.generated_tokens)])

    # ------------------------------------------------------------ fed by the routes

    def paused(self) -> None:
        """`/pause_generation` answered: a pause starts (a repeated one continues it)."""
        with self._lock:
            if self._paused_since is None:
                self._paused_since = self._clock()
                self.pauses += 1

    def continued(self) -> None:
        """`/continue_generation` answered: the pause, if any, ends."""
        with self._lock:
            if self._paused_since is not None:
                self._paused_s += self._clock() - self._paused_since
                self._paused_since = None

    def updated(self, report: WeightUpdateReport | None) -> None:
        """A weight update's report (None: a version still arriving in parts)."""
        if report is None:
            return
        with self._lock:
            self.weight_updates += 1
            self.weight_update_stall_s += report.drain_wait_s + report.apply_s
            self.recomputed_requests += report.num_recomputed_requests

    # ------------------------------------------------------------ read at scrape time

    def paused_seconds(self) -> float:
        """Seconds generation was paused so far, the pause under way included."""
        with self._lock:
            ongoing = 0.0 if self._paused_since is None else self._clock() - self._paused_since
            return self._paused_s + ongoing

    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last `THROUGHPUT_WINDOW_S` (or since start).

        Each scrape leaves a sample (at most one every half second); the baseline is the
        newest one at least a window old, so two scrapers, or none for an hour, still
        read a rate over a window's worth of time.
        """
        now, tokens = self._clock(), self.engine.generated_tokens
        with self._lock:
            samples = self._token_samples
            if now - samples[-1][0] >= 0.5:
                samples.append((now, tokens))
            while len(samples) > 2 and now - samples[1][0] >= THROUGHPUT_WINDOW_S:
                samples.popleft()
            since, base = samples[0]
        return (tokens - base) / (now - since) if now > since else 0.0

    def samples(self) -> list[Sample]:
        engine = self.engine
        return [
            Sample(
                "sluice_num_running_reqs",
                "gauge",
                "Requests holding a KV slot (decoding now).",
                engine.num_running,
            ),
            Sample(
                "sluice_num_queue_reqs",
                "gauge",
                "Requests waiting for a KV slot (the queue depth), retracted ones included.",
                engine.num_waiting,
            ),
            Sample(
                "sluice_max_running_reqs",
                "gauge",
                "KV slots: the most requests decoded together.",
                engine.max_batch_size,
            ),
            Sample(
                "sluice_generation_tokens_total",
                "counter",
                "Tokens sampled (recomputed ones not counted again).",
                engine.generated_tokens,
            ),
            Sample(
                "sluice_prefill_tokens_total",
                "counter",
                "Tokens prefilled: prompts not found in the prompt cache, and recomputed ones.",
                engine.prefilled_tokens,
            ),
            Sample(
                "sluice_recomputed_tokens_total",
                "counter",
                "Tokens prefilled again after a retract or a weight update (interruptible "
                "generation's cost).",
                engine.recomputed_tokens,
            ),
            Sample(
                "sluice_gen_throughput",
                "gauge",
                f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:g} s.",
                self.tokens_per_s(),
            ),
            Sample(
                "sluice_weight_version",
                "gauge",
                "Policy version of the weights being served.",
                engine.weight_version,
            ),
            Sample(
                "sluice_weight_updates_total",
                "counter",
                "Weight updates applied (from disk, a weight group, tensors or an adapter).",
                self.weight_updates,
            ),
            Sample(
                "sluice_weight_update_stall_seconds_total",
                "counter",
                "Seconds weight updates held generation up: draining (drain mode) plus "
                "copying the weights in.",
                self.weight_update_stall_s,
            ),
            Sample(
                "sluice_weight_update_recomputed_reqs_total",
                "counter",
                "In-flight requests whose KV was recomputed under new weights.",
                self.recomputed_requests,
            ),
            Sample(
                "sluice_paused",
                "gauge",
                "1 while generation is paused (/pause_generation), else 0.",
                1.0 if engine.paused else 0.0,
            ),
            Sample(
                "sluice_generation_pauses_total",
                "counter",
                "Pauses of generation (/pause_generation; the rollout role pauses only "
                "around a weight update).",
                self.pauses,
            ),
            Sample(
                "sluice_generation_paused_seconds_total",
                "counter",
                "Seconds generation was paused, the pause under way included.",
                self.paused_seconds(),
            ),
        ]

    def render(self) -> str:
        return exposition(self.samples(), {"model_name": self.model_name})


class RecordingEngine:
    """The engine as the weight and adapter routes see it: each update they apply is
    also recorded in `metrics`; everything else is the engine's own."""

    def __init__(self, engine: InferenceEngine, metrics: ServingMetrics) -> None:
        self._engine = engine
        self._metrics = metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def update_weights_from_disk(self, *args: Any, **kwargs: Any) -> WeightUpdateReport:
        report = self._engine.update_weights_from_disk(*args, **kwargs)
        self._metrics.updated(report)
        return report

    def update_weights_from_tensors(self, *args: Any, **kwargs: Any) -> WeightUpdateReport | None:
        report = self._engine.update_weights_from_tensors(*args, **kwargs)
        self._metrics.updated(report)
        return report

    def load_adapter(self, *args: Any, **kwargs: Any) -> WeightUpdateReport:
        report = self._engine.load_adapter(*args, **kwargs)
        self._metrics.updated(report)
        return report
