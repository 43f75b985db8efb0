"""`pagoda bench` pure parts: vLLM metric definitions, percentiles, knee/SLO/recommendation, arrivals, SSE client."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math

import httpx
import numpy as np
import pytest

from pagoda.tools.bench.client import RequestResult, stream_request
from pagoda.tools.bench.metrics import (
    SLO,
    aggregate,
    max_concurrency,
    parse_prometheus,
    percentile,
    server_metrics_summary,
    summarize_ms,
    tpot_of,
)
from pagoda.tools.bench.sweep import analyze, find_knee, gain_per_doubling, max_passing, recommend, round_up8
from pagoda.tools.bench.workload import Workload, arrival_intervals, load_jsonl, parse_image_sizes


def _ok(start: float, ttft: float, gaps: list[float], tokens: int, prompt: int = 10) -> RequestResult:
    e2el = ttft + sum(gaps) + 0.001  # the usage chunk and [DONE] arrive a little after the last content chunk
    return RequestResult(
        success=True,
        status=200,
        start=start,
        end=start + e2el,
        ttft=ttft,
        e2el=e2el,
        itl=list(gaps),
        chunks=len(gaps) + 1,
        prompt_tokens=prompt,
        completion_tokens=tokens,
        usage_reported=True,
    )


def _failed(start: float, status: int | None = 500, error: str = "HTTP 500: boom") -> RequestResult:
    return RequestResult(success=False, status=status, error=error, start=start, end=start + 0.01)


# ---- percentiles and definitions ------------------------------------------------------------------------


@pytest.mark.parametrize("q", [50, 90, 95, 99])
def test_percentile_is_numpy_linear(q: int) -> None:
    values = np.random.default_rng(q).exponential(size=37).tolist()
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q, method="linear")))
    assert percentile([], q) is None


def test_summarize_ms_keys_and_units() -> None:
    out = summarize_ms("ttft", [0.1, 0.2, 0.3, 0.4])
    assert set(out) == {
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p50_ttft_ms",
        "p90_ttft_ms",
        "p95_ttft_ms",
        "p99_ttft_ms",
    }
    assert out["mean_ttft_ms"] == pytest.approx(250.0)
    assert out["p90_ttft_ms"] == pytest.approx(float(np.percentile([100, 200, 300, 400], 90)))
    assert out["std_ttft_ms"] == pytest.approx(float(np.std([100, 200, 300, 400])))
    assert all(v is None for v in summarize_ms("tpot", []).values())


def test_tpot_definition() -> None:
    assert tpot_of(0.5, 2.5, 5) == pytest.approx(0.5)  # (2.5 - 0.5) / (5 - 1)
    assert tpot_of(0.5, 0.5, 1) is None  # one output token: no TPOT sample
    assert tpot_of(None, 2.5, 5) is None


def test_aggregate_matches_vllm_definitions() -> None:
    a = _ok(0.0, 0.2, [0.1, 0.1, 0.1], tokens=4)  # one chunk per token
    b = _ok(0.05, 0.3, [0.2, 0.2], tokens=5, prompt=12)  # a chunk carried two tokens: ITL != TPOT
    c = _ok(0.1, 0.25, [], tokens=1)  # single token: TTFT and E2EL only
    bad = _failed(0.2)
    point = aggregate([a, b, c, bad], duration=2.0)
    assert point["completed"] == 3 and point["failed"] == 1
    assert point["error_rate"] == pytest.approx(0.25)
    assert point["total_output_tokens"] == 10 and point["total_input_tokens"] == 32
    assert point["output_throughput"] == pytest.approx(5.0)
    assert point["request_throughput"] == pytest.approx(1.5)
    assert point["total_token_throughput"] == pytest.approx(21.0)
    # TTFT / E2EL over completed requests only.
    assert point["mean_ttft_ms"] == pytest.approx(1000 * np.mean([0.2, 0.3, 0.25]))
    assert point["p95_e2el_ms"] == pytest.approx(1000 * np.percentile([a.e2el, b.e2el, c.e2el], 95))
    # TPOT per request for n > 1 only.
    tpots = [(a.e2el - a.ttft) / 3, (b.e2el - b.ttft) / 4]
    assert point["mean_tpot_ms"] == pytest.approx(1000 * np.mean(tpots))
    assert point["median_tpot_ms"] == pytest.approx(1000 * np.median(tpots))
    # ITL pooled over all gaps of all requests.
    assert point["mean_itl_ms"] == pytest.approx(1000 * np.mean([0.1, 0.1, 0.1, 0.2, 0.2]))
    assert point["p99_itl_ms"] == pytest.approx(1000 * np.percentile([0.1, 0.1, 0.1, 0.2, 0.2], 99))
    assert point["max_concurrent_requests"] == 3  # completed requests only, [start, start + E2EL)
    assert point["errors"] == ["HTTP 500: boom"] and point["error_counts"] == {"500": 1}
    assert point["request_goodput"] is None  # no SLO given


def test_aggregate_goodput_and_all_failed() -> None:
    fast = _ok(0.0, 0.1, [0.05], tokens=2)
    slow = _ok(0.0, 0.9, [0.05], tokens=2)
    point = aggregate([fast, slow], duration=1.0, slo=SLO(ttft_p95_ms=500))
    assert point["request_goodput"] == pytest.approx(1.0)
    none = aggregate([_failed(0.0, None, "ReadError"), _failed(0.0, 404, "HTTP 404: no model")], duration=1.0)
    assert none["completed"] == 0 and none["failed"] == 2
    assert none["mean_ttft_ms"] is None and none["p95_tpot_ms"] is None  # never 0 for "not measured"
    assert none["error_counts"] == {"stream": 1, "404": 1}


def test_max_concurrency() -> None:
    assert max_concurrency([(0, 1), (0.5, 2), (1, 3), (1.5, 2.5)]) == 3
    assert max_concurrency([(0, 1), (1, 2)]) == 1  # back to back is not overlap
    assert max_concurrency([]) == 0


# ---- SLO, knee, recommendation --------------------------------------------------------------------------


def test_slo_point_rules() -> None:
    slo = SLO(ttft_p95_ms=1000, tpot_p95_ms=50)
    good = {"completed": 100, "error_rate": 0.0, "p95_ttft_ms": 900, "p95_tpot_ms": 40}
    assert slo.point_ok(good)
    assert not slo.point_ok({**good, "p95_ttft_ms": 1001})
    assert not slo.point_ok({**good, "p95_tpot_ms": 51})
    assert not slo.point_ok({**good, "error_rate": 0.02})
    assert slo.point_ok({**good, "error_rate": 0.01})
    assert slo.point_ok({**good, "p95_tpot_ms": None})  # only 1-token outputs: TPOT counts as 0
    assert not slo.point_ok({**good, "completed": 0})


def test_knee_doubling_rule() -> None:
    assert find_knee([1, 2, 4, 8, 16], [10, 19, 35, 37, 38]) == 4  # 4 -> 8 adds 5.7 %
    assert find_knee([1, 2, 4, 8], [10, 20, 40, 80]) is None  # still linear
    assert find_knee([16, 1, 8, 4, 2], [38, 10, 37, 35, 19]) == 4  # order does not matter
    # Rungs that are not one doubling apart: the gain is normalised per doubling.
    assert gain_per_doubling(32, 100, 128, 121) == pytest.approx(0.10)
    assert find_knee([1, 8, 32, 64], [10, 60, 100, 105]) == 32
    assert find_knee([1, 8, 32, 128], [10, 60, 100, 115]) == 32  # +15 % over two doublings
    assert find_knee([1, 8, 32, 128], [10, 60, 100, 130]) is None  # +14 % per doubling
    assert find_knee([1, 2, 4], [10, 25, 20]) == 2  # throughput falls


def test_recommendation() -> None:
    assert recommend(32, 64) == 32
    assert recommend(64, 20) == 24
    assert recommend(None, 12) == 16
    assert recommend(1, 4) == 8
    assert recommend(32, None) is None
    assert [round_up8(x) for x in (1, 8, 9, 17, 256)] == [8, 8, 16, 24, 256]


def _point(
    c: int,
    tput: float,
    ttft: float,
    tpot: float,
    slo_pass: bool,
    waiting: float = 0,
    running: float = 0,
    preempt: float = 0,
    kv: float = 0.3,
) -> dict:
    return {
        "mode": "closed",
        "concurrency": c,
        "request_rate": "inf",
        "output_throughput": tput,
        "completed": 10,
        "failed": 0,
        "error_rate": 0.0,
        "p95_ttft_ms": ttft,
        "p95_tpot_ms": tpot,
        "median_tpot_ms": tpot,
        "slo_pass": slo_pass,
        "server_metrics": {
            "available": True,
            "waiting_peak": waiting,
            "running_peak": running,
            "kv_cache_usage_peak": kv,
            "preemptions_delta": preempt,
        },
    }


def test_analyze_curve_and_evidence() -> None:
    slo = SLO(ttft_p95_ms=1000, tpot_p95_ms=100)
    points = [
        _point(1, 50, 100, 20, True, running=1),
        _point(8, 350, 150, 22, True, running=8),
        _point(32, 1000, 400, 30, True, running=32),
        _point(64, 1050, 900, 31, True, waiting=32, running=32),
        _point(128, 1060, 2500, 31, False, waiting=96, running=32),
    ]
    out = analyze(points, slo)
    assert out["knee_concurrency"] == 32
    assert out["max_concurrency_meeting_slo"] == 64
    assert out["recommended_max_num_seqs"] == 32
    text = "\n".join(out["evidence"])
    assert "knee at c=32" in text
    assert "c=128 fails the SLO: p95 TTFT" in text
    assert "batch cap binds (max-num-seqs ~32)" in text and "TPOT flat (30.0 -> 31.0 ms)" in text
    assert max_passing(points) == 64
    points[-1]["client_cpu_percent"] = 95.0
    assert any(e.startswith("client CPU 95% of one core at c=128") for e in analyze(points, slo)["evidence"])
    preempting = [_point(1, 50, 100, 20, True), _point(2, 60, 100, 80, True, preempt=5, kv=0.99)]
    assert "preemptions" in "\n".join(analyze(preempting, slo)["evidence"])


def test_batch_cap_only_when_fewer_ran_than_were_sent() -> None:
    """A server with --max-num-seqs 128 at c=16: requests wait a moment between steps, yet all 16 run at
    once; the cap binds only where fewer ran than were sent (c=64 with 16 running)."""
    slo = SLO(ttft_p95_ms=1000, tpot_p95_ms=100)
    roomy = [_point(8, 300, 100, 20, True, waiting=2, running=8), _point(16, 600, 100, 21, True, waiting=5, running=16)]
    text = "\n".join(analyze(roomy, slo)["evidence"])
    assert "max-num-seqs ~" not in text and "KV-bound" not in text
    assert "c=16: up to 5 requests waited between steps, but all 16 ran at once" in text
    capped = roomy + [_point(64, 610, 900, 21, True, waiting=48, running=16)]
    text = "\n".join(analyze(capped, slo)["evidence"])
    assert "c=64: up to 48 requests waiting while at most 16 ran" in text
    assert "batch cap binds (max-num-seqs ~16)" in text
    assert "c=16: up to 5 requests waited between steps" in text  # c=16 itself still is not capped


def test_analyze_without_server_metrics_or_ladder() -> None:
    points = [_point(1, 50, 100, 20, True), _point(2, 90, 100, 20, True)]
    for p in points:
        p["server_metrics"] = {"available": False}
    out = analyze(points, SLO())
    assert out["knee_concurrency"] is None and out["recommended_max_num_seqs"] == 8
    assert any("/metrics not available" in e for e in out["evidence"])
    open_point = {**points[0], "mode": "open", "request_rate": 5.0}
    assert analyze([open_point], SLO())["recommended_max_num_seqs"] is None


# ---- arrivals and workload ------------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_arrivals_mean_and_shape(burstiness: float) -> None:
    gaps = arrival_intervals(20000, 8.0, burstiness, np.random.default_rng(1))
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    cv = gaps.std() / gaps.mean()  # gamma: CV = 1 / sqrt(shape); Poisson (shape 1) has CV 1
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_infinite_rate_sends_all_at_once() -> None:
    assert arrival_intervals(5, math.inf).tolist() == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_intervals(5, 0.0)


def test_workload_bodies(tmp_path) -> None:
    from PIL import Image

    w = Workload(
        endpoint="chat",
        model="m",
        input_len=8,
        output_len=3,
        ignore_eos=True,
        image_sizes=parse_image_sizes("32x16,20x20"),
        images_per_request=2,
    )
    spec = w.next_specs(1)[0]
    body = w.body(spec)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 3 and body["ignore_eos"] is True and body["model"] == "m"
    parts = body["messages"][-1]["content"]
    assert parts[0]["type"] == "text" and len(parts[0]["text"].split()) == 8
    urls = [p["image_url"]["url"] for p in parts[1:]]
    sizes = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).size for u in urls]
    assert sizes == [(32, 16), (20, 20)] and urls[0].startswith("data:image/jpeg;base64,")
    assert w.body(w.next_specs(1)[0])["messages"] != body["messages"]  # fresh random words and images
    with pytest.raises(ValueError):
        parse_image_sizes("32by16")

    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "hi", "max_tokens": 7}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n'
        '{"custom_id": "x", "body": {"prompt": "batch"}}\n'
    )
    specs = load_jsonl(str(path))
    comp = Workload(endpoint="completions", model="m", input_len=1, output_len=5, dataset="jsonl", dataset_specs=specs)
    bodies = [comp.body(s) for s in comp.next_specs(4)]
    assert [b["prompt"] for b in bodies] == ["hi", "yo", "batch", "hi"]
    assert [b["max_tokens"] for b in bodies] == [7, 5, 5, 7]
    assert "ignore_eos" not in bodies[0]


# ---- /metrics parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["vllm", "pagoda"])
def test_parse_prometheus_either_prefix(prefix: str) -> None:
    text = (
        f"# TYPE {prefix}:num_requests_running gauge\n"
        f'{prefix}:num_requests_running{{model_name="m",engine="0"}} 3.0\n'
        f'{prefix}:num_requests_running{{model_name="m",engine="1"}} 2.0\n'
        f'# TYPE {prefix}:num_requests_waiting gauge\n{prefix}:num_requests_waiting{{model_name="m"}} 4.0\n'
        f'# TYPE {prefix}:kv_cache_usage_perc gauge\n{prefix}:kv_cache_usage_perc{{model_name="m"}} 0.5\n'
        f'# TYPE {prefix}:num_preemptions counter\n{prefix}:num_preemptions_total{{model_name="m"}} 7.0\n'
    )
    parsed = parse_prometheus(text)
    assert parsed == {"running": 5.0, "waiting": 4.0, "kv_cache_usage": 0.5, "preemptions": 7.0, "_prefix": prefix}
    later = {**parsed, "preemptions": 9.0}
    summary = server_metrics_summary(parsed, later, [parsed, {**parsed, "waiting": 6.0}, later])
    assert summary["available"] and summary["waiting_peak"] == 6.0 and summary["preemptions_delta"] == 2.0
    assert parse_prometheus("# nothing here\nprocess_cpu_seconds_total 1.0\n") is None
    assert server_metrics_summary(None, None, []) == {"available": False}


def test_parse_reads_only_the_engine_samples_of_a_full_page() -> None:
    """Only the lines read reach the parser: the values are those the whole page gives (the prometheus
    parser over every line, the reference), and a line it would choke on elsewhere on the page is not read."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagoda.engine.core_process import Outputs
    from pagoda.outputs import EngineStats
    from pagoda.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.on_engine_outputs(Outputs([], EngineStats(3, 2, 0.25, 1, 0, 0, 40, 0.1, 1.5, 0.7), {}))
    page = metrics.render().decode()
    whole = {s.name: s.value for f in text_string_to_metric_families(page) for s in f.samples}
    parsed = parse_prometheus(page)
    assert parsed is not None and parsed["_prefix"] == "pagoda"
    assert parsed["running"] == whole["pagoda:num_requests_running"] == 3
    assert parsed["waiting"] == whole["pagoda:num_requests_waiting"] == 2
    assert parsed["engine_steps"] == whole["pagoda:engine_steps_total"] == 40
    assert parsed["engine_busy_seconds"] == whole["pagoda:engine_core_busy_seconds_total"]
    assert len(page.splitlines()) > 10 * sum(1 for k in parsed if not k.startswith("_"))
    broken = page + 'other_metric{label="unterminated 1.0\n'
    with pytest.raises(ValueError):
        list(text_string_to_metric_families(broken))
    assert parse_prometheus(broken) == parsed


