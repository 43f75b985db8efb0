"""`pagoda router` in front of three real `pagoda serve` backends (the default model) on 127.0.0.1.

Backend A is the session's shared server; B and C start here, in parallel with it (C also serves the id
"smol-c"). The router runs as a subprocess (`python -m pagoda router --config router.toml`) with two API
keys, fast health probes and the backends' key. Checked: merged /v1/models and model-aware routing, 401s,
session affinity shown by the backend's own prefix-cache counter, spread of sessions, byte-level stream
passthrough with incremental arrival, usage per key, client disconnect aborting the backend's request, and
stopping/restarting a backend (retry before the first byte, rebalancing, readmission by the probes).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))

from e2e_helpers import API_KEY, MODEL, sse_json  # noqa: E402
from e2e_server import BASE_FLAGS, ServerProcess, free_port  # noqa: E402

ALICE, BOB = "alice-key", "bob-key"
LONG_SYSTEM = ("You are a meticulous assistant for a museum of East Asian architecture. " * 40).strip()


class FixedPortServer(ServerProcess):
    """A `pagoda serve` on a chosen port, so that it can be restarted at the same URL."""

    def __init__(self, log_path: Path, extra_flags: list[str], port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed by stop(), like the parent's
        cmd = [sys.executable, "-m", "pagoda", "serve", *BASE_FLAGS, "--port", str(port), *extra_flags]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


class Cluster:
    def __init__(self, a: ServerProcess, b: FixedPortServer, c: FixedPortServer, router_url: str, tmp: Path):
        self.a, self.b, self.c = a, b, c
        self.backends = {a.url: a, b.url: b, c.url: c}
        self.router_url = router_url
        self.tmp = tmp

    def client(self, key: str = ALICE) -> httpx.Client:
        return httpx.Client(base_url=self.router_url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def router_health(url: str) -> dict[str, bool]:
    return {b["name"]: b["healthy"] for b in httpx.get(url + "/health", timeout=5).json()["backends"]}


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("router")
    b = FixedPortServer(tmp / "b.log", [], free_port())
    c = FixedPortServer(tmp / "c.log", ["--served-model-name", MODEL, "smol-c"], free_port())
    router_proc = None
    cl: Cluster | None = None
    try:
        a = request.getfixturevalue("server")  # the shared server starts while B and C load
        b.wait_healthy()
        c.wait_healthy()
        port = free_port()
        config = tmp / "router.toml"
        config.write_text(f"""
