"""`pagoda serve --api-server-count 2`: two API processes on one port in front of one engine core.

Which process a new connection lands on is the kernel's choice, so the tests pin connections: they
open connections until each API process owns some (found through psutil: the process holding the
server end of the connection) and send each request on a connection of a known process. Requests
and scrapes therefore provably go through both processes, and "every process" means every one.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from e2e_helpers import API_KEY, MODEL, metric
from e2e_server import ServerProcess
from kill_race import assert_answered_503, fire_after_kill
from prometheus_client.parser import text_string_to_metric_families

HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


# ---- helpers --------------------------------------------------------------------------------------
def children(server: ServerProcess) -> list[psutil.Process]:
    """The server's engine core and API processes: its children that multiprocessing spawned, so neither the
    resource tracker nor a short-lived helper a library runs while the server starts (such a child can also be
    gone, or a zombie, by the time its command line is read)."""
    found = []
    for child in psutil.Process(server.proc.pid).children():
        try:
            if "multiprocessing.spawn" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:  # ZombieProcess is one
            continue
    return found


def api_processes(server: ServerProcess, count: int = 2, timeout: float = 90.0) -> list[psutil.Process]:
    """The children listening on the server's port (the engine core is the one that does not)."""
    deadline = time.monotonic() + timeout
    while True:
        listening = [
            c
            for c in children(server)
            if any(k.status == psutil.CONN_LISTEN and k.laddr.port == server.port for k in c.net_connections("tcp"))
        ]
        if len(listening) == count or time.monotonic() > deadline:
            assert len(listening) == count, f"{len(listening)} API processes listening: {server.log_tail()}"
            return sorted(listening, key=lambda p: p.pid)
        time.sleep(0.25)


def core_process(server: ServerProcess) -> psutil.Process:
    apis = {p.pid for p in api_processes(server)}
    core = [c for c in children(server) if c.pid not in apis]
    assert len(core) == 1, core
    return core[0]


class Pinned:
    """An HTTP/1.1 keep-alive connection whose server end belongs to a known API process. Every call
    checks that it is still the same socket (http.client would silently reconnect, maybe elsewhere)."""

    def __init__(self, conn: http.client.HTTPConnection, pid: int):
        self.conn, self.pid, self.sock = conn, pid, conn.sock

    def request(self, method: str, path: str, body: dict | None = None) -> http.client.HTTPResponse:
        assert self.conn.sock is self.sock, "the pinned connection was closed"
        self.conn.request(method, path, body=None if body is None else json.dumps(body), headers=HEADERS)
        response = self.conn.getresponse()
        assert self.conn.sock is self.sock, "the pinned connection was replaced"
        return response

    def json(self, method: str, path: str, body: dict | None = None) -> tuple[int, Any]:
        response = self.request(method, path, body)
        return response.status, json.loads(response.read())

    def close(self) -> None:
        self.conn.close()


def _owner(server: ServerProcess, local_port: int, apis: list[psutil.Process]) -> int | None:
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        for p in apis:
            if any(k.raddr and k.raddr.port == local_port for k in p.net_connections("tcp")):
                return p.pid
        time.sleep(0.02)
    return None


def pin(server: ServerProcess, per_process: int = 1) -> dict[int, list[Pinned]]:
    """`per_process` connections to each API process."""
    apis = api_processes(server)
    pinned: dict[int, list[Pinned]] = {p.pid: [] for p in apis}
    for _ in range(400):
        if all(len(v) >= per_process for v in pinned.values()):
            return pinned
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.connect()
        owner = _owner(server, conn.sock.getsockname()[1], apis)
        if owner is not None and len(pinned[owner]) < per_process:
            pinned[owner].append(Pinned(conn, owner))
        else:
            conn.close()
    raise AssertionError(f"could not reach every API process: {[(k, len(v)) for k, v in pinned.items()]}")