def test_server_mean_ttft_from_histogram_deltas() -> None:
    """The server's mean TTFT/queue time over a point comes from the histograms' sum/count deltas,
    read from a page prometheus_client itself renders."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    registry = CollectorRegistry()
    ttft = Histogram("vllm:time_to_first_token_seconds", "t", ["model_name"], registry=registry).labels("m")
    queue = Histogram("vllm:request_queue_time_seconds", "q", ["model_name"], registry=registry).labels("m")
    ttft.observe(5.0)  # before the point: must not count
    before = parse_prometheus(generate_latest(registry).decode())
    for seconds in (0.010, 0.030):
        ttft.observe(seconds)
        queue.observe(seconds / 10)
    after = parse_prometheus(generate_latest(registry).decode())
    summary = server_metrics_summary(before, after, [])
    assert summary["server_mean_ttft_ms"] == pytest.approx(20.0)
    assert summary["server_mean_queue_ms"] == pytest.approx(2.0)
    assert server_metrics_summary(before, before, [])["server_mean_ttft_ms"] is None  # no requests: no mean


def test_server_mean_prefill_and_decode_times_from_histogram_deltas() -> None:
    """Scheduled-to-first-token and decode means over a point, from Pagoda's own histogram names."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    registry = CollectorRegistry()
    prefill = Histogram("pagoda:request_prefill_time_seconds", "p", registry=registry)
    decode = Histogram("pagoda:request_decode_time_seconds", "d", registry=registry)
    decode.observe(9.0)  # before the point: must not count
    before = parse_prometheus(generate_latest(registry).decode())
    for seconds in (0.1, 0.3):
        prefill.observe(seconds)
        decode.observe(2 * seconds)
    summary = server_metrics_summary(before, parse_prometheus(generate_latest(registry).decode()), [])
    assert summary["server_mean_prefill_ms"] == pytest.approx(200.0)
    assert summary["server_mean_decode_ms"] == pytest.approx(400.0)