policy = "session"
backend_api_key = "{API_KEY}"
backends = ["{a.url}", "{b.url}", "{c.url}"]
[api_keys]
alice = "{ALICE}"
bob = "{BOB}"
[health]
interval = 0.5
timeout = 1.0
fail_threshold = 4
pass_threshold = 2
[breaker]
failures = 2
open_seconds = 60
""")
        started = time.monotonic()
        with open(tmp / "router.log", "wb") as log:
            router_proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pagoda",
                    "router",
                    "--config",
                    str(config),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 30, "the router's /health")
        startup = time.monotonic() - started
        print(f"router answered /health {startup:.2f} s after launch")
        assert startup < 10, (tmp / "router.log").read_text()
        wait_for(lambda: all(router_health(url).values()), 10, "all backends healthy at the router")
        cl = Cluster(a, b, c, url, tmp)
        yield cl
    finally:
        if router_proc is not None:
            router_proc.send_signal(signal.SIGTERM)
            try:
                router_proc.wait(15)
            except subprocess.TimeoutExpired:
                router_proc.kill()
        b.stop()
        c.stop()
        if cl is not None and cl.b is not b:
            cl.b.stop()  # B as restarted by the test


def chat(system: str | None, user: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


def test_models_health_and_keys(cluster: Cluster) -> None:
    with cluster.client() as client:
        r = client.get("/v1/models")
        assert r.status_code == 200
        assert sorted(m["id"] for m in r.json()["data"]) == ["smol", "smol-c"]
        # "smol-c" is served by C only: whatever the session, C gets it
        for i in range(3):
            r = client.post(
                "/v1/chat/completions",
                json={**chat(None, "Hi"), "model": "smol-c", "max_tokens": 1},
                headers={"X-Session-ID": f"model-{i}"},
            )
            assert r.status_code == 200 and r.headers["x-pagoda-backend"] == cluster.c.url
    for headers in ({}, {"Authorization": "Bearer not-a-key"}, {"Authorization": f"Bearer {API_KEY}"}):
        r = httpx.post(cluster.router_url + "/v1/chat/completions", json=chat(None, "Hi"), headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(cluster.router_url + "/v1/models").status_code == 401
    assert httpx.get(cluster.router_url + "/metrics").status_code == 200


def test_session_affinity_shows_in_the_backends_prefix_cache(cluster: Cluster) -> None:
    # A (the suite's shared server) also serves other modules' tests at the same time: their prompts churn its
    # small KV cache and move its counters. The session is one the ring places on B or C, which only this module
    # uses, and its counters are the ones compared.
    ours = [cluster.b.url, cluster.c.url]
    with cluster.client() as client:
        session = next(
            key
            for key in (f"affinity-session-{i}" for i in range(64))
            if client.post(
                "/v1/chat/completions", json=chat(None, "Hi", max_tokens=1), headers={"X-Session-ID": key}
            ).headers["x-pagoda-backend"]
            in ours
        )
        served, hits = [], []
        for turn in range(3):
            before = {u: metric(u, "pagoda:prefix_cache_hits_total") for u in ours}
            r = client.post(
                "/v1/chat/completions",
                json=chat(LONG_SYSTEM, f"Question {turn}: what is a bracket?"),
                headers={"X-Session-ID": session},
            )
            assert r.status_code == 200, r.text
            served.append(r.headers["x-pagoda-backend"])
            after = {u: metric(u, "pagoda:prefix_cache_hits_total") for u in ours}
            hits.append({u: after[u] - before[u] for u in ours})
        assert len(set(served)) == 1, served
        owner = served[0]
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        for h in hits[1:]:  # the long system prompt is found in the owner's cache; the other never saw it
            assert h[owner] >= prompt_tokens * 0.8, (h, prompt_tokens)
            assert all(v == 0 for u, v in h.items() if u != owner), h
        text = client.get("/metrics").text
        assert f'pagoda_router:affinity_total{{backend="{owner}",result="hit"}}' in text
        assert 'pagoda_router:session_key_total{source="header"}' in text


def test_sessions_spread_and_stick(cluster: Cluster) -> None:
    with cluster.client() as client:
        placement = {}
        # Backends are named by URL with a random port, so the ring differs per run: with 12 sessions
        # one backend is left out ~2 % of the time; keep adding sessions (up to 60, a miss is then
        # ~1e-10) until every backend has some.
        for i in range(60):
            r = client.post(
                "/v1/chat/completions", json=chat(None, "Hi", max_tokens=1), headers={"X-Session-ID": f"spread-{i}"}
            )
            assert r.status_code == 200
            placement[i] = r.headers["x-pagoda-backend"]
            if i >= 11 and set(placement.values()) == set(cluster.backends):
                break
        assert set(placement.values()) == set(cluster.backends), placement
        for i in (0, 5, 11):  # again: the same backend
            r = client.post(
                "/v1/chat/completions", json=chat(None, "Hello", max_tokens=1), headers={"X-Session-ID": f"spread-{i}"}
            )
            assert r.headers["x-pagoda-backend"] == placement[i]
        # no header, no user: the conversation fingerprint keeps a conversation on one backend
        first = client.post("/v1/chat/completions", json=chat("Be brief.", "Name a pagoda.", max_tokens=1))
        later = client.post(
            "/v1/chat/completions",
            json={
                **chat("Be brief.", "Name a pagoda.", max_tokens=1),
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Name a pagoda."},
                    {"role": "assistant", "content": "Horyu-ji"},
                    {"role": "user", "content": "Another?"},
                ],
            },
        )
        assert first.headers["x-pagoda-backend"] == later.headers["x-pagoda-backend"]


def _normalize(raw: bytes) -> bytes:
    raw = re.sub(rb'"id":"[^"]*"', b'"id":"X"', raw)
    return re.sub(rb'"created":\d+', b'"created":0', raw)


def _timed_stream(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[bytes, list[tuple[float, bytes]]]:
    started = time.perf_counter()
    arrivals = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        backend = r.headers.get("x-pagoda-backend", "")
        assert r.headers["x-accel-buffering"] == "no"
        for chunk in r.iter_raw():
            arrivals.append((time.perf_counter() - started, chunk))
    return backend.encode(), arrivals


def test_stream_passthrough_is_byte_identical_and_incremental(cluster: Cluster) -> None:
    body = chat(None, "Count from one to thirty, separated by commas.", max_tokens=32, stream=True, ignore_eos=True)
    backend, through = _timed_stream(
        cluster.router_url, body, {"Authorization": f"Bearer {ALICE}", "X-Session-ID": "stream-1"}
    )
    _, direct = _timed_stream(backend.decode(), body, {"Authorization": f"Bearer {API_KEY}"})
    raw_through = b"".join(c for _, c in through)
    raw_direct = b"".join(c for _, c in direct)
    assert _normalize(raw_through) == _normalize(raw_direct)  # same events, same framing, no usage chunk added
    events = sse_json([e[len(b"data: ") :].decode() for e in raw_through.split(b"\n\n") if e])
    assert all(e["usage"] is None for e in events)
    # chunks arrive as they are generated: many separate arrivals, the first long before the last
    times = [t for t, _ in through]
    assert len(through) >= 10, len(through)
    assert times[0] < 0.5 * times[-1], times
    # asked for usage: the client gets the usage chunk, byte for byte as the backend sent it
    _, with_usage = _timed_stream(
        cluster.router_url,
        {**body, "stream_options": {"include_usage": True}},
        {"Authorization": f"Bearer {ALICE}", "X-Session-ID": "stream-1"},
    )
    last = sse_json([e[len(b"data: ") :].decode() for e in b"".join(c for _, c in with_usage).split(b"\n\n") if e])[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 32


def test_usage_per_key(cluster: Cluster) -> None:
    before = httpx.get(cluster.router_url + "/usage", headers={"Authorization": f"Bearer {ALICE}"}).json()["keys"]
    expected = {"alice": [0, 0, 0], "bob": [0, 0, 0]}

    def add(label: str, usage: dict[str, int], times: int = 1) -> None:
        row = expected[label]
        row[0] += times
        row[1] += usage["prompt_tokens"] * times
        row[2] += usage["completion_tokens"] * times

    for label, key in (("alice", ALICE), ("bob", BOB)):
        with cluster.client(key) as client:
            for i in range(2):
                r = client.post("/v1/chat/completions", json=chat(None, f"Say {label} {i}.", max_tokens=3 + i))
                add(label, r.json()["usage"])
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": f"{label} went", "max_tokens": 5})
            add(label, r.json()["usage"])
            body = chat(
                None, f"Tell {label} a fact.", max_tokens=6, stream=True, stream_options={"include_usage": True}
            )
            with client.stream("POST", "/v1/chat/completions", json=body) as s:
                events = sse_json([line[6:] for line in s.iter_lines() if line.startswith("data: ")])
            usage = events[-1]["usage"]
            # the same greedy request without include_usage: the client sees no usage, the router still counts it
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream_options": None}) as s:
                assert all(
                    json.loads(line[6:]).get("usage") is None for line in s.iter_lines() if line.startswith("data: {")
                )
            add(label, usage, times=2)
    after = httpx.get(cluster.router_url + "/usage", headers={"Authorization": f"Bearer {BOB}"}).json()["keys"]
    for label, (requests, prompt, completion) in expected.items():
        old = before.get(label, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0})
        got = after[label]
        assert (
            got["requests"] - old["requests"],
            got["prompt_tokens"] - old["prompt_tokens"],
            got["completion_tokens"] - old["completion_tokens"],
        ) == (requests, prompt, completion), (label, got)
        assert got["requests_without_usage"] == 0
    text = httpx.get(cluster.router_url + "/metrics").text
    assert 'pagoda_router:completion_tokens_total{key="bob"}' in text
    assert ALICE not in text and BOB not in text  # labels, never the keys


def test_client_disconnect_aborts_the_backend_request(cluster: Cluster) -> None:
    body = chat(None, "Write a very long story about a wooden pagoda.", max_tokens=400, stream=True, ignore_eos=True)
    headers = {"Authorization": f"Bearer {ALICE}", "X-Session-ID": "disconnect-1"}
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", cluster.router_url + "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        backend = r.headers["x-pagoda-backend"]
        aborts = metric(backend, "pagoda:request_success_total", finished_reason="abort")
        chunks = r.iter_raw()
        for _ in range(3):
            next(chunks)
    wait_for(
        lambda: metric(backend, "pagoda:request_success_total", finished_reason="abort") > aborts,
        10,
        "the backend to abort the request",
    )
    wait_for(lambda: metric(backend, "pagoda:num_requests_running") == 0, 10, "the backend to be idle")
    assert metric(cluster.router_url, "pagoda_router:client_disconnects_total", backend=backend) >= 1


def _refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_stop_and_restart_a_backend(cluster: Cluster) -> None:
    b = cluster.b
    with cluster.client() as client:

        def place(session: str) -> str:
            r = client.post(
                "/v1/chat/completions", json=chat(None, "Hi", max_tokens=1), headers={"X-Session-ID": session}
            )
            assert r.status_code == 200, r.text
            return r.headers["x-pagoda-backend"]

        on_b = [s for s in (f"rebalance-{i}" for i in range(40)) if place(s) == b.url][:3]
        assert len(on_b) == 3
        retries = metric(cluster.router_url, "pagoda_router:retries_total", backend=b.url)

        # stop B; as soon as its port refuses connections (before the probes can eject it), its sessions
        # are still sent to it first, fail to connect, and are retried on the next backend of the ring
        b.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: _refused(b.port), 30, "B to close its port")
        assert router_health(cluster.router_url)[b.url] is True
        moved = {s: place(s) for s in on_b[:2]}
        assert b.url not in moved.values()
        assert metric(cluster.router_url, "pagoda_router:retries_total", backend=b.url) >= retries + 1
        b.stop()

        wait_for(lambda: router_health(cluster.router_url)[b.url] is False, 10, "the probes to eject B")
        for s in on_b:  # ejected: no retries needed, and each session moves to one stable backend
            where = {place(s) for _ in range(2)}
            assert len(where) == 1 and b.url not in where
            if s in moved:
                assert where == {moved[s]}

        restarted = FixedPortServer(cluster.tmp / "b-restart.log", [], b.port)
        try:
            restarted.wait_healthy()
            wait_for(lambda: router_health(cluster.router_url)[b.url] is True, 10, "the probes to readmit B")
            assert {place(s) for s in on_b} == {b.url}  # its sessions came back
        finally:
            cluster.b = restarted
            cluster.backends[b.url] = restarted
