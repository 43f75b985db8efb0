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
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagoda.router.health import STATE_VALUE

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
            160.0)
P = "pagoda_router:"


class _StateCollector:
    def __init__(self, state: Any):
        self.state = state

    def collect(self) -> Any:
        up = GaugeMetricFamily(P + "backend_up", "1 when active health probes pass", labels=["backend"])
        inflight = GaugeMetricFamily(P + "backend_inflight", "Requests in flight to the backend", labels=["backend"])
        circuit = GaugeMetricFamily(P + "circuit_state", "Circuit breaker: 0 closed, 1 half-open, 2 open",
                                    labels=["backend"])
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


class RouterMetrics:
    def __init__(self, state: Any):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(P + "requests", "Requests answered", ["backend", "endpoint", "code"], registry=r)
        self.errors = Counter(P + "backend_errors", "Backend failures seen by the router", ["backend", "kind"],
                              registry=r)
        self.retries = Counter(P + "retries", "Requests moved to another backend after a failure before the "
                               "first byte", ["backend"], registry=r)
        self.affinity = Counter(P + "affinity", "Routing decisions: hit = the key's ring owner served it",
                                ["backend", "result"], registry=r)
        self.key_source = Counter(P + "session_key", "Where the routing key came from", ["source"], registry=r)
        self.latency = Histogram(P + "request_latency_seconds", "Router arrival to last byte", ["backend"],
                                 buckets=_BUCKETS, registry=r)
        self.ttfb = Histogram(P + "time_to_first_byte_seconds", "Router arrival to first upstream body byte",
                              ["backend"], buckets=_BUCKETS, registry=r)
        self.disconnects = Counter(P + "client_disconnects", "Clients that went away before the end",
                                   ["backend"], registry=r)
        self.rejected = Counter(P + "rejected", "Requests the router answered itself with an error", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens per API key", ["key"], registry=r)
        self.completion_tokens = Counter(P + "completion_tokens", "Completion tokens per API key", ["key"],
                                         registry=r)
        self.key_requests = Counter(P + "key_requests", "Requests per API key", ["key"], registry=r)
        r.register(_StateCollector(state))
        self._children: dict[tuple, Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """Cached `.labels(...)` (the hot path calls this per request)."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def render(self) -> bytes:
        return generate_latest(self.registry)
