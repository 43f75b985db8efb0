"""The router's upstream HTTP/1.1 client: an httpx transport built on asyncio protocols and httptools.

Why not httpx's own transport: relaying a token stream is one small body chunk per token, and each chunk
read through httpcore goes through anyio (a cancel scope and timeout per read), h11's pure-Python parser
and four layers of async iterators. That was most of the router's CPU per relayed event. Here the
socket's data goes straight into httptools' C parser inside `data_received`, and the relay loop takes
whatever body bytes have arrived since it last looked (the bytes of one or more socket reads, joined: the
same bytes in the same order as httpx's `aiter_raw`, never held back).

It is an `httpx.AsyncBaseTransport`, so the proxy still builds `httpx.Request`s, gets `httpx.Response`s and
sees httpx's exceptions (ConnectError, ConnectTimeout, ReadTimeout, PoolTimeout, ReadError, WriteError,
RemoteProtocolError), exactly as with `httpx.AsyncHTTPTransport`, which remains in use for https:// backends.

Timeouts: httpx's connect, write and pool, and two for reading: until the first body byte (the `first_byte` key
of the timeout extension: a backend computes a whole non-streamed answer, or a stream's first event, before
sending it) and between reads after it (`read`); both raise ReadTimeout.

Semantics kept from httpcore's pool: one pool per (host, port), at most `max_connections` connections,
idle ones reused most-recent-first and dropped after `keepalive_expiry` s; a connection whose response was
not read to the end is closed (so the backend sees the client leave and aborts the request); a server that
closes a kept-alive connection before answering gives RemoteProtocolError (retried elsewhere by the proxy
without blame). Body chunks are buffered up to 256 KiB per response, then the socket stops being read until
the relay catches up (backpressure from a slow client reaches the backend as with httpx).
"""

from __future__ import annotations

import asyncio
import collections
import socket
from typing import Any

import httpx

try:
    import httptools
except ImportError:  # pragma: no cover - a dependency; without it the router uses httpx's transport
    httptools = None

_HIGH_WATER = 256 * 1024  # body bytes buffered per response before the socket is paused
# The request's timeout extension may carry this key besides httpx's four: the read timeout until the first body
# byte (the response head included). httpx's "read" then applies between reads after it.
FIRST_BYTE = "first_byte"


