"""/metrics over real traffic, request lifecycle (client disconnects, SIGTERM drain) and HTTP
responsiveness while the engine is busy."""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import time

import httpx
import pytest
from e2e_helpers import API_KEY, CAPITAL_QUESTION, MODEL, engine_is_idle, metric, scrape, sse_json, wait_until
from prometheus_client.parser import text_string_to_metric_families

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def gauges(http: httpx.Client, server) -> str:
    """What a failed wait prints: the engine's gauges and the server log's tail, not the whole exposition."""
    samples = scrape(http)
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "generation_tokens_total")
    values = {name: metric(samples, f"pagoda:{name}") for name in names}
    return f"{values}\n--- server log ---\n{server.log_tail(3000)}"


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def test_metrics_exposition_has_the_pagoda_families(anon: httpx.Client) -> None:
    assert anon.get("/v1/models").status_code in (200, 401)  # an HTTP request to count
    names = set(name for name, _ in scrape(anon))
    for family in [
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
        "request_time_per_output_token_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
        "engine_steps_total",
        "engine_core_busy_seconds_total",
        "engine_core_device_wait_seconds_total",
        "engine_core_cpu_seconds_total",
        # vLLM 0.26's, beyond the first ones
        "request_prefill_time_seconds_bucket",
        "request_decode_time_seconds_count",
        "request_inference_time_seconds_sum",
        "request_prompt_tokens_bucket",
        "request_generation_tokens_count",
        "request_params_n_count",
        "request_params_max_tokens_count",
        "iteration_tokens_total_bucket",
        "prompt_tokens_cached_total",
        "num_requests_waiting_by_reason",
        "mm_cache_queries_total",
        "mm_cache_hits_total",
    ]:
        assert f"pagoda:{family}" in names, family
        assert f"vllm:{family}" in names, family
    # The standard ones, unprefixed: prometheus_client's process collector and the HTTP middleware.
    for family in ["process_cpu_seconds_total", "process_resident_memory_bytes", "http_requests_total"]:
        assert family in names, family
    # vLLM's labels and bucket boundaries, read from the page as a vLLM dashboard reads it.
    text = anon.get("/metrics").text
    running = next(
        s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "vllm:num_requests_running"
    )
    assert running.labels == {"model_name": MODEL, "engine": "0"}
    les = {name: sorted(float(dict(labels)["le"]) for n, labels in scrape(anon) if n == name) for name in (
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket"
    )}  # fmt: skip
    assert les["vllm:time_to_first_token_seconds_bucket"][-3:] == [640.0, 2560.0, float("inf")]
    assert les["vllm:inter_token_latency_seconds_bucket"][:2] == [0.01, 0.025]
    assert les["vllm:inter_token_latency_seconds_bucket"][-2:] == [80.0, float("inf")]