def test_engine_host_and_wait_per_step_from_the_servers_own_page() -> None:
    """The engine core's totals → ServerMetrics counters → the rendered page → bench's per-step host
    work and GPU wait over a point (names on both sides must agree)."""
    from pagoda.engine.core_process import Outputs
    from pagoda.outputs import EngineStats
    from pagoda.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")

    def feed(steps: int, busy: float, wait: float, cpu: float) -> dict:
        metrics.on_engine_outputs(Outputs([], EngineStats(1, 0, 0.1, 0, 0, 0, steps, wait, busy, cpu), {}))
        return parse_prometheus(metrics.render().decode())

    before = feed(10, 1.0, 0.5, 0.3)
    after = feed(110, 1.6, 0.9, 0.45)  # 100 steps: 0.6 s busy, 0.4 s of it waiting, 0.15 s on a CPU
    summary = server_metrics_summary(before, after, [])
    assert summary["engine_steps_delta"] == 100
    assert summary["engine_host_ms_per_step"] == pytest.approx(2.0)
    assert summary["engine_wait_ms_per_step"] == pytest.approx(4.0)
    assert summary["engine_cpu_ms_per_step"] == pytest.approx(1.5)
    vllm_like = {k: v for k, v in after.items() if not k.startswith("engine_")}
    assert server_metrics_summary(vllm_like, vllm_like, [])["engine_host_ms_per_step"] is None
    assert server_metrics_summary(vllm_like, vllm_like, [])["engine_cpu_ms_per_step"] is None


