"""Prometheus metrics with vLLM's names, in the server's own registry, under both `pagoda:` and `vllm:`.

Gauges mirror the engine core's last `EngineStats`; counters and histograms are fed per request by
the serving layer (TTFT and inter-token latency are measured in the API process, from arrival,
so they include tokenization and queueing, like vLLM's). Between the core's reports (it reports only
between steps, and a step can take many seconds) the waiting gauge shows the API side's count too
(`render(waiting_estimate)`).

Two prefixes, so that dashboards and alerts written for vLLM work unchanged: every metric is recorded
once, as `pagoda:…`, and `render` writes each family a second time as `vllm:…` with the same values and
labels (`_Prefixed`), which costs a scrape a few hundred extra lines instead of a second observation of
every token's histograms. `--metrics-prefix` picks one of the two instead.

API processes (`--api-server-count N`, N >= 1): prometheus_client's multiprocess mode (the launcher's
`processes.Supervisor` sets PROMETHEUS_MULTIPROC_DIR for them). Every process renders the values of all of them:
counters and histograms summed, the engine gauges the most recently written value (every process
receives every change of them). The engine's running totals (preemptions, prefix-cache tokens) reach
every process; only the first one counts them, or the sum would be N times the truth.

`cache_config_info` is vLLM's info metric for the KV cache: value 1, the settings as labels
(`cache_dtype` "auto", "bfloat16" or "fp8", `num_gpu_blocks`, `block_size`, ...), published once the engine core
has sized the cache (`publish_cache_config`).

Labels and buckets are vLLM 0.26's: `model_name` and `engine` ("0") on every engine metric, and its bucket
boundaries written out below, so that a vLLM dashboard's quantiles read the same buckets. The per-request
phases (prefill, decode, inference) are measured where the tokens arrive, with the core's queue time
marking when the request was first scheduled (`RequestTiming`). The standard unprefixed families:
`http_*` (`HttpMetrics`, fed by `HttpMetricsMiddleware`, summed over processes like the rest) and
`process_*` plus the GPU gauge, read from the machine at scrape time (server/host_metrics.py).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric, Summary, generate_latest
from prometheus_client.core import GaugeMetricFamily

from pagoda.engine.core_process import Outputs

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.outputs import EngineStats
    from pagoda.sampling_params import SamplingParams

# vLLM's label for the engine core's index: one core per server, so always "0" (vLLM 0.26 labels every
# engine metric with `model_name` and `engine`).
ENGINE_INDEX = "0"

# vLLM 0.26's bucket boundaries (its v1/metrics/loggers.py), so that a dashboard's quantiles over these
# histograms read the same boundaries on either server.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# inter-token latency and per-request time per output token
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# e2e latency, queue, prefill, decode and inference time of a request
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM's reasons a request waits: "capacity" (for a seat in the batch or KV blocks), "deferred" (held back
# by something else; here: its grammar is still being compiled). The two add up to num_requests_waiting.
WAITING_REASONS = ("capacity", "deferred")


def token_count_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len` (vLLM's boundaries for per-request token counts)."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


# --metrics-prefix → the prefixes /metrics shows, in order.
METRICS_PREFIXES = {"both": ("pagoda", "vllm"), "pagoda": ("pagoda",), "vllm": ("vllm",)}
_OWN = "pagoda:"  # the prefix the metrics are recorded under


class _Prefixed:
    """A collector that yields every family of `sources` whose name starts with `pagoda:` once per prefix,
    renamed, and every other family (the standard `http_*`) once, as it is. Families are copied per
    scrape, the recorded values are not touched."""

    def __init__(self, sources: list, prefixes: tuple[str, ...]):
        self.sources, self.prefixes = sources, prefixes

    def describe(self) -> list:
        return []  # nothing to check for clashes: the names are ours

    def collect(self):
        families = [family for source in self.sources for family in source.collect()]
        own = [family for family in families if family.name.startswith(_OWN)]
        yield from (family for family in families if not family.name.startswith(_OWN))
        for prefix in self.prefixes:
            if f"{prefix}:" == _OWN:
                yield from own
            else:
                yield from (_renamed(family, f"{prefix}:") for family in own)


def _renamed(family, prefix: str):
    cut = len(_OWN)
    out = copy.copy(family)
    out.name = prefix + family.name[cut:]
    out.samples = [s._replace(name=prefix + s.name[cut:]) if s.name.startswith(_OWN) else s for s in family.samples]
    return out


def cache_config_labels(config: EngineConfig, num_gpu_blocks: int) -> dict[str, str]:
    """`cache_config_info`'s labels, named and spelled as vLLM's (every value a string)."""
    cache = config.cache
    return {
        "block_size": str(cache.block_size),
        "cache_dtype": cache.kv_cache_dtype,
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "engine": ENGINE_INDEX,
        "gpu_memory_utilization": str(cache.gpu_memory_utilization),
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_gpu_blocks_override": str(cache.num_gpu_blocks_override),
        "swap_space": "0",  # no swap space: preempted requests are recomputed (--swap-space is refused)
    }


def _engine_totals(stats) -> tuple[float, ...]:
    return (
        stats.num_preemptions,
        stats.prefix_cache_queries,
        stats.prefix_cache_hits,
        stats.num_steps,
        stats.busy_seconds,
        stats.device_wait_seconds,
        stats.cpu_seconds,
        stats.mm_cache_queries,
        stats.mm_cache_hits,
        stats.spec_num_drafts,
        stats.spec_num_draft_tokens,
        stats.spec_num_accepted_tokens,
    )


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        multiprocess: bool = False,
        count_engine_totals: bool = True,
        prefixes: tuple[str, ...] = METRICS_PREFIXES["both"],
        max_model_len: int = 8192,
        collectors: tuple = (),
        process_collector: Any = None,
    ):
        """`collectors`: more `pagoda:` families read at scrape time (`host_metrics.GpuUtilization`), shown
        under each prefix; `process_collector`: the `process_*` families (`host_metrics.process_collector`),
        shown as they are."""
        self.registry = CollectorRegistry()
        self.multiprocess = multiprocess
        self.prefixes = prefixes
        self._render_registry: CollectorRegistry | None = None
        self._collectors, self._process_collector = collectors, process_collector
        self.count_engine_totals = count_engine_totals
        label = ["model_name", "engine"]
        r, m = self.registry, model_name
        ours = (m, ENGINE_INDEX)

        def gauge(name: str, doc: str, extra: list[str] | None = None) -> Gauge:
            return Gauge(f"pagoda:{name}", doc, label + (extra or []), registry=r, multiprocess_mode="mostrecent")

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(f"pagoda:{name}", doc, label + (extra or []), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"pagoda:{name}", doc, label, buckets=buckets, registry=r).labels(*ours)

        self.running = gauge("num_requests_running", "Requests in the running batch").labels(*ours)
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled").labels(*ours)
        by_reason = gauge(
            "num_requests_waiting_by_reason",
            "Waiting requests by reason: capacity (a seat or KV blocks), deferred (grammar being compiled)",
            ["reason"],
        )
        self.waiting_capacity, self.waiting_deferred = (by_reason.labels(*ours, reason) for reason in WAITING_REASONS)
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)").labels(*ours)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed").labels(*ours)
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached", "Prompt tokens served from the prefix cache (of finished requests)"
        ).labels(*ours)
        self.generation_tokens = counter("generation_tokens", "Tokens generated").labels(*ours)
        self._success = counter("request_success", "Finished requests by finish reason", ["finished_reason"])
        self.preemptions = counter("num_preemptions", "Requests preempted by the scheduler").labels(*ours)
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache").labels(
            *ours
        )
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache").labels(*ours)
        self.mm_queries = counter(
            "mm_cache_queries", "Images and videos looked up in the encoder cache (once per step that needs one)"
        ).labels(*ours)
        self.mm_hits = counter("mm_cache_hits", "Images and videos found in the encoder cache").labels(*ours)
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative rows verified (rows with proposals)")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative proposals verified")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative proposals accepted")
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Speculative proposals accepted, by position", ["position"]
        )
        # vLLM's LoRA gauge, read at scrape time from this process's last report (one series, not one per
        # combination ever seen; a multiprocess gauge could not drop the old ones). Only with --enable-lora.
        self.lora_info = LoRAInfo()
        self._collectors = (*self._collectors, self.lora_info)
        # Pagoda's own (no vLLM name): where the engine core's time goes, to tell a host-bound core
        # from a GPU-bound one under load (`pagoda bench` reports them per point, per step).
        self.engine_steps = counter("engine_steps", "Engine steps run").labels(*ours)
        self.engine_busy = counter(
            "engine_core_busy_seconds", "Engine core time in its loop (not idle-waiting for requests)"
        ).labels(*ours)
        self.engine_wait = counter(
            "engine_core_device_wait_seconds", "Part of the busy time spent waiting for a step's sampled tokens"
        ).labels(*ours)
        self.engine_cpu = counter(
            "engine_core_cpu_seconds", "CPU time of the engine core's loop thread over its busy time"
        ).labels(*ours)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens scheduled per engine step", ITERATION_TOKENS_BUCKETS
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between streamed tokens", TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Per request: time from the first to the last output token over the tokens after the first",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Request latency, arrival to finish", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time waiting before first scheduled", REQUEST_LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "Per request: first scheduled to first token", REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "Per request: first token to last token", REQUEST_LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds", "Per request: first scheduled to last token", REQUEST_LATENCY_BUCKETS
        )
        counts = token_count_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request", counts)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request (all its choices)", counts
        )
        self.params_n = histogram("request_params_n", "The n request parameter", PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "The max_tokens request parameter", counts)
        self.http = HttpMetrics(r)
        self.model_name = m
        # Counters fed from the core's running totals, in `_engine_totals` order.
        self._total_counters = (
            self.preemptions,
            self.prefix_queries,
            self.prefix_hits,
            self.engine_steps,
            self.engine_busy,
            self.engine_wait,
            self.engine_cpu,
            self.mm_queries,
            self.mm_hits,
            self.spec_drafts.labels(*ours),
            self.spec_draft_tokens.labels(*ours),
            self.spec_accepted.labels(*ours),
        )
        self._last: tuple[float, ...] = (0,) * len(self._total_counters)
        self._last_per_pos: tuple[int, ...] = ()
        self._deferred = 0  # the core's last count of requests waiting for their grammar
        self._cache_info: Gauge | None = None
        # The engine's gauges read 0 until the core's first report, as vLLM's do: in multiprocess mode a gauge
        # that was never set has no entry in its process's file, and the page would lack it until then.
        self.running.set(0)
        self.kv_usage.set(0)
        self._set_waiting(0)

    def publish_cache_config(self, labels: dict[str, str]) -> None:
        """Set `cache_config_info{labels} 1` (`cache_config_labels`); once per process."""
        if self._cache_info is not None:
            return
        self._cache_info = Gauge(
            "pagoda:cache_config_info",
            "Information of the KV cache configuration (value 1; the settings are the labels)",
            sorted(labels),
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self._cache_info.labels(**labels).set(1)

    def _set_waiting(self, waiting: int) -> None:
        self.waiting.set(waiting)
        deferred = min(self._deferred, waiting)
        self.waiting_deferred.set(deferred)
        self.waiting_capacity.set(waiting - deferred)

    def on_engine_outputs(self, message: Outputs) -> None:
        stats = message.stats
        if stats.max_lora:
            self.lora_info.update(stats)
        self.running.set(stats.num_running)
        self._deferred = stats.num_waiting_deferred
        self._set_waiting(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        generated = 0
        for _, finished, completions, num_prompt_tokens, num_cached_tokens, queue_time in message.outputs:  # wire
            for completion in completions:
                generated += len(completion[2])
            if finished:
                self.prompt_tokens.inc(num_prompt_tokens)
                if num_cached_tokens:
                    self.prompt_tokens_cached.inc(num_cached_tokens)
                if queue_time is not None:
                    self.queue_time.observe(queue_time)
        if generated:
            self.generation_tokens.inc(generated)
        if not self.count_engine_totals:
            return
        for tokens in stats.step_tokens:
            self.iteration_tokens.observe(tokens)
        # The core sends running totals; counters advance by the difference.
        totals = _engine_totals(stats)
        for counter, total, last in zip(self._total_counters, totals, self._last):
            if total > last:
                counter.inc(total - last)
        self._last = totals
        per_pos, last_pos = stats.spec_accepted_per_pos, self._last_per_pos
        for position, total in enumerate(per_pos):
            before = last_pos[position] if position < len(last_pos) else 0
            if total > before:
                self.spec_accepted_per_pos.labels(self.model_name, ENGINE_INDEX, str(position)).inc(total - before)
        self._last_per_pos = per_pos

    def on_request_finished(
        self,
        finish_reasons: list[str | None],
        params: SamplingParams,
        timing: RequestTiming,
        num_prompt_tokens: int,
        num_generated: int,
    ) -> None:
        """One request's end, seen from the API process: its finish reasons (None: aborted), sizes and
        times. Prefill, decode and inference times are vLLM's phases measured where the tokens arrive:
        first scheduled (submitted + the core's queue time) → first token → last token."""
        for reason in finish_reasons:
            self._success.labels(self.model_name, ENGINE_INDEX, reason or "abort").inc()
        t = timing
        self.e2e.observe(time.monotonic() - t.arrival)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generated)
        self.params_n.observe(params.n)
        if params.max_tokens is not None:
            self.params_max_tokens.observe(params.max_tokens)
        if t.first is None or t.last is None:
            return
        if num_generated > params.n:  # more than one token a choice
            self.tpot.observe((t.last - t.first) / (num_generated / params.n - 1))
        if t.queue_time is not None:
            scheduled = t.submitted + t.queue_time
            self.prefill_time.observe(max(0.0, t.first - scheduled))
            self.inference_time.observe(max(0.0, t.last - scheduled))
        self.decode_time.observe(t.last - t.first)

    def render(self, waiting_estimate: int | None = None) -> bytes:
        """The exposition text. `waiting_estimate`: the API side's waiting count while the core's report
        is stale (`AsyncEngine.waiting_estimate`); it holds until the core's next report."""
        if waiting_estimate is not None:
            self._set_waiting(waiting_estimate)
        if self._render_registry is None:
            source: Any = self.registry
            if self.multiprocess:
                # lazy: prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR must be set before import)
                from prometheus_client import multiprocess

                source = multiprocess.MultiProcessCollector(None)  # every process's files, summed
            self._render_registry = CollectorRegistry()
            self._render_registry.register(_Prefixed([source, *self._collectors], self.prefixes))
            if self._process_collector is not None:
                self._render_registry.register(self._process_collector)
        return generate_latest(self._render_registry)


