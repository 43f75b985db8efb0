"""The router's upstream client (router.upstream.FastHTTPTransport) against raw HTTP/1.1 servers on localhost:
body framings (chunked, Content-Length, until close), keep-alive reuse and expiry, the errors the proxy
maps (connect, dropped before the answer, cut mid-body, read and pool timeouts, malformed answers), closing
a half-read response, backpressure, large request bodies; and the proxy over it, end to end. Each runs on
asyncio's own loop and on uvloop (what uvicorn picks when it is installed)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from pagoda.tools.router import upstream as upstream_mod
from pagoda.tools.router.upstream import FastHTTPTransport

# uvloop is a dependency wherever it exists (pyproject: not on Windows): there, a missing uvloop is a
# broken install and fails these tests instead of skipping them.
if sys.platform == "win32":  # pragma: no cover
    uvloop = None
    LOOPS = ["asyncio"]
else:
    import uvloop

    LOOPS = ["asyncio", "uvloop"]


def run(loop_kind: str, coro: Awaitable[Any]) -> Any:
    factory = uvloop.new_event_loop if loop_kind == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(asyncio.wait_for(coro, 30))  # a bug fails the test instead of hanging it


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class RawServer:
    """A TCP server whose handler writes whatever bytes a test wants; counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body)
        self.closed_by_client = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Any:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bool:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return False
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length)
        self.requests.append((head, body))
        return True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def serve(handler: Handler) -> RawServer:
    return RawServer(handler)


async def post(
    transport: FastHTTPTransport, url: str, body: bytes = b'{"x":1}', timeout: httpx.Timeout | None = None
) -> httpx.Response:
    ext = {"timeout": (timeout or httpx.Timeout(5.0)).as_dict()}
    return await transport.handle_async_request(
        httpx.Request("POST", url + "/v1/chat/completions", content=body, headers={"x-test": "1"}, extensions=ext)
    )