class _Connection(asyncio.Protocol):
    """One upstream HTTP/1.1 connection; at most one request on it at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.active = False  # a request is on it
        self._write_paused = False
        self._drain: asyncio.Future | None = None
        self._reset_exchange()

    def _reset_exchange(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False  # status line and headers parsed
        self.done = False  # response complete
        self.keep_alive = False
        self.error: Exception | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.read_paused = False
        self.waiter: asyncio.Future | None = None
        self.until_close = False  # body delimited by the connection closing (no length, not chunked)

    # -- asyncio.Protocol ----------------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):  # pragma: no cover
                pass

    def data_received(self, data: bytes) -> None:
        if not self.active or self.done:
            # bytes nobody asked for (after a complete response, or on an idle connection): not reusable
            self.closed = True
            self.transport.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"Malformed response from the backend: {exc}"))
            self.transport.close()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if not self.active or self.done:
            return
        if self.head_done and self.until_close and exc is None:
            self.done = True
            self._wake()
        elif exc is not None:
            self._fail(httpx.ReadError(str(exc) or type(exc).__name__))
        elif self.head_done:
            self._fail(httpx.RemoteProtocolError("peer closed connection without sending complete message body"))
        else:
            self._fail(httpx.RemoteProtocolError("Server disconnected without sending a response."))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- httptools callbacks -------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim response (e.g. 100 Continue): wait for the real one
            self.headers = []
            return
        self.status = status
        self.head_done = True
        chunked = length = False
        for name, value in self.headers:
            lname = name.lower()
            if lname == b"content-length":
                length = True
            elif lname == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        self.until_close = not (length or chunked)
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.head_done:  # the end of an interim response
            return
        self.done = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # -- for the transport and the body stream -------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    async def wait(self, timeout: float | None) -> None:
        """Until something happens on the exchange (head, body bytes, end, error)."""
        self.waiter = self.loop.create_future()
        await _wait(self.waiter, timeout, httpx.ReadTimeout, "Timed out waiting for the backend")

    def take(self) -> bytes:
        """Every body byte buffered so far, in one piece."""
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self.read_paused and not self.closed:
            self.read_paused = False
            self.transport.resume_reading()
        return data

    async def write(self, data: bytes, timeout: float | None) -> None:
        if self.closed:
            raise httpx.RemoteProtocolError("Server disconnected before the request was sent.")
        self.transport.write(data)
        if self._write_paused and not self.closed:
            self._drain = self.loop.create_future()
            try:
                await _wait(self._drain, timeout, httpx.WriteTimeout, "Timed out sending the request to the backend")
            finally:
                self._drain = None
            if self.closed and self.error is None and not self.head_done:
                raise httpx.WriteError("The backend closed the connection while the request was being sent.")

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Pool:
    """The connections to one (host, port)."""

    def __init__(self, host: str, port: int, max_connections: int, keepalive_expiry: float | None) -> None:
        self.host, self.port = host, port
        self.max_connections = max_connections
        self.expiry = keepalive_expiry
        self.idle: collections.deque[_Connection] = collections.deque()
        self.count = 0  # open connections, idle ones included
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self, timeouts: dict[str, Any]) -> _Connection:
        loop = asyncio.get_running_loop()
        while True:
            idle = self.idle
            if idle:
                if self.expiry is not None:
                    oldest_ok = loop.time() - self.expiry
                    while idle and idle[0].idle_since < oldest_ok:
                        self._drop(idle.popleft())
                while idle:
                    conn = idle.pop()
                    if conn.closed:
                        self._drop(conn)
                        continue
                    conn.active = True
                    return conn
            if self.count < self.max_connections:
                break
            waiter = loop.create_future()
            self.waiters.append(waiter)
            try:
                await _wait(
                    waiter, timeouts.get("pool"), httpx.PoolTimeout, "Timed out waiting for a connection to the backend"
                )
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken for a free slot but leaving: pass the turn on
                raise
            finally:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)
        self.count += 1
        try:
            conn = await self._connect(loop, timeouts.get("connect"))
        except OSError as exc:
            self._released()
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from None
        except BaseException:
            self._released()
            raise
        conn.active = True
        return conn

    async def _connect(self, loop: asyncio.AbstractEventLoop, timeout: float | None) -> _Connection:
        # Not asyncio.wait_for: on Python < 3.12 it can swallow a cancellation that races with the connect
        # completing, and a request whose client left would then go ahead.
        task = loop.create_task(loop.create_connection(lambda: _Connection(loop), self.host, self.port))
        try:
            done, _ = await asyncio.wait((task,), timeout=timeout)
        except BaseException:
            task.add_done_callback(_close_connected)
            task.cancel()
            raise
        if not done:
            task.add_done_callback(_close_connected)
            task.cancel()
            raise httpx.ConnectTimeout(f"Timed out connecting to {self.host}:{self.port}")
        return task.result()[1]

    def release(self, conn: _Connection) -> None:
        """The exchange on `conn` is over: keep the connection for the next request, or close it."""
        conn.active = False
        reusable = (
            conn.done
            and conn.keep_alive
            and conn.error is None
            and not conn.closed
            and not conn.chunks
            and not conn.read_paused
        )
        if reusable:
            conn.parser = httptools.HttpResponseParser(conn)
            conn._reset_exchange()
            conn.idle_since = asyncio.get_running_loop().time()
            self.idle.append(conn)
            self._wake_one()
        else:
            self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        self._released()

    def _released(self) -> None:
        self.count -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        while self.idle:
            self._drop(self.idle.pop())


class _Body(httpx.AsyncByteStream):
    __slots__ = ("closed", "conn", "first_timeout", "pool", "timeout")

    def __init__(self, conn: _Connection, pool: _Pool, first_timeout: float | None, timeout: float | None) -> None:
        self.conn, self.pool, self.first_timeout, self.timeout = conn, pool, first_timeout, timeout
        self.closed = False

    async def __aiter__(self) -> Any:
        conn = self.conn
        timeout = self.first_timeout  # until the first body byte; then between reads
        while True:
            if conn.chunks:
                yield conn.take()
                timeout = self.timeout
            elif conn.error is not None:
                raise conn.error
            elif conn.done:
                return
            else:
                await conn.wait(timeout)

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.release(self.conn)


class FastHTTPTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 to plain-http backends over asyncio protocols + httptools; https goes through httpx's transport."""

    def __init__(self, limits: httpx.Limits | None = None) -> None:
        limits = limits or httpx.Limits()
        self._limits = limits
        self._max = limits.max_connections if limits.max_connections is not None else 1 << 30
        self._expiry = limits.keepalive_expiry
        self._pools: dict[tuple[str, int], _Pool] = {}
        self._fallback: httpx.AsyncHTTPTransport | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        timeouts = request.extensions.get("timeout") or {}
        read_timeout = timeouts.get("read")
        first_timeout = timeouts.get(FIRST_BYTE, read_timeout)
        if url.scheme != "http" or httptools is None:
            if self._fallback is None:
                self._fallback = httpx.AsyncHTTPTransport(limits=self._limits)
            if first_timeout != read_timeout:  # httpcore has one timeout per read: the longer of the two
                longest = None if first_timeout is None or read_timeout is None else max(first_timeout, read_timeout)
                request.extensions = {**request.extensions, "timeout": {**timeouts, "read": longest}}
            return await self._fallback.handle_async_request(request)
        key = (url.host, url.port or 80)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(key[0], key[1], self._max, self._expiry)
        body = await _request_body(request)
        head = [request.method.encode("ascii"), b" ", url.raw_path, b" HTTP/1.1\r\n"]
        for name, value in request.headers.raw:
            head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n")
        head_bytes = b"".join(head)
        conn = await pool.acquire(timeouts)
        try:
            if len(body) <= 65536:
                await conn.write(head_bytes + body, timeouts.get("write"))
            else:
                await conn.write(head_bytes, timeouts.get("write"))
                await conn.write(body, timeouts.get("write"))
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(first_timeout)
        except BaseException:
            conn.close()
            pool.release(conn)
            raise
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=_Body(conn, pool, first_timeout, read_timeout),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        if self._fallback is not None:
            await self._fallback.aclose()


