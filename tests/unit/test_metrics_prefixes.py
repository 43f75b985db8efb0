"""/metrics under both prefixes: every `pagoda:` sample also as `vllm:`, same labels and value, in one
process (in prometheus multiprocess mode, several API processes: tests/e2e/test_metrics_multiprocess.py);
`--metrics-prefix` picks one; the waiting gauge shows the API side's count while the core's report is
stale; `pagoda bench` reading a page with both prefixes counts each value once."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.engine.core_process import Outputs
from pagoda.outputs import EngineStats
from pagoda.sampling_params import SamplingParams
from pagoda.server.metrics import METRICS_PREFIXES, RequestTiming, ServerMetrics
from pagoda.tools.bench.metrics import parse_prometheus


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def by_prefix(found: dict[tuple[str, tuple], float], prefix: str) -> dict[tuple[str, tuple], float]:
    return {(name.split(":", 1)[1], labels): v for (name, labels), v in found.items() if name.startswith(prefix + ":")}


M = (("engine", "0"), ("model_name", "m"))  # every engine metric's labels, as vLLM's


def feed(metrics: ServerMetrics) -> None:
    """One core report (3 running, 2 waiting of which 1 for its grammar; a 12-token step; 5 encoder-cache
    lookups, 3 hits; 4 speculative rows, 10 proposals, 6 accepted: 4 at position 0, 2 at 1) finishing a
    request with 4 prompt tokens (2 from the prefix cache), then that request's end in the API process: n=3
    choices, 2 tokens, scheduled 0.01 s after it was sent, first token 0.5 s and last 1.5 s after it arrived."""
    stats = EngineStats(
        3, 2, 0.25, 1, 40, 16, 7, 0.002, 0.01, 0.009, num_waiting_deferred=1, mm_cache_queries=5, mm_cache_hits=3,
        step_tokens=(12,), spec_num_drafts=4, spec_num_draft_tokens=10, spec_num_accepted_tokens=6,
        spec_accepted_per_pos=(4, 2, 0),
    )  # fmt: skip
    metrics.on_engine_outputs(Outputs([("r", True, [(0, "x", [5, 6], "stop", None, None, None)], 4, 2, 0.01)], stats))
    metrics.ttft.observe(0.03)
    metrics.itl.observe(0.002)
    timing = RequestTiming(arrival=100.0, submitted=100.2, first=100.5, last=101.5, queue_time=0.01)
    metrics.on_request_finished(["stop", "length", None], SamplingParams(n=3, max_tokens=30), timing, 4, 2)
    metrics.http.observe("POST", "/v1/completions", 200, 0.2, 10, 20)


def check_both(text: str) -> dict[tuple[str, tuple], float]:
    found = {key: v for key, v in samples(text).items() if not key[0].startswith(("http_", "process_"))}
    own, theirs = by_prefix(found, "pagoda"), by_prefix(found, "vllm")
    assert len(own) + len(theirs) == len(found)  # nothing under a third name but the standard http_/process_
    assert own == theirs and len(own) > 50
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "num_preemptions_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_sum",
        "request_queue_time_seconds_count",
        "engine_steps_total",
    ):
        assert any(key[0] == name for key in theirs), name
    return theirs


def test_one_process_shows_every_metric_under_both_prefixes() -> None:
    metrics = ServerMetrics("m")
    feed(metrics)
    text = metrics.render().decode()
    theirs = check_both(text)
    assert theirs[("generation_tokens_total", M)] == 2
    assert theirs[("request_success_total", (("engine", "0"), ("finished_reason", "abort"), ("model_name", "m")))] == 1
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    # Rendering copies families, it does not re-record: a second scrape is the same page.
    assert samples(metrics.render().decode()) == samples(text)


def test_metrics_prefix_picks_one() -> None:
    for choice, missing in (("vllm", "pagoda:"), ("pagoda", "vllm:")):
        metrics = ServerMetrics("m", prefixes=METRICS_PREFIXES[choice])
        feed(metrics)
        names = {name for name, _ in samples(metrics.render().decode())}
        assert names and not any(n.startswith(missing) for n in names), choice
        assert f"{choice}:num_requests_waiting" in names


def test_a_stale_report_shows_the_api_side_waiting_count() -> None:
    metrics = ServerMetrics("m")
    feed(metrics)  # the core said: 2 waiting
    page = samples(metrics.render(waiting_estimate=9).decode())
    assert page[("vllm:num_requests_waiting", M)] == 9
    assert page[("pagoda:num_requests_waiting", M)] == 9
    feed(metrics)  # the core's next report is the truth again
    assert samples(metrics.render().decode())[("vllm:num_requests_waiting", M)] == 2


def test_bench_reads_a_page_with_both_prefixes_once() -> None:
    metrics = ServerMetrics("m")
    feed(metrics)
    parsed = parse_prometheus(metrics.render().decode())
    assert parsed is not None
    assert (parsed["running"], parsed["waiting"], parsed["generation_tokens"], parsed["engine_steps"]) == (3, 2, 2, 7)


# vLLM 0.26's boundaries, written out here (not imported from the code under test).
VLLM_TTFT_LE = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0]
VLLM_TTFT_LE += [40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL_LE = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
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
]
VLLM_REQUEST_LE = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0]
VLLM_REQUEST_LE += [480.0, 960.0, 1920.0, 7680.0]


VLLM_NAMES = [
    "request_prefill_time_seconds_count",
    "request_decode_time_seconds_count",
    "request_inference_time_seconds_count",
    "request_prompt_tokens_count",
    "request_generation_tokens_count",
    "request_params_n_count",
    "request_params_max_tokens_count",
    "iteration_tokens_total_count",
    "prompt_tokens_cached_total",
    "num_requests_waiting_by_reason",
    "mm_cache_queries_total",
    "mm_cache_hits_total",
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
    "spec_decode_num_accepted_tokens_per_pos_total",
]


def bucket_bounds(found: dict, name: str) -> list[float]:
    return sorted(float(dict(labels)["le"]) for (n, labels), _ in found.items() if n == name + "_bucket")[:-1]


def test_the_vllm_families_labels_and_buckets() -> None:
    """Every family vLLM 0.26 shows that a dashboard may read: with `engine`, vLLM's bucket boundaries, and the
    values of one fed request (each value follows from `feed`'s docstring)."""
    metrics = ServerMetrics("m", max_model_len=100)
    feed(metrics)
    found = samples(metrics.render().decode())
    vllm = by_prefix(found, "vllm")
    names = {name for name, _ in vllm}
    for name in VLLM_NAMES:
        assert name in names, name
    assert all(dict(labels).get("engine") == "0" for (_, labels) in vllm), "every vllm: sample has engine=0"
    assert bucket_bounds(found, "vllm:time_to_first_token_seconds") == VLLM_TTFT_LE
    assert bucket_bounds(found, "vllm:inter_token_latency_seconds") == VLLM_ITL_LE
    assert bucket_bounds(found, "vllm:request_time_per_output_token_seconds") == VLLM_ITL_LE
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time"):
        assert bucket_bounds(found, f"vllm:{name}_seconds") == VLLM_REQUEST_LE, name
    assert bucket_bounds(found, "vllm:request_inference_time_seconds") == VLLM_REQUEST_LE
    assert bucket_bounds(found, "vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100]  # 1-2-5 to max_model_len
    assert bucket_bounds(found, "vllm:request_params_n") == [1, 2, 5, 10, 20]
    assert bucket_bounds(found, "vllm:iteration_tokens_total") == [
        1,
        8,
        16,
        32,
        64,
        128,
        256,
        512,
        1024,
        2048,
        4096,
        8192,
        16384,
    ]

    def value(name: str, **extra: str) -> float:
        return vllm[(name, tuple(sorted({**dict(M), **extra}.items())))]

    assert value("request_prefill_time_seconds_sum") == pytest.approx(0.29)  # first token - (sent + queue)
    assert value("request_inference_time_seconds_sum") == pytest.approx(1.29)  # last token - (sent + queue)
    assert value("request_decode_time_seconds_sum") == 1.0
    assert value("request_time_per_output_token_seconds_count") == 0  # 2 tokens over 3 choices: none has two
    assert value("request_prompt_tokens_sum") == 4 and value("request_generation_tokens_sum") == 2
    assert value("request_params_n_sum") == 3 and value("request_params_max_tokens_sum") == 30
    assert value("iteration_tokens_total_sum") == 12 and value("iteration_tokens_total_count") == 1
    assert value("prompt_tokens_cached_total") == 2
    assert value("num_requests_waiting_by_reason", reason="capacity") == 1
    assert value("num_requests_waiting_by_reason", reason="deferred") == 1
    assert value("mm_cache_queries_total") == 5 and value("mm_cache_hits_total") == 3
    assert value("spec_decode_num_drafts_total") == 4 and value("spec_decode_num_draft_tokens_total") == 10
    assert value("spec_decode_num_accepted_tokens_total") == 6
    per_pos = [value("spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(2)]
    assert per_pos == [4, 2]
    # The API side's estimate while the core's report is stale: the extra ones wait for capacity.
    page = by_prefix(samples(metrics.render(waiting_estimate=6).decode()), "vllm")
    assert page[("num_requests_waiting_by_reason", tuple(sorted({**dict(M), "reason": "capacity"}.items())))] == 5


def test_process_metrics_of_one_api_process() -> None:
    from pagoda.server.host_metrics import process_collector

    metrics = ServerMetrics("m", process_collector=process_collector(None, 1))
    found = samples(metrics.render().decode())
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_start_time_seconds"):
        assert found[(name, ())] > 0, name  # once, unprefixed, unlabelled
