"""vLLM-compatible aggregation of per-request timings, and /metrics parsing.

The definitions are those of `vllm bench serve` (`calculate_metrics` in vllm/benchmarks/serve.py, vLLM 0.26):
- TTFT: send -> first token chunk. E2EL: send -> last token chunk (see client.py). Failed requests are
  counted, never timed, and their tokens do not count.
- Output tokens per request = usage.completion_tokens; TPOT = (E2EL - TTFT) / (n - 1), only for n > 1.
- ITL: every gap between consecutive token chunks, pooled over requests (differs from TPOT when a chunk
  carries several tokens).
- Throughputs divide by the point's duration: from dispatching the first request to the last response done
  (vLLM's `benchmark_duration`). Percentiles: numpy's default (linear interpolation).
- Goodput: completed requests whose TTFT and TPOT meet the per-request thresholds (the SLO values, in ms)
  divided by the duration; a request with <= 1 output token counts as TPOT 0 (as vLLM does).
- max_concurrent_requests: the peak of overlapping [start, start + E2EL) over completed requests;
  max_output_tokens_per_s: the most token chunks that arrived in one whole second counted from the first
  completed request's start (vLLM's 1-second buckets).
Keys: `mean_/median_/std_/p50/p90/p95/p99_{ttft,tpot,itl,e2el}_ms` (None when there is no sample).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")
MAX_ERRORS_KEPT = 5


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def tpot_of(ttft: float | None, e2el: float | None, output_tokens: int | None) -> float | None:
    """(E2EL - TTFT) / (n - 1) in seconds, for n > 1 output tokens; None otherwise."""
    if ttft is None or e2el is None or output_tokens is None or output_tokens <= 1:
        return None
    return (e2el - ttft) / (output_tokens - 1)


def summarize_ms(name: str, values_s: Sequence[float], percentiles: Iterable[float] = PERCENTILES) -> dict:
    """mean/median/std/pNN of `values_s` (seconds) in milliseconds, under vLLM's key names."""
    ms = np.asarray(values_s, dtype=float) * 1000.0
    out: dict[str, float | None] = {}
    empty = ms.size == 0
    out[f"mean_{name}_ms"] = None if empty else float(ms.mean())
    out[f"median_{name}_ms"] = None if empty else float(np.median(ms))
    out[f"std_{name}_ms"] = None if empty else float(ms.std())
    for q in percentiles:
        key = f"p{q:g}_{name}_ms"
        out[key] = None if empty else float(np.percentile(ms, q))
    return out


def peak_chunks_per_second(results: Sequence[Any]) -> float:
    """vLLM's `max_output_tokens_per_s`: token-chunk arrival times (start + TTFT, then each ITL gap) put in
    1-second buckets from the earliest start; the fullest bucket's count."""
    if not results:
        return 0.0
    t0 = min(r.start for r in results)
    span = max(r.start + r.e2el for r in results) - t0
    buckets = np.zeros(int(math.ceil(span)) + 1)
    for r in results:
        times = r.start + r.ttft + np.concatenate(([0.0], np.cumsum(np.asarray(r.itl, dtype=float))))
        index = (times - t0).astype(int)
        index = index[(index >= 0) & (index < buckets.size)]
        np.add.at(buckets, index, 1)
    return float(buckets.max())