async def _wait(fut: asyncio.Future, timeout: float | None, error: type[Exception], message: str) -> None:
    """Await `fut`, failing it with error(message) after `timeout` s. Not asyncio.wait_for, which on Python
    < 3.12 can swallow a cancellation that arrives as `fut` completes."""
    if timeout is None:
        await fut
        return
    timer = fut.get_loop().call_later(timeout, _expire, fut, error, message)
    try:
        await fut
    finally:
        timer.cancel()


def _expire(fut: asyncio.Future, error: type[Exception], message: str) -> None:
    if not fut.done():
        fut.set_exception(error(message))


def _close_connected(task: asyncio.Task) -> None:
    """A connect that completed after its request gave up on it: close that connection."""
    if not task.cancelled() and task.exception() is None:
        task.result()[0].close()


async def _request_body(request: httpx.Request) -> bytes:
    """The request body as bytes; a streamed body is read first and sent with a Content-Length instead."""
    try:
        return request.content
    except httpx.RequestNotRead:
        pass
    data = b"".join([part async for part in request.stream])
    raw = [(k, v) for k, v in request.headers.raw if k.lower() not in (b"transfer-encoding", b"content-length")]
    raw.append((b"Content-Length", str(len(data)).encode()))
    request.headers = httpx.Headers(raw)
    return data