def test_counters_move_after_requests(http: httpx.Client) -> None:
    assert wait_until(lambda: engine_is_idle(http)), "engine busy before the test"
    tokenized = http.post("/tokenize", json={"model": MODEL, "prompt": "Counting tokens: one two three"})
    prompt_ids = tokenized.json()["tokens"]
    before = scrape(http)
    length = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt_ids, "max_tokens": 5, "ignore_eos": True, "temperature": 0},
    ).json()
    assert length["choices"][0]["finish_reason"] == "length"
    stop = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": CAPITAL_QUESTION, "max_tokens": 30, "temperature": 0}
    ).json()
    assert stop["choices"][0]["finish_reason"] == "stop"
    after = scrape(http)

    prompt_tokens = length["usage"]["prompt_tokens"] + stop["usage"]["prompt_tokens"]
    generated = length["usage"]["completion_tokens"] + stop["usage"]["completion_tokens"]
    assert delta(before, after, "pagoda:prompt_tokens_total") == prompt_tokens
    assert delta(before, after, "pagoda:generation_tokens_total") == generated
    assert delta(before, after, "pagoda:request_success_total", finished_reason="length") == 1
    assert delta(before, after, "pagoda:request_success_total", finished_reason="stop") == 1
    assert delta(before, after, "pagoda:request_success_total", finished_reason="abort") == 0
    for histogram in ["time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"]:
        assert delta(before, after, f"pagoda:{histogram}_count") == 2, histogram
        assert delta(before, after, f"pagoda:{histogram}_sum") > 0 or histogram == "request_queue_time_seconds"
    # vLLM's per-request phases and sizes: one observation per request, and phases that add up.
    for histogram in ["prefill_time_seconds", "decode_time_seconds", "inference_time_seconds", "params_n"]:
        assert delta(before, after, f"pagoda:request_{histogram}_count") == 2, histogram
    inference = delta(before, after, "pagoda:request_inference_time_seconds_sum")
    phases = delta(before, after, "pagoda:request_prefill_time_seconds_sum") + delta(
        before, after, "pagoda:request_decode_time_seconds_sum"
    )
    assert 0 < inference <= delta(before, after, "pagoda:e2e_request_latency_seconds_sum")
    assert abs(inference - phases) < 1e-6
    assert delta(before, after, "pagoda:request_prompt_tokens_sum") == prompt_tokens
    assert delta(before, after, "pagoda:request_generation_tokens_sum") == generated
    assert delta(before, after, "pagoda:request_params_max_tokens_sum") == 5 + 30
    # Steps schedule the prompts less their prefix-cache hits, then one token per later output token (more
    # with async scheduling, which may schedule a step past a stop).
    computed = prompt_tokens - delta(before, after, "pagoda:prefix_cache_hits_total") + generated - 2
    assert delta(before, after, "pagoda:iteration_tokens_total_sum") >= computed
    # The HTTP middleware: each route by its template and status class (the /tokenize call came before).
    for route in ["/v1/completions", "/v1/chat/completions"]:
        labels = {"handler": route, "method": "POST", "status": "2xx"}
        assert delta(before, after, "http_requests_total", **labels) == 1, route
    # One inter-token gap per token after the first, per request (one token per step here).
    assert delta(before, after, "pagoda:inter_token_latency_seconds_count") == generated - 2
    # One time-per-output-token per request with more than one token (both here): its sum is the two
    # requests' first-to-last spans over their later tokens, at most their whole latencies.
    assert delta(before, after, "pagoda:request_time_per_output_token_seconds_count") == 2
    tpot_sum = delta(before, after, "pagoda:request_time_per_output_token_seconds_sum")
    assert 0 < tpot_sum <= delta(before, after, "pagoda:e2e_request_latency_seconds_sum")
    ttft_buckets = [v for (name, labels), v in after.items() if name == "pagoda:time_to_first_token_seconds_bucket"]
    assert ttft_buckets and max(ttft_buckets) == metric(after, "pagoda:time_to_first_token_seconds_count")
    assert delta(before, after, "pagoda:prefix_cache_queries_total") >= len(prompt_ids)
    # The core's own clock: one request at a time, so at least one step per generated token; the
    # GPU-wait part (here the CPU forward's result) is within the busy time.
    assert delta(before, after, "pagoda:engine_steps_total") >= generated
    busy = delta(before, after, "pagoda:engine_core_busy_seconds_total")
    assert 0 < busy and 0 <= delta(before, after, "pagoda:engine_core_device_wait_seconds_total") <= busy
    # One thread's CPU time over the same passes cannot exceed their wall time, give or take how the two clocks
    # are read one after the other at each pass's start and end (a run saw 6.6 µs more CPU than wall over 0.37 s).
    assert 0 < delta(before, after, "pagoda:engine_core_cpu_seconds_total") <= busy + 1e-3


def test_prefix_cache_hits_on_a_repeated_prompt(http: httpx.Client) -> None:
    prompt = "Shared prefix for the cache test. " * 8  # several full 16-token blocks
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    http.post("/v1/completions", json=body).raise_for_status()
    before = scrape(http)
    http.post("/v1/completions", json=body).raise_for_status()
    after = scrape(http)
    assert delta(before, after, "pagoda:prefix_cache_hits_total") >= 32


