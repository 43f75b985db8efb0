"""/metrics under both prefixes: every `pagoda:` sample also as `vllm:`, same labels and value, in one
process (in prometheus multiprocess mode, several API processes: tests/e2e/test_metrics_multiprocess.py);
`--metrics-prefix` picks one; the waiting gauge shows the API side's count while the core's report is
stale; `pagoda bench` reading a page with both prefixes counts each value once."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagoda.engine.core_process import Outputs
from pagoda.outputs import EngineStats
from pagoda.server.metrics import METRICS_PREFIXES, ServerMetrics
from pagoda.tools.bench.metrics import parse_prometheus


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def by_prefix(found: dict[tuple[str, tuple], float], prefix: str) -> dict[tuple[str, tuple], float]:
    return {(name.split(":", 1)[1], labels): v for (name, labels), v in found.items() if name.startswith(prefix + ":")}


def feed(metrics: ServerMetrics) -> None:
    stats = EngineStats(3, 2, 0.25, 1, 40, 16, 7, 0.002, 0.01, 0.009)
    metrics.on_engine_outputs(Outputs([("r", True, [(0, "x", [5, 6], "stop", None, None, None)], 4, 0, 0.01)], stats))
    metrics.ttft.observe(0.03)
    metrics.itl.observe(0.002)
    metrics.e2e.observe(0.3)
    metrics.on_request_finished(["stop", "length", None])


def check_both(text: str) -> dict[tuple[str, tuple], float]:
    found = samples(text)
    own, theirs = by_prefix(found, "pagoda"), by_prefix(found, "vllm")
    assert len(own) + len(theirs) == len(found)  # nothing under a third name
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
    assert theirs[("generation_tokens_total", (("model_name", "m"),))] == 2
    assert theirs[("request_success_total", (("finished_reason", "abort"), ("model_name", "m")))] == 1
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
    assert page[("vllm:num_requests_waiting", (("model_name", "m"),))] == 9
    assert page[("pagoda:num_requests_waiting", (("model_name", "m"),))] == 9
    feed(metrics)  # the core's next report is the truth again
    assert samples(metrics.render().decode())[("vllm:num_requests_waiting", (("model_name", "m"),))] == 2


def test_bench_reads_a_page_with_both_prefixes_once() -> None:
    metrics = ServerMetrics("m")
    feed(metrics)
    parsed = parse_prometheus(metrics.render().decode())
    assert parsed is not None
    assert (parsed["running"], parsed["waiting"], parsed["generation_tokens"], parsed["engine_steps"]) == (3, 2, 2, 7)