def max_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    """Peak number of overlapping [start, end) intervals (requests in flight on the client)."""
    events = []
    for start, end in intervals:
        events.append((start, 1))
        events.append((end, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # an end at the same instant as a start frees first
    peak = cur = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak


@dataclass
class SLO:
    ttft_p95_ms: float | None = None
    tpot_p95_ms: float | None = None
    max_error_rate: float = 0.01

    def request_ok(self, ttft_s: float, tpot_s: float | None) -> bool:
        if self.ttft_p95_ms is not None and ttft_s * 1000.0 > self.ttft_p95_ms:
            return False
        return self.tpot_p95_ms is None or (tpot_s or 0.0) * 1000.0 <= self.tpot_p95_ms

    def point_ok(self, point: dict[str, Any]) -> bool:
        """P95 TTFT and P95 TPOT within their limits, error rate <= max_error_rate, at least one completion."""
        if not point.get("completed"):
            return False
        if point.get("error_rate", 1.0) > self.max_error_rate:
            return False
        ttft, tpot = point.get("p95_ttft_ms"), point.get("p95_tpot_ms")
        if self.ttft_p95_ms is not None and (ttft is None or ttft > self.ttft_p95_ms):
            return False
        # No TPOT sample (all outputs <= 1 token) counts as TPOT 0, as in vLLM's goodput.
        return self.tpot_p95_ms is None or tpot is None or tpot <= self.tpot_p95_ms


def aggregate(
    results: Sequence[Any], duration: float, slo: SLO | None = None, percentiles: Iterable[float] = PERCENTILES
) -> dict[str, Any]:
    """The vLLM result keys for one point from `RequestResult`-like objects (attributes success, ttft, e2el,
    itl, prompt_tokens, completion_tokens, start, status, error, usage_reported, scheduled). `duration` is the
    point's span: first request dispatched -> last response done."""
    percentiles = tuple(percentiles)
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.e2el for r in ok]
    tpots = [t for t in (tpot_of(r.ttft, r.e2el, r.completion_tokens) for r in ok) if t is not None]
    itls = [gap for r in ok for gap in r.itl]
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    duration = max(duration, 1e-9)
    total = len(results)

    point: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(failed),
        "error_rate": (len(failed) / total) if total else 0.0,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "mean_input_tokens": (in_tokens / len(ok)) if ok else None,
        "mean_output_tokens": (out_tokens / len(ok)) if ok else None,
        "request_throughput": len(ok) / duration,
        "request_goodput": None,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "max_concurrent_requests": max_concurrency((r.start, r.start + r.e2el) for r in ok),
        "max_output_tokens_per_s": peak_chunks_per_second(ok),
        "usage_missing": sum(1 for r in ok if not r.usage_reported),
    }
    if slo is not None and (slo.ttft_p95_ms is not None or slo.tpot_p95_ms is not None):
        good = sum(1 for r in ok if slo.request_ok(r.ttft, tpot_of(r.ttft, r.e2el, r.completion_tokens)))
        point["request_goodput"] = good / duration
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        point.update(summarize_ms(name, values, percentiles))
    queue = [r.start - r.scheduled for r in results if r.scheduled is not None]
    if queue:  # open loop: time a due request waited for a free concurrency slot on the client
        point.update(summarize_ms("client_queue", [max(0.0, q) for q in queue], (95, 99)))
    counts = Counter(str(r.status) if r.status not in (None, 200) else "stream" for r in failed)
    point["error_counts"] = dict(counts)
    kept: list[str] = []
    for r in failed:
        if r.error and r.error not in kept:
            kept.append(r.error)
        if len(kept) >= MAX_ERRORS_KEPT:
            break
    point["errors"] = kept
    return point


# ---- server /metrics --------------------------------------------------------------------------------------

GAUGES = {  # our key -> metric names after the "vllm:" / "pagoda:" prefix
    "running": ("num_requests_running",),
    "waiting": ("num_requests_waiting",),
    "kv_cache_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    # Pagoda on CUDA only (NVML): each GPU's busy fraction; the mean over the server's GPUs
    "gpu_utilization": ("gpu_utilization_perc",),
}
COUNTERS = {
    "preemptions": ("num_preemptions_total", "num_preemptions"),
    "prompt_tokens": ("prompt_tokens_total",),
    "generation_tokens": ("generation_tokens_total",),
    "prefix_cache_queries": ("prefix_cache_queries_total",),
    "prefix_cache_hits": ("prefix_cache_hits_total",),
    # Histogram sums and counts: their deltas give the server's own mean TTFT and queue time for the
    # point, to set against the client's TTFT (the rest is HTTP, streaming and the client itself).
    "ttft_seconds_sum": ("time_to_first_token_seconds_sum",),
    "ttft_seconds_count": ("time_to_first_token_seconds_count",),
    "queue_seconds_sum": ("request_queue_time_seconds_sum",),
    "queue_seconds_count": ("request_queue_time_seconds_count",),
    # ... and where the rest of the first-token time goes: first scheduled to first token, then the decode.
    "prefill_seconds_sum": ("request_prefill_time_seconds_sum",),
    "prefill_seconds_count": ("request_prefill_time_seconds_count",),
    "decode_seconds_sum": ("request_decode_time_seconds_sum",),
    "decode_seconds_count": ("request_decode_time_seconds_count",),
    # Pagoda only: the engine core's steps, busy time and the part of it spent waiting for the GPU.
    "engine_steps": ("engine_steps_total",),
    "engine_busy_seconds": ("engine_core_busy_seconds_total",),
    "engine_device_wait_seconds": ("engine_core_device_wait_seconds_total",),
    "engine_cpu_seconds": ("engine_core_cpu_seconds_total",),
    # Speculative decoding (both engines): rows verified with proposals, the proposals, the ones accepted.
    "spec_drafts": ("spec_decode_num_drafts_total",),
    "spec_draft_tokens": ("spec_decode_num_draft_tokens_total",),
    "spec_accepted_tokens": ("spec_decode_num_accepted_tokens_total",),
}
# mean key -> (sum counter, count counter), in milliseconds
MEANS_MS = {
    "server_mean_ttft_ms": ("ttft_seconds_sum", "ttft_seconds_count"),
    "server_mean_queue_ms": ("queue_seconds_sum", "queue_seconds_count"),
    "server_mean_prefill_ms": ("prefill_seconds_sum", "prefill_seconds_count"),
    "server_mean_decode_ms": ("decode_seconds_sum", "decode_seconds_count"),
}
PREFIXES = ("vllm:", "pagoda:")
# The sample names read, under either prefix. A page carries ten times more lines (histogram buckets, HTTP and
# process metrics, every family under both prefixes); only these go to the parser, whose cost per line the
# client would otherwise take from the machine it measures, twice a second.
READ = frozenset(
    prefix + name for prefix in PREFIXES for names in (*GAUGES.values(), *COUNTERS.values()) for name in names
)