class LoRAInfo:
    """`pagoda:lora_requests_info{max_lora, waiting_lora_adapters, running_lora_adapters}` = when the engine last
    reported them (vLLM's gauge: adapter names comma-separated, sorted)."""

    def __init__(self) -> None:
        self.labels: list[str] | None = None
        self.reported = 0.0

    def update(self, stats: EngineStats) -> None:
        waiting, running = ",".join(stats.waiting_lora_adapters), ",".join(stats.running_lora_adapters)
        self.labels, self.reported = [str(stats.max_lora), waiting, running], time.time()

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Metric]:
        if self.labels is None:
            return
        labels = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]
        family = GaugeMetricFamily(
            "pagoda:lora_requests_info",
            "LoRA adapters of the running and the waiting requests (labels); the value is when they were reported",
            labels=labels,
        )
        family.add_metric(self.labels, self.reported)
        yield family


@dataclass
class RequestTiming:
    """time.monotonic() stamps of one request in the API process; `queue_time` is the core's (arrival at
    the core to first scheduled), None when it was never scheduled."""

    arrival: float  # the HTTP request arrived
    submitted: float  # sent to the engine core
    first: float | None = None  # first token arrived
    last: float | None = None  # last token arrived
    queue_time: float | None = None


# ---- HTTP ---------------------------------------------------------------------------------------------
# The names, labels and buckets prometheus-fastapi-instrumentator gives by default (what vLLM shows): status
# grouped by its first digit ("2xx"), the route's template as `handler` ("none" for a path no route has),
# sizes from the Content-Length headers. vLLM leaves out the same probe and scrape routes.
HTTP_EXCLUDED_HANDLERS = frozenset({"/metrics", "/health", "/load", "/ping", "/version", "/server_info"})
HTTP_LATENCY_BUCKETS = (0.1, 0.5, 1.0)
HTTP_LATENCY_HIGHR_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
    3.0, 3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0,
)  # fmt: skip


