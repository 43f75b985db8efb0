"""One single-process server under pressure: `/metrics` under both prefixes, `--max-waiting-requests`
against a burst of simultaneous requests, and streams cut by `--shutdown-timeout` (their last events:
an error naming the shutdown, then [DONE]). One server for all of them (a start costs ~20 s); the
shutdown test stops it, so it comes last.

The kill race (requests fired just after the engine core dies, each answered 503 within a second) is
`kill_race.py`, run by the tests that already kill a core: test_http_errors.py (one API process) and
test_api_server_count.py (two).
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest
from e2e_helpers import API_KEY, MODEL, metric, scrape
from e2e_server import ServerProcess, running_server
from prometheus_client.parser import text_string_to_metric_families

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CAP, SEQS = 8, 256


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory):
    flags = ["--max-waiting-requests", str(CAP), "--max-num-seqs", str(SEQS), "--shutdown-timeout", "1"]
    flags += ["--cpu-kv-cache-space-gib", "1"]  # every seat's request fits: none waits for KV blocks
    with running_server(tmp_path_factory.mktemp("capped") / "serve.log", flags) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(capped: ServerProcess):
    with httpx.Client(base_url=capped.url, headers=AUTH, timeout=60) as c:
        yield c


def wait_idle(client: httpx.Client, timeout: float = 30.0, settled: bool = False) -> None:
    """Until the gauges read idle. `settled`: idle twice, 1.2 s apart, so that requests sent during a long
    engine step (the core reports only between steps) show in the waiting gauge by the second look."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(client)
        if metric(samples, "vllm:num_requests_running") == metric(samples, "vllm:num_requests_waiting") == 0:
            if not settled:
                return
            time.sleep(1.2)
            settled = False
            continue
        assert time.monotonic() < deadline, samples
        time.sleep(0.1)


def test_metrics_show_every_metric_under_vllm_and_pagoda_names(client: httpx.Client) -> None:
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3}).status_code == 200
    text = client.get("/metrics").text
    found = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    own = {(n[len("pagoda:") :], labels): v for (n, labels), v in found.items() if n.startswith("pagoda:")}
    theirs = {(n[len("vllm:") :], labels): v for (n, labels), v in found.items() if n.startswith("vllm:")}
    standard = [key for key in found if key[0].startswith(("http_", "process_"))]
    assert own == theirs and len(own) + len(theirs) + len(standard) == len(found)
    names = {name for name, _ in theirs}
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_sum",
        "engine_steps_total",
    ):
        assert name in names, name
    assert theirs[("generation_tokens_total", (("engine", "0"), ("model_name", MODEL)))] >= 3


async def _burst(port: int, count: int) -> tuple[list, list[tuple[int, str]]]:
    """`count` connections, then one streamed request on each written at once; (connections, (status,
    headers) of each). The admitted streams stay open until the caller closes them."""
    # One prompt token: the whole burst is one cheap prefill; none finishes while the burst is answered.
    body = json.dumps({"model": MODEL, "prompt": [100], "max_tokens": 50, "ignore_eos": True, "stream": True}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    conns = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in range(count)))
    for _, writer in conns:
        writer.write(request)

    async def head(reader: asyncio.StreamReader) -> tuple[int, str]:
        raw = await reader.readuntil(b"\r\n\r\n")
        return int(raw.split(b" ", 2)[1]), raw.decode(errors="replace").lower()

    heads = await asyncio.wait_for(asyncio.gather(*(head(reader) for reader, _ in conns)), 60)
    return conns, heads


@pytest.mark.parametrize("burst", [100, 400])
def test_a_burst_fills_the_free_seats_and_then_max_waiting_requests(
    capped: ServerProcess, client: httpx.Client, burst: int
) -> None:
    """Streams at once against --max-waiting-requests 8 on an idle server with 256 seats (--max-num-seqs):
    those that take a seat run at once, so are not waiting; 100 are all admitted, of 400 about 256 + 8
    (none finishes during the burst), the rest get 503 + Retry-After, and waiting never exceeds 8."""
    wait_idle(client)
    peaks: list[float] = []
    sampling = threading.Event()

    def sample() -> None:
        with httpx.Client(base_url=capped.url, timeout=30) as probe:
            while not sampling.is_set():
                peaks.append(metric(scrape(probe), "vllm:num_requests_waiting"))
                time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    async def main() -> list[tuple[int, str]]:
        conns, heads = await _burst(capped.port, burst)
        await asyncio.sleep(0.5)  # the core reports the admitted ones
        settled = scrape(client)
        peaks.append(metric(settled, "vllm:num_requests_waiting"))
        for _, writer in conns:  # the admitted streams are aborted
            writer.close()
        return heads

    try:
        heads = asyncio.run(main())
    finally:
        sampling.set()
        sampler.join(30)
    admitted = sum(status == 200 for status, _ in heads)
    refused = [h for status, h in heads if status == 503]
    assert admitted + len(refused) == burst, sorted({status for status, _ in heads})
    if burst <= SEQS + CAP:
        assert admitted == burst, (admitted, len(refused))
    else:
        assert SEQS + CAP <= admitted <= SEQS + CAP + 2, (admitted, len(refused))
    assert all("retry-after:" in h for h in refused)
    assert max(peaks) <= CAP + 1, peaks  # + 1: a preempted request goes back to waiting
    wait_idle(client, settled=True)


def test_a_stream_cut_by_shutdown_timeout_ends_with_an_error_event_and_done(
    capped: ServerProcess, client: httpx.Client
) -> None:
    """SIGTERM with --shutdown-timeout 1: a stream still generating then gets an error event naming the
    shutdown and [DONE]; a non-streamed request a 503 with Retry-After; the server exits 0."""
    wait_idle(client)
    long = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 1500, "ignore_eos": True}
    plain: dict = {}

    def non_streamed() -> None:
        with httpx.Client(base_url=capped.url, headers=AUTH, timeout=60) as other:
            response = other.post("/v1/completions", json=long)
            plain.update(status=response.status_code, body=response.json(), retry=response.headers.get("Retry-After"))

    payloads: list[str] = []
    with httpx.Client(base_url=capped.url, headers=AUTH, timeout=60) as streamer:
        with streamer.stream("POST", "/v1/completions", json={**long, "stream": True}) as response:
            assert response.status_code == 200, response.read()
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data:"):
                    payloads.append(line[5:].strip())
                    if len(payloads) == 2:
                        break
            worker = threading.Thread(target=non_streamed, daemon=True)
            worker.start()
            deadline = time.monotonic() + 15
            while metric(scrape(client), "vllm:num_requests_running") < 2:
                assert time.monotonic() < deadline, "the non-streamed request never started"
                time.sleep(0.05)
            capped.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            for line in lines:
                if line.startswith("data:"):
                    payloads.append(line[5:].strip())
            cut_after = time.monotonic() - signalled
    worker.join(30)
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1, payloads[-3:]
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError", error
    assert "shutting down" in error["message"] and "--shutdown-timeout" in error["message"], error
    assert all("choices" in json.loads(p) for p in payloads[:-2])  # tokens until the cut
    assert 0.8 < cut_after < 5, cut_after
    assert plain["status"] == 503 and plain["retry"], plain
    assert "shutting down" in plain["body"]["error"]["message"], plain
    assert capped.proc.wait(30) == 0, capped.log_tail()