def scrape_pinned(conn: Pinned) -> dict:
    response = conn.request("GET", "/metrics")
    assert response.status == 200
    samples = {}
    for family in text_string_to_metric_families(response.read().decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            samples[(s.name, labels)] = s.value
    return samples


def scrape_every_process(server: ServerProcess) -> dict[int, dict]:
    pinned = pin(server)
    try:
        return {pid: scrape_pinned(conns[0]) for pid, conns in pinned.items()}
    finally:
        for conns in pinned.values():
            conns[0].close()


def completion(conn: Pinned, body: dict) -> dict:
    """One completion on a pinned connection, streamed or not; returns {text, finish_reason, usage, ids}."""
    if not body.get("stream"):
        status, data = conn.json("POST", "/v1/completions", body)
        assert status == 200, data
        choice = data["choices"][0]
        return {
            "text": choice["text"],
            "finish_reason": choice["finish_reason"],
            "usage": data["usage"],
            "ids": {data["id"]},
        }
    response = conn.request("POST", "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert response.status == 200
    payloads = [line[5:].strip() for line in response.read().decode().splitlines() if line.startswith("data:")]
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    assert not any("error" in e for e in events), events
    return {
        "text": "".join(c["text"] for e in events for c in e["choices"]),
        "finish_reason": next(c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")),
        "usage": events[-1]["usage"],
        "ids": {e["id"] for e in events},
    }


def wait_idle(server: ServerProcess, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        samples = scrape_every_process(server)
        if all(
            metric(s, "pagoda:num_requests_running") == 0
            and metric(s, "pagoda:num_requests_waiting") == 0
            and metric(s, "pagoda:kv_cache_usage_perc") == 0
            for s in samples.values()
        ):
            return
        time.sleep(0.2)
    raise AssertionError(f"engine not idle: {samples}")


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


# ---- the server -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def asc(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("asc-tmpdir")  # the server's TMPDIR: its temp folders must vanish at exit
    # Pinned connections wait their turn (pin() collects them one by one; a test uses one, then the other):
    # on a busy 2-core machine that can outlast a keep-alive timeout, and the server would close them.
    proc = ServerProcess(
        tmp_path_factory.mktemp("asc") / "serve.log",
        ["--api-server-count", "2", "--timeout-keep-alive", "120"],
        env={"TMPDIR": str(tmp)},
    )
    proc.tmpdir = tmp  # type: ignore[attr-defined]
    try:
        proc.wait_healthy()
        api_processes(proc)
        yield proc
    finally:
        proc.stop()


def test_process_layout_and_every_process_answers(asc: ServerProcess) -> None:
    apis = api_processes(asc)
    core = core_process(asc)
    assert core.pid not in {p.pid for p in apis}
    pinned = pin(asc)
    try:
        for (conn,) in pinned.values():
            health = conn.request("GET", "/health")
            health.read()
            assert health.status == 200
            status, models = conn.json("GET", "/v1/models")
            assert status == 200 and [m["id"] for m in models["data"]] == [MODEL], models
            status, version = conn.json("GET", "/version")
            assert status == 200 and "version" in version
    finally:
        for conns in pinned.values():
            conns[0].close()
    temp = sorted(p.name for p in asc.tmpdir.iterdir() if p.name.startswith("pagoda-"))  # type: ignore[attr-defined]
    assert any(name.startswith("pagoda-metrics-") for name in temp), temp


def test_concurrent_requests_on_both_processes_match_single_process_outputs(
    asc: ServerProcess, http: httpx.Client
) -> None:
    """24 greedy requests, streamed and not, 4 connections on each API process at once: every response
    opens as the single-process server's text for that prompt does (outputs never cross requests).

    Not word for word: greedy text can differ between a request served alone and one batched with others
    once a near-tie meets batch-dependent float rounding (the CPU attention's padded batch, per-row-count
    matmul kernels: 3 of these 12 prompts change within 12 tokens offline when batched together), while
    every prompt's first 12 characters differ from every other's."""
    prompts = [
        "The capital of France is",
        "Roses are red,",
        "1, 2, 3, 4,",
        "Once upon a time",
        "def fibonacci(n):",
        "The largest planet is",
        "My favourite food is",
        "In 1969, astronauts",
        "Water boils at",
        "The opposite of hot is",
        "Dear Sir or Madam,",
        "A haiku about autumn:",
    ]
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0} for p in prompts]
    expected = []
    for body in bodies:
        data = http.post("/v1/completions", json=body).json()
        expected.append((data["choices"][0]["text"], data["choices"][0]["finish_reason"]))
    openings = [text[:12] for text, _ in expected]
    assert len(set(openings)) == len(openings), "prompts too alike to tell outputs apart"

    pinned = pin(asc, per_process=4)
    connections = [c for conns in pinned.values() for c in conns]
    jobs: list[list[tuple[int, dict]]] = [[] for _ in connections]
    for k in range(24):  # each prompt twice: once streamed, once not, on different processes
        i = k % 12
        jobs[k % len(connections)].append((i, {**bodies[i], "stream": k >= 12}))

    def run(conn: Pinned, work: list[tuple[int, dict]]) -> list[tuple[int, dict, dict]]:
        return [(i, body, completion(conn, body)) for i, body in work]

    try:
        with ThreadPoolExecutor(len(connections)) as pool:
            results = [r for rs in pool.map(run, connections, jobs) for r in rs]
    finally:
        for c in connections:
            c.close()
    assert len(results) == 24
    served_by = {conn.pid for conn, work in zip(connections, jobs) if work}
    assert len(served_by) == 2
    for i, body, got in results:
        assert (got["text"][:12], got["finish_reason"]) == (openings[i], expected[i][1]), (i, body.get("stream"), got)
        assert len(got["ids"]) == 1


def test_text_decoded_in_the_api_processes_matches_the_cores(asc: ServerProcess) -> None:
    """With several API processes a request without stop strings is detokenized in its API process, one
    with a stop string in the engine core. A stop string that never matches changes nothing else, so
    the same greedy tokens must come out as the same text, streamed or not, on either process."""
    pinned = pin(asc)
    base = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    try:
        for (conn,) in pinned.values():
            for stream in (False, True):
                api = completion(conn, {**base, "stream": stream})
                core = completion(conn, {**base, "stream": stream, "stop": ["\u0000never in the text"]})
                assert api["text"] and api["text"] == core["text"], (stream, api, core)
                assert api["usage"]["completion_tokens"] == core["usage"]["completion_tokens"] == 24
    finally:
        for conns in pinned.values():
            conns[0].close()


def test_metrics_are_the_true_totals_whichever_process_answers(asc: ServerProcess) -> None:
    wait_idle(asc)
    before = scrape_every_process(asc)
    counters = [
        "pagoda:prompt_tokens_total",
        "pagoda:generation_tokens_total",
        "pagoda:prefix_cache_queries_total",
        "pagoda:time_to_first_token_seconds_count",
        "pagoda:e2e_request_latency_seconds_count",
    ]
    for name in counters:
        assert len({metric(s, name) for s in before.values()}) == 1, (name, before)
    # process_*: whichever process answers shows every API process's own series, one per pid.
    api_pids = {str(pid) for pid in before}
    for samples in before.values():
        assert {dict(labels).get("pid") for n, labels in samples if n == "process_resident_memory_bytes"} == api_pids

    nonce = uuid.uuid4().hex[:8]
    shared = f"{nonce} shared prefix for the metrics test. " * 6  # several full 16-token blocks
    pinned = pin(asc)
    (a,), (b,) = pinned.values()
    try:
        first = completion(a, {"model": MODEL, "prompt": shared, "max_tokens": 4, "ignore_eos": True, "temperature": 0})
        again = completion(
            b, {"model": MODEL, "prompt": shared, "max_tokens": 4, "ignore_eos": True, "temperature": 0, "stream": True}
        )
        others = [
            completion(
                conn,
                {
                    "model": MODEL,
                    "prompt": f"{uuid.uuid4().hex[:8]} Count with me {k}:",
                    "max_tokens": 6 + k,
                    "ignore_eos": k % 2 == 0,
                    "temperature": 0,
                    "stream": k % 2 == 1,
                },
            )
            for k, conn in enumerate([a, b, a, b])
        ]
    finally:
        a.close()
        b.close()
    results = [first, again, *others]
    wait_idle(asc)
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in results)
    generated = sum(r["usage"]["completion_tokens"] for r in results)
    reasons = [r["finish_reason"] for r in results]
    cached = (first["usage"]["prompt_tokens"] - 1) // 16 * 16
    assert cached >= 32

    for scrape_round in range(3):  # fresh connections each round, one per process
        for pid, after in scrape_every_process(asc).items():
            where = f"process {pid}, round {scrape_round}"
            assert delta(before[pid], after, "pagoda:prompt_tokens_total") == prompt_tokens, where
            assert delta(before[pid], after, "pagoda:generation_tokens_total") == generated, where
            for reason in ("length", "stop", "abort"):
                assert delta(
                    before[pid], after, "pagoda:request_success_total", finished_reason=reason
                ) == reasons.count(reason), (where, reason)
            for histogram in (
                "time_to_first_token_seconds",
                "e2e_request_latency_seconds",
                "request_queue_time_seconds",
            ):
                assert delta(before[pid], after, f"pagoda:{histogram}_count") == len(results), (where, histogram)
            assert delta(before[pid], after, "pagoda:inter_token_latency_seconds_count") == generated - len(results)
            # Engine totals: counted once, not once per API process.
            assert delta(before[pid], after, "pagoda:prefix_cache_queries_total") == prompt_tokens, where
            assert delta(before[pid], after, "pagoda:prefix_cache_hits_total") == cached, where
            assert metric(after, "pagoda:num_requests_running") == 0, where
            # Requests one at a time: a step per generated token (at most one spare step per request),
            # counted once although both processes receive the core's totals.
            steps = delta(before[pid], after, "pagoda:engine_steps_total")
            assert generated <= steps <= generated + len(results), (where, steps, generated)


@pytest.mark.parametrize("side", [0, 1])
def test_client_disconnect_aborts_in_the_core(asc: ServerProcess, side: int) -> None:
    """A stream on one process, dropped mid-way: the core aborts it; the other process sees the engine
    gauges move (one running request, not one per process) and come back to idle."""
    wait_idle(asc)
    before = scrape_every_process(asc)
    pinned = pin(asc)
    streamer, watcher = [conns[0] for conns in pinned.values()][side], [conns[0] for conns in pinned.values()][1 - side]
    body = {
        "model": MODEL,
        "prompt": "Tell me a very long story.",
        "max_tokens": 500,
        "ignore_eos": True,
        "stream": True,
    }
    response = streamer.request("POST", "/v1/completions", body)
    assert response.status == 200
    events = 0
    while events < 2:
        line = response.readline()
        assert line, "stream ended early"
        events += line.startswith(b"data:")
    busy = scrape_pinned(watcher)
    assert metric(busy, "pagoda:num_requests_running") == 1, busy
    assert metric(busy, "pagoda:kv_cache_usage_perc") > 0
    watcher.close()
    streamer.sock.shutdown(socket.SHUT_RDWR)
    streamer.close()
    wait_idle(asc, timeout=10)
    for pid, after in scrape_every_process(asc).items():
        assert delta(before[pid], after, "pagoda:request_success_total", finished_reason="abort") == 1, pid
        assert delta(before[pid], after, "pagoda:request_success_total", finished_reason="length") == 0, pid
        assert delta(before[pid], after, "pagoda:generation_tokens_total") < 500, pid


def test_a_reused_request_id_runs_on_either_process_and_the_owner_keeps_running(asc: ServerProcess) -> None:
    request_id = f"dup-{uuid.uuid4().hex[:8]}"
    pinned = pin(asc, per_process=2)
    (owner, same), (other, _) = pinned.values()
    body = {
        "model": MODEL,
        "prompt": "Count to a hundred:",
        "max_tokens": 60,
        "ignore_eos": True,
        "stream": True,
        "request_id": request_id,
        "stream_options": {"include_usage": True},
    }
    try:
        response = owner.request("POST", "/v1/completions", body)
        assert response.status == 200
        first = response.readline()
        while not first.startswith(b"data:"):
            first = response.readline()
        # The id names the response, not the engine's request (which adds its own suffix): a reuse on either
        # process runs to its end, and its cleanup must not touch the owner's request.
        for conn in (other, same):
            duplicate = {k: v for k, v in body.items() if k != "stream_options"}
            status, answer = conn.json("POST", "/v1/completions", {**duplicate, "stream": False})
            assert status == 200 and answer["id"] == f"cmpl-{request_id}", (conn.pid, answer)
        rest = first + response.read()
    finally:
        for conns in pinned.values():
            for conn in conns:
                conn.close()
    payloads = [line[5:].strip() for line in rest.decode().splitlines() if line.startswith("data:")]
    events = [json.loads(p) for p in payloads[:-1]]
    assert events[-1]["usage"]["completion_tokens"] == 60
    assert [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")] == ["length"]


def test_sigterm_stops_every_process_and_leaves_nothing_behind(asc: ServerProcess) -> None:
    family = [psutil.Process(asc.proc.pid), *psutil.Process(asc.proc.pid).children(recursive=True)]
    assert len(family) >= 4  # launcher, core, 2 API processes (+ resource tracker)
    asc.proc.send_signal(signal.SIGTERM)
    assert asc.proc.wait(60) == 0, asc.log_tail()
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, f"left running: {alive}"
    left = [p.name for p in asc.tmpdir.iterdir() if p.name.startswith(("pagoda-", "pymp-"))]  # type: ignore[attr-defined]
    assert not left, left
    with socket.socket() as s:  # nothing listens on the port any more (TIME_WAIT entries may stay)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", asc.port))
    assert "Traceback" not in asc.log_tail(20000)


# ---- servers of their own -------------------------------------------------------------------------
def test_engine_core_death_fails_every_process_and_stops_the_server(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "serve.log", ["--api-server-count", "2"], env={"TMPDIR": str(tmp_path)})
    try:
        server.wait_healthy()
        core = core_process(server)
        family = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
        pinned = pin(server)
        streams = []
        for (conn,) in pinned.values():
            response = conn.request(
                "POST",
                "/v1/completions",
                {"model": MODEL, "prompt": "A long story:", "max_tokens": 1000, "ignore_eos": True, "stream": True},
            )
            assert response.status == 200
            line = response.readline()
            while not line.startswith(b"data:"):
                line = response.readline()
            streams.append(response)
        raced = fire_after_kill(server.url, core.kill)  # requests sent 0-440 ms after the kill
        for response in streams:  # every process ends its stream with an error event
            rest = response.read().decode()
            assert '"error"' in rest and "engine stopped" in rest.lower(), rest[-500:]
            assert rest.rstrip().endswith("data: [DONE]")
        assert_answered_503(raced)
        assert server.proc.wait(60) == 1
        log = server.log_tail(20000)
        errors = [line for line in log.splitlines() if line.startswith("pagoda: error:")]
        assert len(errors) == 1 and "engine core process died" in errors[0], log
        _, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, alive
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(("pagoda-", "pymp-"))]
    finally:
        server.stop()


@pytest.mark.parametrize("event", ["sigterm", "an API process dies"])
def test_api_processes_start_while_the_core_loads_and_stop_with_it(tmp_path: Path, event: str) -> None:
    """The API processes start beside the core, so their setup overlaps the model's load, and the port stays closed
    until the core is ready. A SIGTERM meanwhile stops every process (exit 0); an API process that dies meanwhile
    stops the server with one line (exit 1). Nothing is left behind either way."""
    server = ServerProcess(tmp_path / "serve.log", ["--api-server-count", "2"], env={"TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 120
        while len(children(server)) < 3:  # the core and both API processes
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log_tail()
            time.sleep(0.05)
        family = [psutil.Process(server.proc.pid), *children(server)]
        assert "Serving on" not in server.log_tail(), "the model loaded before the test looked: " + server.log_tail()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=5)
        if event == "sigterm":
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(60) == 0, server.log_tail()
        else:
            last = max(family[1:], key=lambda c: (c.create_time(), c.pid))  # started after the core: an API process
            last.kill()
            assert server.proc.wait(60) == 1, server.log_tail()
            errors = [line for line in server.log_tail().splitlines() if line.startswith("pagoda: error:")]
            assert len(errors) == 1 and "exited during startup" in errors[0], server.log_tail()
        _, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, alive
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(("pagoda-", "pymp-"))]
    finally:
        server.stop()


def test_startup_failures_are_one_line(tiny_llama: str, tmp_path: Path) -> None:
    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pagoda", "serve", "--model", tiny_llama, "--skip-tokenizer-init", *flags],
            check=False,
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )

    result = run("--api-server-count", "0", "--port", "0")
    assert result.returncode == 2 and "--api-server-count must be at least 1" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    with socket.socket() as taken:  # the port check after the model loaded (preflight skipped)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("-asc", "2", "--skip-preflight", "--host", "127.0.0.1", "--port", str(port))
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("pagoda: error:")] != []
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(("pagoda-", "pymp-"))]
