"""Transport limits of the API server: what one connection or request may cost before the app sees it.

* the request body: `--max-request-bytes` (413), checked against Content-Length before any of it is
  read and counted as a chunked body streams in (`BodyLimitMiddleware`, pure ASGI);
* the request line and headers: `--max-header-bytes` and `--max-header-count` (431), counted as the
  bytes arrive, so an unfinished header costs at most the limit plus one socket read;
* slow and idle clients: a request's headers must arrive within `--header-timeout` of its first
  byte, its body within `--body-timeout` of its headers (408); a new connection that sends nothing
  is closed after `--idle-connection-timeout`, an idle one after a response after `--timeout-keep-alive`;
* connections: beyond `--max-connections` a new connection gets a 503 and is closed, instead of the
  process running out of file descriptors (the soft RLIMIT_NOFILE is raised to the hard limit, and
  the default cap stays below it with room for the process's other files and sockets).

The header, timeout and connection limits live in a subclass of uvicorn's httptools protocol
(`http_protocol`); its per-request work is a few attribute updates and, for bodies that do not arrive
in one read, one timer. Each refused condition logs one line per `NOTICE_INTERVAL_S` (with a count of
the ones since), and so do accept() failures, which asyncio would otherwise log with a traceback per
attempt, up to the listen backlog (2048) of attempts each time the socket wakes it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

from pagoda import envs
from pagoda.config.server import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_IDLE_CONNECTION_TIMEOUT_S,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADER_COUNT,
    DEFAULT_MAX_REQUEST_BYTES,
    ServerConfig,
)
from pagoda.errors import ConfigError

logger = logging.getLogger("pagoda.server.http")

# The defaults of the limits are `ServerConfig`'s (config/server.py), the flags' own; these are the transport's.
MAX_DEFAULT_CONNECTIONS = 65536
LISTEN_BACKLOG = 2048  # uvicorn's default, which the serve paths keep
NOTICE_INTERVAL_S = 10.0


# ---- limits and process setup ---------------------------------------------------------------------
def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (allowed without privileges); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:  # Linux refuses a soft limit above this
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft == resource.RLIM_INFINITY:
        return target
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def default_max_connections(fd_limit: int) -> int:
    """Connections one API process accepts. The rest of the descriptors stay for the process's own files,
    the engine's sockets and media downloads, and for refused connections until they are closed: asyncio
    accepts up to the listen backlog of them at once. So: below the limit by a tenth of it, or by the
    backlog plus 256, whichever is more, but at least half of it."""
    reserve = max(fd_limit // 10, LISTEN_BACKLOG + 256)
    return max(1, min(MAX_DEFAULT_CONNECTIONS, max(fd_limit // 2, fd_limit - reserve)))


@dataclass(frozen=True)
class HttpLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_header_count: int = DEFAULT_MAX_HEADER_COUNT
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    idle_connection_timeout: float = DEFAULT_IDLE_CONNECTION_TIMEOUT_S
    keep_alive_timeout: float = envs.HTTP_TIMEOUT_KEEP_ALIVE.default
    max_connections: int = MAX_DEFAULT_CONNECTIONS

    @classmethod
    def from_server(cls, server: ServerConfig) -> HttpLimits:
        """The limits `pagoda serve`'s flags set; raises the descriptor limit (the default connection cap
        follows it)."""
        fd_limit = raise_fd_limit()
        max_connections = server.max_connections
        if max_connections is None:
            max_connections = default_max_connections(fd_limit)
        keep_alive = server.timeout_keep_alive
        assert keep_alive is not None  # ServerConfig resolves it when it is built
        limits = cls(
            max_request_bytes=server.max_request_bytes,
            max_header_bytes=server.max_header_bytes,
            max_header_count=server.max_header_count,
            header_timeout=server.header_timeout,
            body_timeout=server.body_timeout,
            idle_connection_timeout=server.idle_connection_timeout,
            keep_alive_timeout=keep_alive,
            max_connections=max_connections,
        )
        for flag, value in (
            ("--max-request-bytes", limits.max_request_bytes),
            ("--max-header-bytes", limits.max_header_bytes),
            ("--max-header-count", limits.max_header_count),
            ("--header-timeout", limits.header_timeout),
            ("--body-timeout", limits.body_timeout),
            ("--idle-connection-timeout", limits.idle_connection_timeout),
            ("--timeout-keep-alive", limits.keep_alive_timeout),
            ("--max-connections", limits.max_connections),
        ):
            if not value > 0:
                raise ConfigError(f"{flag} must be positive (got {value}).")
        if max_connections >= fd_limit:
            logger.warning(
                "--max-connections %d is not below the file-descriptor limit (%d): connections beyond "
                "about %d will fail to be accepted instead of getting a 503; raise `ulimit -n`.",
                max_connections,
                fd_limit,
                fd_limit,
            )
        return limits

    def uvicorn_args(self) -> dict[str, Any]:
        """Arguments for `uvicorn.Config`. Call it on the serving event loop: it also makes that loop log
        accept() failures as one rate-limited line."""
        quiet_accept_errors(asyncio.get_running_loop())
        return {"http": http_protocol(self), "timeout_keep_alive": self.keep_alive_timeout}


# ---- one line per condition -------------------------------------------------------------------------
class _Notices:
    def __init__(self, interval: float = NOTICE_INTERVAL_S):
        self.interval = interval
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def warn(self, key: str, message: str, level: int = logging.WARNING) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._since[key] = self._since.get(key, 0) + 1
            return
        self._last[key] = now
        more = self._since.pop(key, 0)
        since = f" ({more} more in the last {now - last:.0f} s)" if more and last is not None else ""
        logger.log(level, "%s%s", message, since)


notices = _Notices()


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == "socket.accept() out of system resource":
            exc = context.get("exception")
            notices.warn(
                "accept",
                f"Cannot accept new connections: {exc} (descriptor limit "
                f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}); lower --max-connections "
                "or raise `ulimit -n`",
                logging.ERROR,
            )
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


# ---- responses written without the app ----------------------------------------------------------------
def error_body(status: int, message: str, error_type: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": error_type, "param": param, "code": status}}).encode()


_REASONS = {
    408: b"Request Timeout",
    413: b"Content Too Large",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}
_ERROR_TYPES = {
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    431: "RequestHeaderFieldsTooLargeError",
    503: "ServiceUnavailableError",
}


def raw_error_response(status: int, message: str, retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for the protocol to write itself."""
    body = error_body(status, message, _ERROR_TYPES[status])
    extra = b"retry-after: %d\r\n" % retry_after if retry_after is not None else b""
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n%s\r\n"
        % (status, _REASONS[status], len(body), extra)
        + body
    )