def test_acceptance_length_from_the_servers_own_spec_decode_counters() -> None:
    """The engine's speculative totals → the rendered page → bench's acceptance length (vLLM's definition:
    1 + accepted / drafts) and rate over a point; a server without speculation shows neither."""
    from pagoda.engine.core_process import Outputs
    from pagoda.outputs import EngineStats
    from pagoda.server.metrics import ServerMetrics
    from pagoda.tools.bench.report import format_table

    metrics = ServerMetrics("m")

    def feed(drafts: int, drafted: int, accepted: int) -> dict:
        stats = EngineStats(1, 0, 0.1, 0, 0, 0, drafts, spec_num_drafts=drafts, spec_num_draft_tokens=drafted)
        stats.spec_num_accepted_tokens, stats.spec_accepted_per_pos = accepted, (accepted, 0, 0, 0)
        metrics.on_engine_outputs(Outputs([], stats, {}))
        return parse_prometheus(metrics.render().decode())

    before = feed(5, 20, 4)
    after = feed(45, 180, 124)  # 40 rows, 160 proposals, 120 accepted
    summary = server_metrics_summary(before, after, [])
    assert summary["spec_acceptance_length"] == pytest.approx(4.0)
    assert summary["spec_acceptance_rate"] == pytest.approx(0.75)
    assert "accept len" in format_table([{"concurrency": 1, "server_metrics": summary}])
    plain = server_metrics_summary(feed(45, 180, 124), feed(45, 180, 124), [])
    assert plain["spec_acceptance_length"] is None and plain["spec_acceptance_rate"] is None


