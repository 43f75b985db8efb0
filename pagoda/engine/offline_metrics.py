"""`LLM.get_metrics()`: the offline engine's counters and gauges, shaped as vLLM's metrics reader returns them.

vLLM's offline `LLM.get_metrics()` reads its Prometheus registry into a list of `Counter`, `Gauge`, `Vector`
and `Histogram` objects, each with the metric's `vllm:` name and its labels (`model_name`, `engine`). Here
the same objects are built from the engine's snapshot (`EngineStats`) and the totals the offline loop keeps
over finished requests, so code written against vLLM's reader (`m.name == "vllm:spec_decode_num_drafts"`,
`m.value`, `m.values`) runs unchanged. Latency histograms are the server's (`/metrics`); none offline.
"""

from __future__ import annotations

from collections import Counter as Tally
from dataclasses import dataclass, field

from pagoda.outputs import EngineStats, RequestOutput


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class OfflineTotals:
    """What the offline loop counts over finished requests (the server counts the same in its API process)."""

    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    finished: Tally = field(default_factory=Tally)  # finish reason -> requests

    def add(self, output: RequestOutput) -> None:
        self.prompt_tokens += len(output.prompt_token_ids)
        self.prompt_tokens_cached += output.num_cached_tokens
        for completion in output.outputs:
            self.generation_tokens += len(completion.token_ids)
            self.finished[completion.finish_reason or "abort"] += 1


def metrics_list(stats: EngineStats, totals: OfflineTotals, model_name: str) -> list[Metric]:
    labels = {"model_name": model_name, "engine": "0"}

    def counter(name: str, value: int, **extra: str) -> Counter:
        return Counter(f"vllm:{name}", {**labels, **extra}, value)

    def gauge(name: str, value: float) -> Gauge:
        return Gauge(f"vllm:{name}", dict(labels), value)

    metrics: list[Metric] = [
        gauge("num_requests_running", stats.num_running),
        gauge("num_requests_waiting", stats.num_waiting),
        gauge("kv_cache_usage_perc", stats.kv_cache_usage),
        counter("num_preemptions", stats.num_preemptions),
        counter("prefix_cache_queries", stats.prefix_cache_queries),
        counter("prefix_cache_hits", stats.prefix_cache_hits),
        counter("prompt_tokens", totals.prompt_tokens),
        counter("prompt_tokens_cached", totals.prompt_tokens_cached),
        counter("generation_tokens", totals.generation_tokens),
    ]
    metrics += [
        counter("request_success", count, finished_reason=reason) for reason, count in sorted(totals.finished.items())
    ]
    if stats.spec_accepted_per_pos:  # speculative decoding is on
        metrics += [
            counter("spec_decode_num_drafts", stats.spec_num_drafts),
            counter("spec_decode_num_draft_tokens", stats.spec_num_draft_tokens),
            counter("spec_decode_num_accepted_tokens", stats.spec_num_accepted_tokens),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels), list(stats.spec_accepted_per_pos)),
        ]
    return metrics