# ---- the request body ------------------------------------------------------------------------------------
class BodyLimitMiddleware:
    """413 for a body over `limit`: at once from Content-Length (nothing of it is read), or while a
    chunked body streams in (read here, then replayed to the app). Requests with a Content-Length
    within the limit pass through untouched: the HTTP parser stops the body at that length."""

    def __init__(self, app: Any, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    break
                if declared > self.limit:
                    await self._too_large(
                        send,
                        f"The request body is {declared} bytes; this server accepts at most "
                        f"{self.limit} bytes (--max-request-bytes).",
                    )
                    return
                break
            if name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if not chunked:
            await self.app(scope, receive, send)
            return
        parts: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left while sending the body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                parts.clear()
                await self._too_large(
                    send,
                    f"The request body exceeds {self.limit} bytes, the most this server accepts (--max-request-bytes).",
                )
                return
            parts.append(chunk)
            more = message.get("more_body", False)
        body: list[bytes] | None = [b"".join(parts)]

        async def replay() -> Any:
            nonlocal body
            if body is not None:
                message, body = {"type": "http.request", "body": body[0], "more_body": False}, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Any, message: str) -> None:
        notices.warn("body", f"Refused a request body over --max-request-bytes {self.limit} (413)")
        payload = error_body(413, message, _ERROR_TYPES[413])
        # Connection: close makes the server stop reading the rest of the body.
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(payload)),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})


# ---- headers, timeouts, connections ----------------------------------------------------------------
class _Refusal(Exception):
    """Raised in a parser callback to stop parsing; `data_received` answers it."""

    def __init__(self, status: int, message: str, key: str, notice: str):
        super().__init__(message)
        self.status, self.message, self.key, self.notice = status, message, key, notice