# ---- the SSE client on a mock transport -----------------------------------------------------------------


def _sse(events: list, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events]
    if done:
        lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


def _chunk(text: str | None, role: bool = False) -> dict:
    delta = {"role": "assistant", "content": ""} if role else {"content": text}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}}


def _run(status: int, body: bytes) -> RequestResult:
    async def go() -> RequestResult:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_request(client, "http://x/v1/chat/completions", {"stream": True}, {}, chat=True)

    return asyncio.run(go())


def test_stream_request_success_uses_usage() -> None:
    r = _run(200, _sse([_chunk(None, role=True), _chunk("He"), _chunk("llo"), _chunk(" world"), USAGE]))
    assert r.success and r.error is None
    assert r.ttft is not None and r.ttft <= r.e2el
    assert r.chunks == 3 and len(r.itl) == 2  # role-only chunk is not content
    assert (r.prompt_tokens, r.completion_tokens) == (11, 3)


def test_stream_request_failures() -> None:
    # No text at all, but the server says it generated 3 tokens and the stream ended: a success.
    no_text = _run(200, _sse([_chunk(None, role=True), USAGE]))
    assert no_text.success and no_text.completion_tokens == 3 and no_text.chunks == 0
    zero = _run(200, _sse([_chunk(None, role=True), {"choices": [], "usage": {"completion_tokens": 0}}]))
    assert not zero.success and "no token" in zero.error
    http = _run(404, b'{"error": {"message": "The model `x` does not exist."}}')
    assert not http.success and http.status == 404 and "does not exist" in http.error
    cut = _run(200, _sse([_chunk("a"), _chunk("b")], done=False))
    assert not cut.success and "[DONE]" in cut.error and "finish_reason" in cut.error
    err = _run(200, _sse([_chunk("a"), {"error": {"message": "engine died", "code": 500}}]))
    assert not err.success and "engine died" in err.error
    no_usage = _run(200, _sse([_chunk("a"), _chunk("b")]))
    assert no_usage.success and not no_usage.usage_reported and no_usage.completion_tokens == 2