def _read_lines(text: str) -> str:
    """The sample lines of `text` whose metric name is in READ (HELP/TYPE comments dropped: the values and
    names are all that is read, and an untyped sample keeps both)."""
    # A sample's name ends at its labels' "{" or, without labels, at the space before its value.
    kept = [line for line in text.splitlines() if line.partition("{")[0].partition(" ")[0] in READ]
    return "\n".join(kept) + "\n"


def parse_prometheus(text: str) -> dict[str, float] | None:
    """The engine metrics of a /metrics page as {our key: value}, or None if it has none of them.
    Sums over label sets (engines, models) for counts; takes the max for the KV cache fraction and the
    mean over GPUs for their utilisation."""
    # lazy: prometheus_client fixes its multiprocess mode (PROMETHEUS_MULTIPROC_DIR) when first imported
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, list[float]] = {}
    try:
        families = list(text_string_to_metric_families(_read_lines(text)))
    except Exception:  # noqa: BLE001 - any malformed page reads as "no metrics"
        return None
    # One prefix only: Pagoda shows every metric under both (same values), which summed would double.
    per_prefix: dict[str, dict[str, list[float]]] = {prefix: {} for prefix in PREFIXES}
    for family in families:
        for sample in family.samples:
            for prefix in PREFIXES:
                if sample.name.startswith(prefix):
                    per_prefix[prefix].setdefault(sample.name[len(prefix) :], []).append(float(sample.value))
    # pagoda: first, when present: it says the server is Pagoda (whose pages carry both).
    prefix_seen = next((prefix.rstrip(":") for prefix in reversed(PREFIXES) if per_prefix[prefix]), None)
    by_name = per_prefix[f"{prefix_seen}:"] if prefix_seen else {}
    for key, names in {**GAUGES, **COUNTERS}.items():
        for name in names:
            if name in by_name:
                values[key] = by_name[name]
                break
    if not values:
        return None
    out = {k: _combine(k, v) for k, v in values.items()}
    out["_prefix"] = prefix_seen  # type: ignore[assignment]
    return out


def _combine(key: str, values: list[float]) -> float:
    if key == "kv_cache_usage":
        return max(values)
    if key == "gpu_utilization":
        return sum(values) / len(values)
    return sum(values)


def server_metrics_summary(before: dict | None, after: dict | None, samples: list[dict]) -> dict[str, Any]:
    """Peaks/means of the gauges over the samples taken during a point, and counter deltas before -> after."""
    if before is None and after is None and not samples:
        return {"available": False}
    out: dict[str, Any] = {
        "available": True,
        "prefix": (after or before or samples[0]).get("_prefix"),
        "samples": len(samples),
    }
    for key in GAUGES:
        series = [s[key] for s in samples if key in s]
        out[f"{key}_peak"] = max(series) if series else None
        out[f"{key}_mean"] = float(np.mean(series)) if series else None
    for key in COUNTERS:
        if before is not None and after is not None and key in before and key in after:
            out[f"{key}_delta"] = after[key] - before[key]
        else:
            out[f"{key}_delta"] = None
    for key, (total, count) in MEANS_MS.items():
        n = out[f"{count}_delta"]
        out[key] = 1e3 * out[f"{total}_delta"] / n if n else None
    # Per engine step over the point: host work (busy minus device wait) and the wait itself. A wait
    # near zero under load says the engine core's host work, not the GPU, sets the step rate.
    steps, busy, wait = (
        out[f"{k}_delta"] for k in ("engine_steps", "engine_busy_seconds", "engine_device_wait_seconds")
    )
    ok = steps and busy is not None and wait is not None
    out["engine_host_ms_per_step"] = 1e3 * (busy - wait) / steps if ok else None
    out["engine_wait_ms_per_step"] = 1e3 * wait / steps if ok else None
    # The core thread's CPU time per step: well under the host ms means it waited for a free core.
    cpu = out["engine_cpu_seconds_delta"]
    out["engine_cpu_ms_per_step"] = 1e3 * cpu / steps if steps and cpu is not None else None
    # vLLM's acceptance length: tokens a speculative row yields per verification (its accepted proposals
    # plus the model's own token), and the fraction of proposals accepted.
    drafts, drafted, accepted = (
        out[f"{k}_delta"] for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")
    )
    out["spec_acceptance_length"] = 1 + accepted / drafts if drafts and accepted is not None else None
    out["spec_acceptance_rate"] = accepted / drafted if drafted and accepted is not None else None
    return out