def http_protocol(limits: HttpLimits) -> type:
    """uvicorn's httptools protocol class with `limits` applied (passed as `uvicorn.Config(http=...)`)."""
    import httptools  # lazy: optional (httptools); only serving needs it, pagoda.config imports this module
    from uvicorn.protocols.http.flow_control import FlowControl  # lazy: uvicorn, only when serving
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # lazy: uvicorn + httptools, serving only

    max_header_bytes, max_header_count = limits.max_header_bytes, limits.max_header_count
    header_timeout, body_timeout, max_connections = limits.header_timeout, limits.body_timeout, limits.max_connections
    idle_timeout = limits.idle_connection_timeout

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._refused = False
            self._in_message = False  # between the first byte of a request and its end
            self._in_head = True  # before a request's headers are complete (or between requests)
            self._head_bytes = 0  # received while _in_head: bounds an unfinished request line/header
            self._timer: asyncio.TimerHandle | None = None  # the header or body deadline
            self._idle_timer: asyncio.TimerHandle | None = None  # until the connection's first byte

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections:
                self.transport, self.flow, self._refused = transport, FlowControl(transport), True
                notices.warn(
                    "connections",
                    f"Refused new connections: {len(self.connections)} open, --max-connections {max_connections} (503)",
                )
                transport.write(
                    raw_error_response(
                        503,
                        f"The server has too many open connections ({max_connections}); retry later.",
                        retry_after=1,
                    )
                )
                transport.close()
                return
            super().connection_made(transport)
            self._idle_timer = self.loop.call_later(idle_timeout, self._idle)

        def connection_lost(self, exc: Exception | None) -> None:
            for timer in (self._timer, self._idle_timer):
                if timer is not None:
                    timer.cancel()
            self._timer = self._idle_timer = None
            super().connection_lost(exc)

        def _idle(self) -> None:
            self._idle_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_head:
                self._head_bytes += len(data)
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserCallbackError as exc:
                refusal = exc.__context__
                if isinstance(refusal, _Refusal):
                    self._refuse(refusal.status, refusal.message, refusal.key, refusal.notice)
                else:
                    self._invalid_request()
                return
            except httptools.HttpParserError:
                self._invalid_request()
                return
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return
            if self._in_message:
                if self._in_head and self._head_bytes > max_header_bytes:
                    self._refuse_header_bytes(self._head_bytes)
                elif self._timer is None:
                    self._timer = self.loop.call_later(
                        header_timeout if self._in_head else body_timeout, self._read_timeout
                    )
            elif self._head_bytes > max_header_bytes:
                self._refuse_header_bytes(self._head_bytes)
            elif self.timeout_keep_alive_task is None and self.cycle is not None and self.cycle.response_complete:
                # Bytes that began no request (blank lines) cancelled the keep-alive timer: arm it again.
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

        def _invalid_request(self) -> None:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")

        def on_message_begin(self) -> None:
            self._in_message = True
            if self._idle_timer is not None:  # the first request begins (blank lines do not count)
                self._idle_timer.cancel()
                self._idle_timer = None
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if len(self.headers) > max_header_count:
                raise _Refusal(
                    431,
                    f"The request has {len(self.headers)} header fields; this server accepts at most "
                    f"{max_header_count} (--max-header-count).",
                    "header-count",
                    f"Refused requests over --max-header-count {max_header_count} (431)",
                )
            if self._head_bytes > max_header_bytes:
                # What was counted includes whatever followed the headers in the same read: measure them.
                size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
                if size > max_header_bytes:
                    self._header_bytes_refusal(size)
            self._in_head, self._head_bytes = False, 0
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._in_message, self._in_head, self._head_bytes = False, True, 0
            super().on_message_complete()

        def _header_bytes_refusal(self, size: int) -> None:
            raise _Refusal(
                431,
                f"The request line and headers exceed {max_header_bytes} bytes ({size} received), "
                "the most this server accepts (--max-header-bytes).",
                "header-bytes",
                f"Refused requests over --max-header-bytes {max_header_bytes} (431)",
            )

        def _refuse_header_bytes(self, size: int) -> None:
            try:
                self._header_bytes_refusal(size)
            except _Refusal as refusal:
                self._refuse(refusal.status, refusal.message, refusal.key, refusal.notice)

        def _read_timeout(self) -> None:
            self._timer = None
            if self._refused or self.transport.is_closing() or not self._in_message:
                return
            if self._in_head:
                if self.cycle is not None and not self.cycle.response_complete:
                    return  # a pipelined request's head during a response: the keep-alive timer follows it
                self._refuse(
                    408,
                    f"The request headers did not arrive within {header_timeout:g} s (--header-timeout).",
                    "header-timeout",
                    f"Closed connections whose request headers took over --header-timeout {header_timeout:g} s (408)",
                )
            else:
                self._refuse(
                    408,
                    f"The request body did not arrive within {body_timeout:g} s of its headers (--body-timeout).",
                    "body-timeout",
                    f"Closed connections whose request body took over --body-timeout {body_timeout:g} s (408)",
                )

        def _refuse(self, status: int, message: str, key: str, notice: str) -> None:
            self._refused = True
            notices.warn(key, notice)
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                if cycle.response_started:
                    self.transport.close()
                    return
                # The app may be waiting for the body: it now reads a disconnect, and writes nothing.
                cycle.disconnected = True
                cycle.message_event.set()
            self.transport.write(raw_error_response(status, message))
            self.transport.close()

    return LimitedHttpToolsProtocol