async def chunks_of(response: httpx.Response) -> list[bytes]:
    out = [c async for c in response.stream]
    await response.aclose()
    return out


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_chunked_stream_request_bytes_and_keepalive_reuse(loop_kind: str) -> None:
    parts = [b"data: " + json.dumps({"i": i}).encode() + b"\n\n" for i in range(5)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await server.read_request(reader):
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nX-Custom: a b\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            for p in parts:  # one chunk per write, some time apart: the client sees them as they come
                writer.write(b"%x\r\n%s\r\n" % (len(p), p))
                await writer.drain()
                await asyncio.sleep(0.005)
            writer.write(b"0\r\n\r\n")

    server = serve(handler)

    async def main() -> None:
        async with server:
            t = FastHTTPTransport()
            for _ in range(3):
                r = await post(t, server.url, body=b'{"hello":"w\xc3\xb6rld"}')
                assert r.status_code == 200
                assert r.headers["content-type"] == "text/event-stream" and r.headers["x-custom"] == "a b"
                got = await chunks_of(r)
                assert b"".join(got) == b"".join(parts) and len(got) >= 3  # not all buffered into one
            assert server.connections == 1  # one kept-alive connection
            head, body = server.requests[0]
            assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
            assert b"x-test: 1" in head.lower() and b"host: 127.0.0.1:" in head.lower()
            assert body == b'{"hello":"w\xc3\xb6rld"}'
            await t.aclose()

    run(loop_kind, main())


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_content_length_and_until_close_bodies(loop_kind: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        if n == 1:  # HTTP/1.0 style: no length, the body ends when the connection closes
            writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n{"a":')
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(b"1}")
        else:
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 5\r\n\r\nnope!")
            await writer.drain()
            await server.read_request(reader)

    server = serve(handler)

    async def main() -> None:
        async with server:
            t = FastHTTPTransport()
            r = await post(t, server.url)
            assert r.status_code == 200 and await r.aread() == b'{"a":1}'
            r = await post(t, server.url)  # the first connection was not kept: a new one
            assert r.status_code == 404 and await r.aread() == b"nope!"
            assert server.connections == 2
            await t.aclose()

    run(loop_kind, main())


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_connect_error_and_drop_before_the_answer(loop_kind: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        if n == 1:
            return  # closes without answering
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)  # then closes the kept-alive connection while it is idle

    server = serve(handler)

    async def main() -> None:
        async with server:
            t = FastHTTPTransport()
            with pytest.raises(httpx.RemoteProtocolError):
                await post(t, server.url)
            r = await post(t, server.url)
            assert await r.aread() == b"ok"
            await asyncio.sleep(0.2)  # the server has closed the idle connection: a new one, no error
            r = await post(t, server.url)
            assert await r.aread() == b"ok" and server.connections == 3
            await t.aclose()
            port = server.port
        with pytest.raises(httpx.ConnectError):
            await post(FastHTTPTransport(), f"http://127.0.0.1:{port}")

    run(loop_kind, main())


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_body_cut_short_and_malformed_answer(loop_kind: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        if n == 1:
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                b"5\r\nhello\r\n"
            )
            await writer.drain()
            await asyncio.sleep(0.02)
        else:
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)

    server = serve(handler)

    async def main() -> None:
        async with server:
            t = FastHTTPTransport()
            r = await post(t, server.url)
            got = []
            with pytest.raises(httpx.RemoteProtocolError):
                async for chunk in r.stream:
                    got.append(chunk)
            assert got == [b"hello"]
            await r.aclose()
            with pytest.raises(httpx.RemoteProtocolError):
                await post(t, server.url)
            await t.aclose()

    run(loop_kind, main())


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_read_timeout_and_closing_a_half_read_response(loop_kind: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        if n == 1:
            await asyncio.sleep(1.0)
            return
        # the client stops reading and closes: this side sees EOF (a backend would abort the request)
        assert await reader.read() == b""
        server.closed_by_client.set()

    server = serve(handler)

    async def main() -> None:
        async with server:
            t = FastHTTPTransport()
            r = await post(t, server.url, timeout=httpx.Timeout(5.0, read=0.1))
            it = r.stream.__aiter__()
            assert await it.__anext__() == b"abc"
            with pytest.raises(httpx.ReadTimeout):
                await it.__anext__()
            await r.aclose()
            r = await post(t, server.url)
            it = r.stream.__aiter__()
            assert await it.__anext__() == b"abc"
            await r.aclose()
            await asyncio.wait_for(server.closed_by_client.wait(), 2)
            assert not t._pools[("127.0.0.1", server.port)].idle  # neither connection kept for reuse
            assert t._pools[("127.0.0.1", server.port)].count == 0
            await t.aclose()

    run(loop_kind, main())


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_pool_limit_waits_then_times_out(loop_kind: str) -> None:
    release = None

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await server.read_request(reader):
            await release.wait()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    server = serve(handler)

    async def main() -> None:
        nonlocal release
        release = asyncio.Event()
        async with server:
            t = FastHTTPTransport(httpx.Limits(max_connections=1))
            first = asyncio.ensure_future(post(t, server.url))
            await asyncio.sleep(0.05)
            with pytest.raises(httpx.PoolTimeout):
                await post(t, server.url, timeout=httpx.Timeout(5.0, pool=0.1))
            second = asyncio.ensure_future(post(t, server.url))
            await asyncio.sleep(0.05)
            assert not second.done()
            release.set()
            assert await (await first).aread() == b"ok"
            assert await (await second).aread() == b"ok"
            assert server.connections == 1
            # a waiter woken for the free connection but cancelled before it runs passes its turn on
            release.clear()
            first = asyncio.ensure_future(post(t, server.url))
            await asyncio.sleep(0.05)
            second = asyncio.ensure_future(post(t, server.url))
            third = asyncio.ensure_future(post(t, server.url))
            await asyncio.sleep(0.05)
            release.set()
            await (await first).aread()  # releases the connection: wakes `second` ...
            second.cancel()  # ... which leaves before it could take it
            assert await (await asyncio.wait_for(third, 2)).aread() == b"ok"
            await t.aclose()

    run(loop_kind, main())


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_backpressure_and_large_request_body(loop_kind: str) -> None:
    big = bytes(range(256)) * 4096 * 2  # 2 MiB each way
    request_body = b"{" + b"x" * (1 << 20) + b"}"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big))
        for i in range(0, len(big), 65536):
            writer.write(big[i : i + 65536])
            await writer.drain()

    server = serve(handler)

    async def main() -> None:
        async with server:
            t = FastHTTPTransport()
            r = await post(t, server.url, body=request_body)
            conn = r.stream.conn
            got, paused = [], False
            async for chunk in r.stream:
                got.append(chunk)
                await asyncio.sleep(0.02)  # a slow client: the socket must be paused, not buffered
                paused = paused or conn.read_paused
                assert conn.buffered <= upstream_mod._HIGH_WATER + 65536 * 4
            await r.aclose()
            assert paused and b"".join(got) == big
            assert server.requests[0][1] == request_body
            await t.aclose()

    run(loop_kind, main())


# -- the proxy over it, with real sockets on both sides -----------------------------------------------------
@pytest.mark.parametrize("loop_kind", LOOPS)
def test_router_streams_through_the_fast_transport(loop_kind: str) -> None:
    from pagoda.tools.router.app import RouterState, build_app
    from pagoda.tools.router.config import build_config

    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    events = [
        b'data: {"choices":[{"index":0,"delta":{"content":"a"}}],"usage":null}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":"b"}}],"usage":null}\n\n',
        b'data: {"choices":[],"usage":' + json.dumps(usage).encode() + b"}\n\n",
        b"data: [DONE]\n\n",
    ]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await server.read_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for e in events:
                writer.write(b"%x\r\n%s\r\n" % (len(e), e))
                await writer.drain()
                await asyncio.sleep(0.002)
            writer.write(b"0\r\n\r\n")

    server = serve(handler)

    async def main() -> None:
        async with server:
            state = RouterState(build_config(None, {"backends": [server.url]}))
            app = build_app(state, probes=False)
            await state.start(probes=False)
            try:
                assert isinstance(state.upstream_for(state.backends[0]), FastHTTPTransport)
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
                    for _ in range(2):
                        r = await client.post(
                            "/v1/chat/completions",
                            json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
                        )
                        assert r.status_code == 200 and r.headers["x-pagoda-backend"] == server.url
                        assert r.content == b"".join(events[:2] + events[3:])  # the usage event hidden
                sent = json.loads(server.requests[0][1])
                assert sent["stream_options"] == {"include_usage": True}
                assert state.usage.snapshot()["anonymous"]["completion_tokens"] == 4
                assert server.connections == 1
            finally:
                await state.stop()

    run(loop_kind, main())
