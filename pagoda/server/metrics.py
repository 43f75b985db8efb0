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
`launch.Supervisor` sets PROMETHEUS_MULTIPROC_DIR for them). Every process renders the values of all of them:
counters and histograms summed, the engine gauges the most recently written value (every process
receives every change of them). The engine's running totals (preemptions, prefix-cache tokens) reach
every process; only the first one counts them, or the sum would be N times the truth.

`cache_config_info` is vLLM's info metric for the KV cache: value 1, the settings as labels
(`cache_dtype` "auto" or "fp8", `num_gpu_blocks`, `block_size`, ...), published once the engine core
has sized the cache (`publish_cache_config`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagoda.engine.core_process import Outputs

if TYPE_CHECKING:
    from pagoda.config import EngineConfig

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)


# --metrics-prefix → the prefixes /metrics shows, in order.
METRICS_PREFIXES = {"both": ("pagoda", "vllm"), "pagoda": ("pagoda",), "vllm": ("vllm",)}
_OWN = "pagoda:"  # the prefix the metrics are recorded under


class _Prefixed:
    """A collector that yields every family of `source` (names starting with `pagoda:`) once per
    prefix, renamed. Families are copied per scrape, the recorded values are not touched."""

    def __init__(self, source, prefixes: tuple[str, ...]):
        self.source, self.prefixes = source, prefixes

    def describe(self) -> list:
        return []  # nothing to check for clashes: this is the render registry's only collector

    def collect(self):
        families = list(self.source.collect())
        for prefix in self.prefixes:
            if f"{prefix}:" == _OWN:
                yield from families
                continue
            for family in families:
                yield _renamed(family, f"{prefix}:")


def _renamed(family, prefix: str):
    if not family.name.startswith(_OWN):
        return family
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
        "gpu_memory_utilization": str(cache.gpu_memory_utilization),
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_gpu_blocks_override": str(cache.num_gpu_blocks_override),
        "swap_space": str(cache.swap_space),
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
    )


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        multiprocess: bool = False,
        count_engine_totals: bool = True,
        prefixes: tuple[str, ...] = METRICS_PREFIXES["both"],
    ):
        self.registry = CollectorRegistry()
        self.multiprocess = multiprocess
        self.prefixes = prefixes
        self._render_registry: CollectorRegistry | None = None
        self.count_engine_totals = count_engine_totals
        label = ["model_name"]
        r, m = self.registry, model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagoda:{name}", doc, label, registry=r, multiprocess_mode="mostrecent")

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(f"pagoda:{name}", doc, label + (extra or []), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"pagoda:{name}", doc, label, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Requests in the running batch").labels(m)
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled").labels(m)
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)").labels(m)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed").labels(m)
        self.generation_tokens = counter("generation_tokens", "Tokens generated").labels(m)
        self._success = counter("request_success", "Finished requests by finish reason", ["finished_reason"])
        self.preemptions = counter("num_preemptions", "Requests preempted by the scheduler").labels(m)
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache").labels(m)
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache").labels(m)
        # Pagoda's own (no vLLM name): where the engine core's time goes, to tell a host-bound core
        # from a GPU-bound one under load (`pagoda bench` reports them per point, per step).
        self.engine_steps = counter("engine_steps", "Engine steps run").labels(m)
        self.engine_busy = counter(
            "engine_core_busy_seconds", "Engine core time in its loop (not idle-waiting for requests)"
        ).labels(m)
        self.engine_wait = counter(
            "engine_core_device_wait_seconds", "Part of the busy time spent waiting for a step's sampled tokens"
        ).labels(m)
        self.engine_cpu = counter(
            "engine_core_cpu_seconds", "CPU time of the engine core's loop thread over its busy time"
        ).labels(m)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS).labels(m)
        self.itl = histogram("inter_token_latency_seconds", "Time between streamed tokens", _LATENCY_BUCKETS).labels(m)
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Per request: time from the first to the last output token over the tokens after the first",
            _LATENCY_BUCKETS,
        ).labels(m)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish", _TTFT_BUCKETS).labels(
            m
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time waiting before first scheduled", _TTFT_BUCKETS
        ).labels(m)
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
        )
        self._last: tuple[float, ...] = (0, 0, 0, 0, 0.0, 0.0, 0.0)
        self._cache_info: Gauge | None = None

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

    def on_engine_outputs(self, message: Outputs) -> None:
        stats = message.stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        generated = 0
        for _, finished, completions, num_prompt_tokens, _, queue_time in message.outputs:  # wire tuples
            for completion in completions:
                generated += len(completion[2])
            if finished:
                self.prompt_tokens.inc(num_prompt_tokens)
                if queue_time is not None:
                    self.queue_time.observe(queue_time)
        if generated:
            self.generation_tokens.inc(generated)
        if not self.count_engine_totals:
            return
        # The core sends running totals; counters advance by the difference.
        totals = _engine_totals(stats)
        for counter, total, last in zip(self._total_counters, totals, self._last):
            if total > last:
                counter.inc(total - last)
        self._last = totals

    def on_request_finished(self, finish_reasons: list[str | None]) -> None:
        for reason in finish_reasons:
            self._success.labels(self.model_name, reason or "abort").inc()

    def render(self, waiting_estimate: int | None = None) -> bytes:
        """The exposition text. `waiting_estimate`: the API side's waiting count while the core's report
        is stale (`AsyncEngine.waiting_estimate`); it holds until the core's next report."""
        if waiting_estimate is not None:
            self.waiting.set(waiting_estimate)
        if self._render_registry is None:
            source: Any = self.registry
            if self.multiprocess:
                # lazy: prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR must be set before import)
                from prometheus_client import multiprocess

                source = multiprocess.MultiProcessCollector(None)  # every process's files, summed
            self._render_registry = CollectorRegistry()
            self._render_registry.register(_Prefixed(source, self.prefixes))
        return generate_latest(self._render_registry)
