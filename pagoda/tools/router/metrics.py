"""The router's Prometheus metrics (`pagoda_router:` prefix), in its own registry.

Counters and histograms are fed per request by the proxy; gauges (backend up, breaker state, in
flight, long-request queue) are read from the live state at scrape time, so the hot path never
touches them.

  pagoda_router:requests_total{backend,endpoint,code}        requests answered, by backend and status
  pagoda_router:backend_errors_total{backend,kind}            connect | timeout | http_502/503/504 | stream_cut ...
  pagoda_router:retries_total{backend}                        requests moved off this backend before the first byte
  pagoda_router:affinity_total{backend,result}                hit (ring owner served it) | miss (moved) | none
  pagoda_router:session_key_total{source}                     header | user | fingerprint | prefix | none
  pagoda_router:request_latency_seconds{backend}              router arrival -> last byte
  pagoda_router:time_to_first_byte_seconds{backend}           router arrival -> first upstream body byte
  pagoda_router:client_disconnects_total{backend}             clients gone before the end (upstream cancelled)
  pagoda_router:rejected_total{reason}                        unauthorized | too_large | bad_request | no_backend
  pagoda_router:prompt_tokens_total{key} / completion_tokens_total{key} / key_requests_total{key}
  pagoda_router:backend_up{backend}, backend_inflight{backend}, circuit_state{backend} (0 closed, 1 half-open,
  2 open), long_queue_waiting, long_queue_running, config_reloads_total
  pagoda_router:key_requests_without_usage_total{key}         requests whose answer carried no usage

With `pagoda router --workers N` each worker process writes its counters and histograms to files in a private
PROMETHEUS_MULTIPROC_DIR (prometheus_client's multiprocess mode) and a scrape, whichever worker answers it,
sums all workers' files. The gauges are each worker's own view, published into those files every
GAUGE_PUBLISH_S (and at every scrape by the worker answering): backend_inflight and the long-queue gauges are
summed over the live workers, backend_up is the minimum (1 only when every worker routes to the backend),
circuit_state the maximum (the most open breaker of any worker). config_reloads_total is counted by worker 0
(every worker applies every reload).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagoda.tools.router.health import STATE_VALUE
from pagoda.tools.router.usage import empty_row

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
P = "pagoda_router:"


class _StateCollector:
    def __init__(self, state: Any):
        self.state = state

    def collect(self) -> Any:
        up = GaugeMetricFamily(P + "backend_up", "1 when active health probes pass", labels=["backend"])
        inflight = GaugeMetricFamily(P + "backend_inflight", "Requests in flight to the backend", labels=["backend"])
        circuit = GaugeMetricFamily(
            P + "circuit_state", "Circuit breaker: 0 closed, 1 half-open, 2 open", labels=["backend"]
        )
        for b in list(self.state.backends):
            up.add_metric([b.name], 1.0 if b.healthy else 0.0)
            inflight.add_metric([b.name], float(b.inflight))
            circuit.add_metric([b.name], float(STATE_VALUE[b.breaker.state()]))
        yield up
        yield inflight
        yield circuit
        queue = self.state.long_queue
        yield GaugeMetricFamily(P + "long_queue_waiting", "Long requests waiting for a slot", value=queue.waiting)
        yield GaugeMetricFamily(P + "long_queue_running", "Long requests holding a slot", value=queue.running)
        yield CounterMetricFamily(P + "config_reloads", "Config file reloads applied", value=self.state.reloads)


GAUGE_PUBLISH_S = 0.25


class RouterMetrics:
    def __init__(self, state: Any, multiprocess_dir: str | None = None, worker_index: int = 0):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(P + "requests", "Requests answered", ["backend", "endpoint", "code"], registry=r)
        self.errors = Counter(
            P + "backend_errors", "Backend failures seen by the router", ["backend", "kind"], registry=r
        )
        self.retries = Counter(
            P + "retries",
            "Requests moved to another backend after a failure before the first byte",
            ["backend"],
            registry=r,
        )
        self.affinity = Counter(
            P + "affinity", "Routing decisions: hit = the key's ring owner served it", ["backend", "result"], registry=r
        )
        self.key_source = Counter(P + "session_key", "Where the routing key came from", ["source"], registry=r)
        self.latency = Histogram(
            P + "request_latency_seconds", "Router arrival to last byte", ["backend"], buckets=_BUCKETS, registry=r
        )
        self.ttfb = Histogram(
            P + "time_to_first_byte_seconds",
            "Router arrival to first upstream body byte",
            ["backend"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.disconnects = Counter(
            P + "client_disconnects", "Clients that went away before the end", ["backend"], registry=r
        )
        self.rejected = Counter(
            P + "rejected", "Requests the router answered itself with an error", ["reason"], registry=r
        )
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens per API key", ["key"], registry=r)
        self.completion_tokens = Counter(P + "completion_tokens", "Completion tokens per API key", ["key"], registry=r)
        self.key_requests = Counter(P + "key_requests", "Requests per API key", ["key"], registry=r)
        self.key_no_usage = Counter(
            P + "key_requests_without_usage", "Requests per API key whose answer carried no usage", ["key"], registry=r
        )
        self._children: dict[tuple, Any] = {}
        self.multiprocess_dir = multiprocess_dir
        self.worker_index = worker_index
        if multiprocess_dir is None:
            r.register(_StateCollector(state))
            return
        # Multiprocess mode (--workers N): the gauges are real Gauge objects whose values live in the shared
        # directory, refreshed from this worker's state by publish(); the values each mode combines are per worker.
        self.state = state
        self.g_up = Gauge(
            P + "backend_up",
            "1 when active health probes pass (in every worker)",
            ["backend"],
            multiprocess_mode="livemin",
            registry=r,
        )
        self.g_inflight = Gauge(
            P + "backend_inflight",
            "Requests in flight to the backend (all workers)",
            ["backend"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.g_circuit = Gauge(
            P + "circuit_state",
            "Circuit breaker: 0 closed, 1 half-open, 2 open (the most open of the workers' breakers)",
            ["backend"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.g_waiting = Gauge(
            P + "long_queue_waiting",
            "Long requests waiting for a slot (all workers)",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.g_running = Gauge(
            P + "long_queue_running",
            "Long requests holding a slot (all workers)",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.reloads = Counter(P + "config_reloads", "Config file reloads applied (counted by worker 0)", registry=r)
        self._reloads_seen = 0
        self._published: set[str] = set()

    def child(self, metric: Any, *labels: str) -> Any:
        """Cached `.labels(...)` (the hot path calls this per request)."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def publish(self) -> None:
        """Multiprocess mode: write this worker's gauges (and reload count) into the shared files."""
        state = self.state
        names = set()
        for b in list(state.backends):
            names.add(b.name)
            self.child(self.g_up, b.name).set(1.0 if b.healthy else 0.0)
            self.child(self.g_inflight, b.name).set(float(b.inflight))
            self.child(self.g_circuit, b.name).set(float(STATE_VALUE[b.breaker.state()]))
        for name in self._published - names:  # removed by a config reload: its file entries cannot be deleted
            self.child(self.g_up, name).set(0.0)
            self.child(self.g_inflight, name).set(0.0)
            self.child(self.g_circuit, name).set(0.0)
        self._published |= names
        self.g_waiting.set(state.long_queue.waiting)
        self.g_running.set(state.long_queue.running)
        if self.worker_index == 0 and state.reloads > self._reloads_seen:
            self.reloads.inc(state.reloads - self._reloads_seen)
            self._reloads_seen = state.reloads

    def aggregate(self) -> CollectorRegistry:
        """Multiprocess mode: a registry that reads every worker's files."""
        # lazy: prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR must be set before import)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=self.multiprocess_dir)
        return registry

    def usage_totals(self) -> dict[str, dict[str, int]]:
        """Multiprocess mode: the /usage rows summed over all workers, from the per-key counters."""
        fields = {
            P + "key_requests_total": "requests",
            P + "key_requests_without_usage_total": "requests_without_usage",
            P + "prompt_tokens_total": "prompt_tokens",
            P + "completion_tokens_total": "completion_tokens",
        }
        rows: dict[str, dict[str, int]] = {}
        for family in self.aggregate().collect():
            for sample in family.samples:
                field = fields.get(sample.name)
                if field is None:
                    continue
                row = rows.get(sample.labels["key"])
                if row is None:
                    row = rows[sample.labels["key"]] = empty_row()
                row[field] += int(sample.value)
        for row in rows.values():
            row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
        return rows

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        self.publish()
        return generate_latest(self.aggregate())
