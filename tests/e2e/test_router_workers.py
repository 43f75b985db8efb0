"""`pagoda router --workers 2` as real processes over three tiny fake backends (no model, a few seconds on CPU).

Checked: many concurrent requests on fresh connections all succeed and reach both workers; a session lands on
the same backend whichever worker takes it (the ring owner computed here, in another process); /metrics
request and token counters and /usage equal the true totals on every scrape, whichever worker answers; a
backend that stops is ejected by every worker's probes (no worker tries it any more); a config change is
applied by every worker; SIGTERM stops every worker and removes the metrics directory; a bind error is one
line and a non-zero exit.
"""

from __future__ import annotations

import asyncio
import json
import os
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

KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
ROOT = Path(__file__).resolve().parents[2]


# -- a fake backend: `python test_router_workers.py PORT` --------------------------------------------------------
def serve_fake(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def health(_: Any) -> Response:
        return Response(status_code=200)

    async def models(_: Any) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def chat(request: Any) -> Any:
        body = await request.json()
        n = int(body.get("max_tokens") or 4)
        prompt = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        if not body.get("stream"):
            await asyncio.sleep(0.01)
            return JSONResponse(
                {
                    "id": "c",
                    "object": "chat.completion",
                    "model": "fake",
                    "usage": usage,
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "x" * n}, "finish_reason": "length"}
                    ],
                }
            )

        async def events() -> Any:
            for _ in range(n):
                await asyncio.sleep(0.005)
                yield (
                    "data: "
                    + json.dumps({"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}}], "usage": None})
                    + "\n\n"
                )
            if (body.get("stream_options") or {}).get("include_usage"):
                yield "data: " + json.dumps({"id": "c", "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class Cluster:
    def __init__(
        self, url: str, proc: subprocess.Popen, backends: dict[str, subprocess.Popen], tmp: Path, config: Path
    ):
        self.url, self.proc, self.backends, self.tmp, self.config = url, proc, backends, tmp, config
        self.sent: dict[str, list[int]] = {k: [0, 0, 0] for k in KEYS}  # requests, prompt, completion tokens

    def health(self) -> dict[str, Any]:
        """/health on a fresh connection (so either worker may answer)."""
        return httpx.get(self.url + "/health", headers={"connection": "close"}, timeout=5).json()

    def workers_views(self, tries: int = 400, until: Any = None) -> dict[int, dict[str, Any]]:
        """pid -> the latest /health of that worker, until both answered (and `until(view)` holds for both)."""
        views: dict[int, dict[str, Any]] = {}
        for _ in range(tries):
            h = self.health()
            views[h["worker"]["pid"]] = h
            if len(views) == 2 and (until is None or all(until(v) for v in views.values())):
                return views
            time.sleep(0.01)
        raise AssertionError(f"both workers never answered as wanted: {views}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("router-workers")
    backends: dict[str, subprocess.Popen] = {}
    proc = None
    try:
        for _ in range(3):
            port = free_port()
            backends[f"http://127.0.0.1:{port}"] = subprocess.Popen([sys.executable, __file__, str(port)])
        for url in backends:
            wait_for(lambda u=url: httpx.get(u + "/health", timeout=1).status_code == 200, 30, f"fake {url}")
        port = free_port()
        config = tmp / "router.toml"
        config.write_text(f"""
policy = "session"
load_factor = 0
backends = {json.dumps(list(backends))}
[api_keys]
alice = "{KEYS["alice"]}"
bob = "{KEYS["bob"]}"
[health]
interval = 0.25
timeout = 0.5
fail_threshold = 2
pass_threshold = 1
[breaker]
failures = 1000
""")
        with open(tmp / "router.log", "wb") as log:  # TMPDIR: the metrics directory lands where we can see it
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pagoda",
                    "router",
                    "--config",
                    str(config),
                    "--workers",
                    "2",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--reload-interval",
                    "0.2",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "TMPDIR": str(tmp)},
            )
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(url + "/health", timeout=1).status_code == 200, 30, "the router")
        cl = Cluster(url, proc, backends, tmp, config)
        # One worker answers as soon as it is up; the tests count on both (a loaded machine starts the second
        # seconds later, and until then the first accepts every connection).
        pids: set[int] = set()
        wait_for(lambda: pids.add(cl.health()["worker"]["pid"]) or len(pids) == 2, 60, "both router workers")
        yield cl
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        for p in backends.values():
            p.kill()
            p.wait()


async def _post_many(cl: Cluster, jobs: list[tuple[str, str, bool, int]], concurrency: int) -> list[httpx.Response]:
    """(key label, session, stream, max_tokens) each on a fresh connection; counts what each key sent."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=cl.url, timeout=30, limits=limits) as client:

        async def one(label: str, session: str, stream: bool, max_tokens: int) -> httpx.Response:
            body = {
                "model": "fake",
                "stream": stream,
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"hello from {session}"}],
            }
            async with sem:
                r = await client.post(
                    "/v1/chat/completions",
                    json=body,
                    headers={"authorization": f"Bearer {KEYS[label]}", "x-session-id": session},
                )
            if r.status_code == 200:
                row = cl.sent[label]
                row[0] += 1
                row[1] += 3
                row[2] += max_tokens
            return r

        return await asyncio.gather(*(one(*job) for job in jobs))


def _metrics(cl: Cluster) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(cl.url + "/metrics", headers={"connection": "close"}, timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _total(samples: dict, name: str, **labels: str) -> float:
    return sum(
        v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items())
    )


def test_concurrent_requests_and_session_affinity_across_workers(cluster: Cluster) -> None:
    from pagoda.tools.router.config import BackendConfig, BreakerConfig
    from pagoda.tools.router.health import Backend
    from pagoda.tools.router.policy import Balancer

    sessions = [f"sess-{i}" for i in range(24)]
    jobs = [("alice", s, i % 2 == 0, 4) for i in range(6) for s in sessions]
    responses = asyncio.run(_post_many(cluster, jobs, concurrency=48))
    assert [r.status_code for r in responses] == [200] * len(jobs)
    placed: dict[str, set[str]] = {}
    for (_, session, _, _), r in zip(jobs, responses):
        placed.setdefault(session, set()).add(r.headers["x-pagoda-backend"])
    assert all(len(v) == 1 for v in placed.values()), placed
    # the owner on a ring built here, in this process: the workers' rings are the same
    balancer = Balancer("session")
    balancer.set_backends([Backend(BackendConfig(url=u, name=u), BreakerConfig()) for u in cluster.backends])
    assert {s: next(iter(v)) for s, v in placed.items()} == {s: balancer.owner("s:" + s) for s in sessions}
    assert len({next(iter(v)) for v in placed.values()}) == 3  # and sessions spread over all backends
    # both workers served proxied requests: each worker's own counter file has some
    from prometheus_client.multiprocess import MultiProcessCollector

    (metrics_dir,) = cluster.tmp.glob("pagoda-router-metrics-*")
    per_worker = []
    for f in sorted(metrics_dir.glob("counter_*.db")):
        samples = [
            s
            for m in MultiProcessCollector.merge([str(f)])
            for s in m.samples
            if s.name == "pagoda_router:requests_total"
        ]
        per_worker.append(sum(s.value for s in samples))
    assert len(per_worker) == 2 and min(per_worker) > 0 and sum(per_worker) == len(jobs), per_worker


def test_metrics_and_usage_add_up_all_workers(cluster: Cluster) -> None:
    jobs = [("bob", f"bob-{i}", i % 3 != 0, 2 + i % 5) for i in range(40)]
    responses = asyncio.run(_post_many(cluster, jobs, concurrency=16))
    assert all(r.status_code == 200 for r in responses)
    total_requests = sum(row[0] for row in cluster.sent.values())
    pids = set()
    for _ in range(8):  # fresh connections: either worker answers, every answer must be the whole total
        m = _metrics(cluster)
        assert _total(m, "pagoda_router:requests_total", code="200") == total_requests
        for label, (requests, prompt, completion) in cluster.sent.items():
            assert _total(m, "pagoda_router:key_requests_total", key=label) == requests
            assert _total(m, "pagoda_router:prompt_tokens_total", key=label) == prompt
            assert _total(m, "pagoda_router:completion_tokens_total", key=label) == completion
        assert _total(m, "pagoda_router:time_to_first_byte_seconds_count") == total_requests
        usage = httpx.get(
            cluster.url + "/usage", headers={"authorization": f"Bearer {KEYS['bob']}", "connection": "close"}, timeout=5
        ).json()["keys"]
        for label, (requests, prompt, completion) in cluster.sent.items():
            assert usage[label] == {
                "requests": requests,
                "requests_without_usage": 0,
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
        pids.add(cluster.health()["worker"]["pid"])
    # gauges: each backend up, nothing in flight once the workers have published (every 0.25 s)
    time.sleep(0.4)
    m = _metrics(cluster)
    assert {dict(ls)["backend"]: v for (n, ls), v in m.items() if n == "pagoda_router:backend_up"} == dict.fromkeys(
        cluster.backends, 1.0
    )
    assert _total(m, "pagoda_router:backend_inflight") == 0


def test_a_stopped_backend_is_avoided_by_every_worker(cluster: Cluster) -> None:
    dead = list(cluster.backends)[1]
    sessions = [f"sess-{i}" for i in range(24)]
    placed = {
        s: r.headers["x-pagoda-backend"]
        for s, r in zip(sessions, asyncio.run(_post_many(cluster, [("alice", s, False, 1) for s in sessions], 8)))
    }
    on_dead = [s for s, b in placed.items() if b == dead]
    assert on_dead
    proc = cluster.backends[dead]
    proc.kill()
    proc.wait()
    # every worker's own probes eject it: interval 0.25 s x fail_threshold 2
    started = time.monotonic()
    cluster.workers_views(until=lambda v: {b["url"]: b["healthy"] for b in v["backends"]}[dead] is False)
    assert time.monotonic() - started < 3
    retries = _total(_metrics(cluster), "pagoda_router:retries_total", backend=dead)
    jobs = [("alice", s, True, 2) for s in on_dead for _ in range(8)]
    responses = asyncio.run(_post_many(cluster, jobs, concurrency=16))
    assert all(r.status_code == 200 for r in responses)
    assert dead not in {r.headers["x-pagoda-backend"] for r in responses}
    # no worker sent anything to it (a worker that had not ejected it would try it first, then retry)
    assert _total(_metrics(cluster), "pagoda_router:retries_total", backend=dead) == retries
    m = _metrics(cluster)
    assert _total(m, "pagoda_router:backend_up", backend=dead) == 0


def test_config_reload_reaches_every_worker(cluster: Cluster) -> None:
    cluster.config.write_text(cluster.config.read_text().replace('policy = "session"', 'policy = "round-robin"'))
    views = cluster.workers_views(until=lambda v: v["policy"] == "round-robin")
    assert all(v["worker"]["reloads"] == 1 for v in views.values())
    wait_for(
        lambda: _total(_metrics(cluster), "pagoda_router:config_reloads_total") == 1,
        5,
        "config_reloads_total == 1 (worker 0 counts)",
    )


def test_sigterm_stops_every_worker_and_cleans_up(cluster: Cluster) -> None:
    pids = list(cluster.workers_views())
    (metrics_dir,) = cluster.tmp.glob("pagoda-router-metrics-*")
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(20) == 0, (cluster.tmp / "router.log").read_text()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not metrics_dir.exists()


def test_bind_error_is_one_line_and_non_zero(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pagoda",
                "router",
                "--workers",
                "2",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--backend",
                "http://127.0.0.1:9",
            ],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )
    assert r.returncode == 1
    line = f"pagoda router: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert r.stderr.strip().splitlines() == [line]
    assert not list(tmp_path.glob("pagoda-router-metrics-*"))


if __name__ == "__main__":
    serve_fake(int(sys.argv[1]))