def test_stream_request_total_timeout() -> None:
    async def slow_body():
        yield _sse([_chunk("a")], done=False)
        await asyncio.sleep(5)
        yield b"data: [DONE]\n\n"

    async def go() -> RequestResult:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=slow_body()))
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_request(client, "http://x/v1/chat/completions", {}, {}, chat=True, timeout=0.2)

    r = asyncio.run(go())
    assert not r.success and "timeout" in r.error and "after 1 token chunks" in r.error
    assert r.end - r.start < 2


def test_gpu_utilization_column_only_when_the_server_shows_it() -> None:
    """Two GPUs at 90 % and 50 % on the server's page → bench's mean 70 % in a "GPU util" column; a page
    without the gauge (the CPU, vLLM) has no such column."""
    from prometheus_client.core import GaugeMetricFamily

    from pagoda.server.metrics import ServerMetrics
    from pagoda.tools.bench.report import format_table

    class TwoGpus:
        def collect(self):
            family = GaugeMetricFamily("pagoda:gpu_utilization_perc", "g", labels=["gpu", "tp_rank"])
            family.add_metric(["0", "0"], 0.9)
            family.add_metric(["1", "1"], 0.5)
            yield family

    with_gpus = parse_prometheus(ServerMetrics("m", collectors=(TwoGpus(),)).render().decode())
    assert with_gpus is not None and with_gpus["gpu_utilization"] == pytest.approx(0.7)
    cpu_only = parse_prometheus(ServerMetrics("m").render().decode())
    assert cpu_only is not None and "gpu_utilization" not in cpu_only
    point = {"mode": "closed", "concurrency": 4, "completed": 1, "failed": 0}
    table = format_table([{**point, "server_metrics": server_metrics_summary(with_gpus, with_gpus, [with_gpus])}])
    header, _, row = table.splitlines()
    assert "GPU util" in header and "70%" in row
    table = format_table([{**point, "server_metrics": server_metrics_summary(cpu_only, cpu_only, [cpu_only])}])
    assert "GPU" not in table.splitlines()[0].replace("GPU wait", "")