class HttpMetrics:
    """`http_requests_total{handler,method,status}`, `http_request_duration_seconds{handler,method}`,
    `http_request_duration_highr_seconds`, `http_request_size_bytes{handler}`,
    `http_response_size_bytes{handler}`, in the server's registry (so summed over API processes)."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.requests = Counter(
            "http_requests_total",
            "HTTP requests by method, status class and route",
            ["method", "status", "handler"],
            registry=r,
        )
        self.latency = Histogram(
            "http_request_duration_seconds",
            "HTTP request time, first byte in to last byte out, by route (few buckets)",
            ["method", "handler"],
            buckets=HTTP_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency_highr = Histogram(
            "http_request_duration_highr_seconds",
            "HTTP request time over all routes (many buckets, for percentiles)",
            buckets=HTTP_LATENCY_HIGHR_BUCKETS,
            registry=r,
        )
        self.request_size = Summary(
            "http_request_size_bytes", "Request Content-Length by route (0 without the header)", ["handler"], registry=r
        )
        self.response_size = Summary(
            "http_response_size_bytes", "Response Content-Length by route (0 when streamed)", ["handler"], registry=r
        )

    def observe(self, method: str, handler: str, status: int, seconds: float, in_bytes: int, out_bytes: int) -> None:
        self.requests.labels(method, f"{status // 100}xx", handler).inc()
        self.latency.labels(method, handler).observe(seconds)
        self.latency_highr.observe(seconds)
        self.request_size.labels(handler).observe(in_bytes)
        self.response_size.labels(handler).observe(out_bytes)


def _content_length(headers: Any) -> int:
    for key, value in headers:
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


class HttpMetricsMiddleware:
    """Pure ASGI (as `app.APIKeyMiddleware`, for the same reasons): times every HTTP request to its last
    byte and records it in `HttpMetrics` under its route's template, once the app has matched the route."""

    def __init__(self, app: Any, metrics: HttpMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        response: list[int] = [500, 0]  # status (500 if the app raised before answering), Content-Length

        async def send_and_note(message: Any) -> None:
            if message["type"] == "http.response.start":
                response[0], response[1] = message["status"], _content_length(message.get("headers", ()))
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope.get("route")
            handler = getattr(route, "path", None) or "none"
            if handler not in HTTP_EXCLUDED_HANDLERS:
                self.metrics.observe(
                    scope["method"],
                    handler,
                    response[0],
                    time.perf_counter() - started,
                    _content_length(scope.get("headers", ())),
                    response[1],
                )