def test_client_disconnect_mid_stream_aborts_and_frees_kv(server, http: httpx.Client) -> None:
    assert wait_until(lambda: engine_is_idle(http)), "engine busy before the test"
    before = scrape(http)
    body = {
        "model": MODEL,
        "prompt": "Tell me a very long story.",
        "max_tokens": 500,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        # Hold the line iterator: a generator dropped by `break` is closed at once, and closing it closes the
        # connection, so the request would be aborted before the gauges below could see it run.
        lines = response.iter_lines()
        events = 0
        for line in lines:
            if line.startswith("data:"):
                events += 1
                if events == 2:
                    break

        # The gauges follow the core's stats, which may reach /metrics just after the tokens reached us
        # (and the running count can move in a report before the KV usage does): read both from one scrape.
        def running_with_kv(samples: dict) -> bool:
            return (
                metric(samples, "pagoda:num_requests_running") >= 1
                and metric(samples, "pagoda:kv_cache_usage_perc") > 0
            )

        # A busy CI machine can starve the server for seconds: the bound is generous, the check is not.
        assert wait_until(lambda: running_with_kv(scrape(http)), timeout=20), gauges(http, server)
    # Closing the response drops the connection: the server must abort the request promptly.
    assert wait_until(lambda: engine_is_idle(http), timeout=10), gauges(http, server)
    after = scrape(http)
    assert delta(before, after, "pagoda:request_success_total", finished_reason="abort") == 1
    assert delta(before, after, "pagoda:request_success_total", finished_reason="length") == 0
    assert delta(before, after, "pagoda:generation_tokens_total") < 500


def test_client_timeout_on_a_non_streaming_request_aborts_it(server, base_url: str, http: httpx.Client) -> None:
    assert wait_until(lambda: engine_is_idle(http)), "engine busy before the test"
    before = scrape(http)
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json=body, headers=AUTH, timeout=1.5)
    assert wait_until(lambda: engine_is_idle(http), timeout=5), scrape(http)
    after = scrape(http)
    assert delta(before, after, "pagoda:request_success_total", finished_reason="abort") == 1
    assert "Exception in ASGI application" not in server.log_path.read_text(errors="replace")


def test_health_stays_fast_while_streams_generate(base_url: str, http: httpx.Client) -> None:
    """The HTTP side answers quickly while 8 streams keep the engine busy (engine in its own process)."""
    streams, max_tokens = 8, 128  # long enough for 20 probes on a fast machine

    async def stream_one(client: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": MODEL,
            "prompt": f"Story number {i}:",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        }
        chunks = 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    chunks += 1
        return chunks

    async def main() -> tuple[list[int], list[float]]:
        latencies: list[float] = []
        limits = httpx.Limits(max_connections=streams + 2)
        async with (
            httpx.AsyncClient(base_url=base_url, headers=AUTH, timeout=120, limits=limits) as client,
            httpx.AsyncClient(base_url=base_url, timeout=10) as probe,
        ):
            tasks = [asyncio.create_task(stream_one(client, i)) for i in range(streams)]
            await asyncio.sleep(0.3)  # let the streams start
            while not all(t.done() for t in tasks):
                start = time.perf_counter()
                assert (await probe.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - start)
                await asyncio.sleep(0.05)
            return await asyncio.gather(*tasks), latencies

    chunks, latencies = asyncio.run(main())
    assert all(c == max_tokens for c in chunks), chunks
    assert len(latencies) >= 20, f"only {len(latencies)} probes: streams finished too quickly"
    p50, p99 = statistics.median(latencies), quantile(latencies, 0.99)
    assert p99 < 0.5, f"/health p50={p50 * 1000:.1f} ms p99={p99 * 1000:.1f} ms over {len(latencies)} probes"


def test_sigterm_drains_an_in_flight_stream_and_exits_0(launch_server) -> None:
    server = launch_server("--shutdown-timeout", "30")
    engine_pid = server.engine_pid()
    body = {
        "model": MODEL,
        "prompt": "Count slowly:",
        "max_tokens": 40,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    payloads = []
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data:"):
                    payloads.append(line[5:].strip())
                    if len(payloads) == 2:
                        break
            server.proc.send_signal(signal.SIGTERM)
            refused_new = None
            for line in lines:
                if line.startswith("data:"):
                    payloads.append(line[5:].strip())
                    if refused_new is not True and len(payloads) >= 5:
                        # While draining, the server takes no new connections. The signal takes effect a
                        # moment after it is sent (an idle machine streams several tokens first): probe
                        # on every later token until one is refused.
                        try:
                            httpx.get(f"{server.url}/health", timeout=2)
                            refused_new = False
                        except httpx.TransportError:
                            refused_new = True
    events = sse_json(payloads)
    assert events[-1]["usage"]["completion_tokens"] == 40
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert "error" not in json.dumps(events)
    assert server.proc.wait(60) == 0, server.log_tail()
    assert refused_new in (True, None), "a new connection was served after SIGTERM"
    assert wait_until(lambda: not _alive(engine_pid), timeout=10), "the engine process outlived the server"


def _alive(pid: int) -> bool:
    try:
        import psutil

        return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except ImportError:
        import os

        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
    except Exception:  # noqa: BLE001 - it vanished between the two calls
        return False
