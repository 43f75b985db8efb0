"""The router against backends that hang or break, as raw sockets on localhost (router.upstream's real client):
a stream that stalls after two events ends with an SSE error event; a backend that accepts and never answers
is left for the next backend; a 200 whose chunked body breaks is never passed on as a 200; long streams whose
events keep coming are not cut; timeouts open the circuit breaker. Also: a request's metrics and usage are
recorded before its last byte is sent, and the client side has `pagoda serve`'s header limits (431)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from pagoda.tools.router.app import RouterState, build_app, make_server
from pagoda.tools.router.cli import add_router_args
from pagoda.tools.router.config import build_config, parse_text
from tests.unit.test_router_upstream import RawServer

USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def event(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


TOKENS = [event({"choices": [{"index": 0, "delta": {"content": t}}], "usage": None}) for t in "ab"]


async def forever(reader: asyncio.StreamReader) -> None:
    """Hold the connection open until the router closes it."""
    await reader.read()


async def stalls_after_two_events(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
    await stalls.read_request(reader)
    writer.write(SSE_HEAD + b"".join(chunk(t) for t in TOKENS))
    await writer.drain()
    await forever(reader)
    stalls.closed_by_client.set()


async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
    await silent.read_request(reader)
    await forever(reader)
    silent.closed_by_client.set()


async def breaks_its_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
    """A 200 whose chunked body has a chunk size that is not hex: unparseable."""
    await broken.read_request(reader)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n"
    stream = json.loads(broken.requests[-1][1]).get("stream")
    writer.write(head % (b"text/event-stream" if stream else b"application/json"))
    writer.write(chunk(TOKENS[0] if stream else b'{"id":"x","choices":[') + b"zz\r\nnot a chunk\r\n")
    await writer.drain()
    await forever(reader)


async def answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
    """A healthy backend; a stream sends an event every 50 ms for `healthy.events` events."""
    while await healthy.read_request(reader):
        head, raw = healthy.requests[-1]
        if head.startswith(b"GET"):  # the router's health probe
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            continue
        body = json.loads(raw)
        if not body.get("stream"):
            data = json.dumps({"id": "ok", "choices": [], "usage": USAGE}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(data))
            writer.write(data)
            await writer.drain()
            continue
        writer.write(SSE_HEAD)
        for i in range(healthy.events):
            writer.write(chunk(event({"choices": [{"index": 0, "delta": {"content": str(i)}}], "usage": None})))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(chunk(event({"choices": [], "usage": USAGE})) + chunk(event(b"[DONE]")) + b"0\r\n\r\n")
        await writer.drain()


HANDLERS = (stalls_after_two_events, never_answers, breaks_its_body, answers)
stalls, silent, broken, healthy = (RawServer(h) for h in HANDLERS)
healthy.events = 3  # events of its streams
TIMEOUT_S = 0.3


async def with_router(
    servers: list[RawServer], test: Callable[..., Any], wrap: Callable[..., Any] | None = None, **overrides: Any
) -> Any:
    for s in servers:  # fresh state per test: the servers are module objects
        s.requests.clear()
        s.connections = 0
        s.closed_by_client = asyncio.Event()
    async with contextlib_group(servers):
        settings = {
            "backends": [s.url for s in servers],
            "first_byte_timeout": TIMEOUT_S,
            "read_timeout": TIMEOUT_S,
            "breaker.failures": 2,
            **overrides,
        }
        state = RouterState(build_config(None, settings))
        app = build_app(state, probes=False)
        if wrap is not None:
            app = wrap(app, state)
        await state.start(probes=False)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
                return await test(client, state)
        finally:
            await state.stop()


class contextlib_group:  # noqa: N801 - used as `async with`
    def __init__(self, servers: list[RawServer]) -> None:
        self.servers = servers

    async def __aenter__(self) -> None:
        for s in self.servers:
            await s.__aenter__()

    async def __aexit__(self, *exc: object) -> None:
        for s in self.servers:
            await s.__aexit__()


def run(servers: list[RawServer], test: Callable[..., Any], **overrides: Any) -> Any:
    async def main() -> Any:
        return await with_router(servers, test, **overrides)

    with asyncio.Runner() as runner:  # without the router's timeouts these would hang: the bound fails them instead
        return runner.run(asyncio.wait_for(main(), 30))


def session_owned_by(state: RouterState, server: RawServer) -> dict[str, str]:
    """An X-Session-ID header whose ring owner is `server`."""
    for i in range(1000):
        if state.balancer.owner(f"s:{i}") == server.url:
            return {"x-session-id": str(i)}
    raise AssertionError("no session maps to the server")


def metric(state: RouterState, line: str) -> bool:
    return line in state.metrics.render().decode()


def test_a_stream_that_stalls_ends_with_an_sse_error_and_opens_the_breaker() -> None:
    async def test(client: httpx.AsyncClient, state: RouterState) -> None:
        started = time.monotonic()
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert time.monotonic() - started >= TIMEOUT_S  # it waited for the backend, then gave up
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.content.startswith(b"".join(TOKENS))  # the two events that came, as they came
        last = r.content[len(b"".join(TOKENS)) :]
        assert last.startswith(b"data: ") and last.endswith(b"\n\n") and b"[DONE]" not in last
        error = json.loads(last[6:])["error"]
        assert error["code"] == 504 and error["type"] == "GatewayTimeoutError"
        assert "--read-timeout" in error["message"] and stalls.url in error["message"]
        await asyncio.wait_for(stalls.closed_by_client.wait(), 5)  # the backend sees the request go away
        backend = state.backends[0]
        assert backend.breaker.consecutive_failures == 1 and backend.breaker.state() == "closed"
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert b"GatewayTimeoutError" in r.content
        health = (await client.get("/health")).json()["backends"][0]
        assert health["circuit"] == "open"  # two timeouts (breaker.failures = 2)
        assert metric(state, f'pagoda_router:backend_errors_total{{backend="{stalls.url}",kind="timeout"}} 2.0')
        assert metric(state, f'pagoda_router:requests_total{{backend="{stalls.url}",code="504",endpoint="chat"}} 2.0')

    run([stalls], test)


def test_a_backend_that_never_answers_is_left_for_the_next_one() -> None:
    async def test(client: httpx.AsyncClient, state: RouterState) -> None:
        to_silent = session_owned_by(state, silent)
        r = await client.post("/v1/chat/completions", json=CHAT, headers=to_silent)
        assert r.status_code == 200 and r.json()["id"] == "ok" and r.headers["x-pagoda-backend"] == healthy.url
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=to_silent)
        assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")  # no header yet: retried too
        assert len(silent.requests) == 2 and len(healthy.requests) == 2
        assert metric(state, f'pagoda_router:retries_total{{backend="{silent.url}"}} 2.0')
        assert metric(state, f'pagoda_router:backend_errors_total{{backend="{silent.url}",kind="timeout"}} 2.0')
        # two timeouts opened its breaker: the next request goes straight to the healthy backend
        assert state.backends[0].breaker.state() == "open"
        r = await client.post("/v1/chat/completions", json=CHAT, headers=to_silent)
        assert r.status_code == 200 and len(silent.requests) == 2 and len(healthy.requests) == 3

    run([silent, healthy], test)


def test_when_every_backend_times_out_the_client_gets_a_504() -> None:
    async def test(client: httpx.AsyncClient, state: RouterState) -> None:
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 504 and r.headers["x-pagoda-backend"] == "router"
        error = r.json()["error"]
        assert error["type"] == "GatewayTimeoutError" and "--first-byte-timeout" in error["message"]

    run([silent], test)


def test_a_200_with_a_broken_chunked_body_is_a_502_or_goes_elsewhere() -> None:
    async def alone(client: httpx.AsyncClient, state: RouterState) -> None:
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 502 and r.json()["error"]["type"] == "BadGatewayError"
        assert metric(state, f'pagoda_router:backend_errors_total{{backend="{broken.url}",kind="broken_body"}} 1.0')
        assert (await client.get("/usage")).json()["keys"] == {}  # nothing answered: nothing counted
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.content.startswith(TOKENS[0])  # a stream had started: it ends with an error event
        error = json.loads(r.content[len(TOKENS[0]) + 6 :])["error"]
        assert error["code"] == 502 and error["type"] == "BadGatewayError"

    run([broken], alone)

    async def beside_a_healthy_one(client: httpx.AsyncClient, state: RouterState) -> None:
        r = await client.post("/v1/chat/completions", json=CHAT, headers=session_owned_by(state, broken))
        assert r.status_code == 200 and r.json()["usage"] == USAGE and len(broken.requests) == 1

    run([broken, healthy], beside_a_healthy_one)


def test_a_long_stream_is_not_cut_while_its_events_keep_coming() -> None:
    healthy.events = 20  # 1 s of events, 50 ms apart: over both timeouts

    async def test(client: httpx.AsyncClient, state: RouterState) -> None:
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status_code == 200 and r.content.count(b"data: ") == 21 and r.content.endswith(b"data: [DONE]\n\n")
        assert state.backends[0].breaker.consecutive_failures == 0

    try:
        run([healthy], test)
    finally:
        healthy.events = 3


def test_usage_and_metrics_are_recorded_before_the_last_byte() -> None:
    """With --workers N another process reads the counts as soon as the client has its answer."""

    seen: list[tuple[dict, bool]] = []

    def wrap(inner: Any, state: RouterState) -> Any:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            async def watching_send(message: dict) -> None:
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    line = f'pagoda_router:requests_total{{backend="{healthy.url}",code="200",endpoint="chat"}}'
                    seen.append((state.usage_snapshot(), line in state.metrics.render().decode()))
                await send(message)

            await inner(scope, receive, watching_send)

        return app

    async def test(client: httpx.AsyncClient, state: RouterState) -> None:
        for stream in (False, True):
            r = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
            assert r.status_code == 200
        (first, counted1), (second, counted2) = seen
        assert first["anonymous"]["requests"] == 1 and first["anonymous"]["total_tokens"] == 7 and counted1
        assert second["anonymous"]["requests"] == 2 and second["anonymous"]["total_tokens"] == 14 and counted2

    run([healthy], test, wrap=wrap)


def test_defaults_are_finite_and_zero_means_none() -> None:
    cfg = build_config(None, {"backends": ["http://127.0.0.1:1"]})
    assert (cfg.first_byte_timeout, cfg.read_timeout) == (300.0, 60.0)
    assert (cfg.max_header_bytes, cfg.max_header_count) == (64 * 1024, 256)
    cfg = build_config(None, {"backends": ["http://127.0.0.1:1"], "first_byte_timeout": 0, "read_timeout": 0})
    assert (cfg.first_byte_timeout, cfg.read_timeout) == (None, None)
    text = b'backends = ["http://127.0.0.1:1"]\nread_timeout = 5\n[limits]\nmax_header_count = 100\n'
    text += b"header_timeout = 9\n"
    cfg = build_config(parse_text(text, ".toml"))
    assert (cfg.read_timeout, cfg.first_byte_timeout, cfg.max_header_count, cfg.header_timeout) == (5, 300.0, 100, 9)


def test_the_router_refuses_oversized_request_headers() -> None:
    parser = argparse.ArgumentParser()
    add_router_args(parser)

    async def main() -> None:
        async with healthy:
            ns = parser.parse_args(["--backend", healthy.url, "--host", "127.0.0.1", "--port", "0"])
            settings = {"backends": [healthy.url], "host": "127.0.0.1", "port": 0, "max_header_count": 32}
            server = make_server(ns, build_config(None, settings))
            task = asyncio.ensure_future(server.serve())
            try:
                while not server.started:
                    await asyncio.sleep(0.01)
                port = server.servers[0].sockets[0].getsockname()[1]
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
                    many = {f"x-h{i}": "v" for i in range(40)}
                    r = await client.post("/v1/chat/completions", json=CHAT, headers=many)
                    assert r.status_code == 431 and "--max-header-count" in r.json()["error"]["message"]
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                    r = await client.get("/health", headers={"x-big": "v" * (65 * 1024)})
                    assert r.status_code == 431 and "--max-header-bytes" in r.json()["error"]["message"]
            finally:
                server.should_exit = True
                await task

    with asyncio.Runner() as runner:
        runner.run(asyncio.wait_for(main(), 30))
