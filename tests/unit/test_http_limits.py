"""Transport limits (`pagoda.server.http_limits`) on a real uvicorn server run in a thread with a tiny app:
header size and count (431), the body cap (413), header/body read deadlines (408), idle connections
closed, the connection cap (503) while existing connections keep working, one log line per condition."""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import select
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from pagoda.server.http_limits import (
    BodyLimitMiddleware,
    HttpLimits,
    _Notices,
    default_max_connections,
    quiet_accept_errors,
    raise_fd_limit,
)
from tests.conftest import read_http_response as read_response


async def echo_app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    """Answers {"path", "bytes"}: the body length it read."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.dumps({"path": scope["path"], "bytes": size}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
        }
    )
    await send({"type": "http.response.body", "body": body})


class ThreadServer:
    """uvicorn on the stdlib asyncio loop (as `pagoda serve` runs it), in a daemon thread."""

    def __init__(self, limits: HttpLimits):
        self.limits = limits
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: uvicorn.Server | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not (self.server and self.server.started):
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    async def _main(self) -> None:
        app = BodyLimitMiddleware(echo_app, self.limits.max_request_bytes)
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off", **self.limits.uvicorn_args()
        )
        self.server = uvicorn.Server(config)
        await self.server.serve()

    def stop(self) -> None:
        assert self.server is not None
        self.server.should_exit = True
        self.thread.join(10)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


LIMITS = HttpLimits(
    max_request_bytes=1 << 20,
    max_header_bytes=8192,
    max_header_count=32,
    header_timeout=0.6,
    body_timeout=0.6,
    idle_connection_timeout=0.6,
    keep_alive_timeout=0.6,
    max_connections=6,
)


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadServer]:
    srv = ThreadServer(LIMITS)
    yield srv
    srv.stop()


def send_until_answered(sock: socket.socket, pieces: Iterator[bytes]) -> None:
    """Send pieces until the server answers (it may refuse, and close, before it has read them all)."""
    for piece in pieces:
        readable, _, _ = select.select([sock], [], [], 0)
        if readable:
            return
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            return


def openai_error(status: int, headers: dict, body: bytes, expected: int) -> dict:
    assert status == expected, body
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == expected
    return error


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


# ---- headers -------------------------------------------------------------------------------------------
def test_small_request_passes(server: ThreadServer) -> None:
    response = httpx.post(server.url + "/x", content=b"abc")
    assert response.json() == {"path": "/x", "bytes": 3}


def test_big_header_is_431_naming_the_limit(server: ThreadServer) -> None:
    with server.connect() as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
        error = openai_error(*read_response(sock), 431)
    assert "8192" in error["message"] and "--max-header-bytes" in error["message"]


def test_unfinished_huge_header_is_refused_before_it_ends(server: ThreadServer) -> None:
    with server.connect() as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
        send_until_answered(sock, (b"a" * 4096 for _ in range(4096)))  # up to 16 MiB, never finished
        error = openai_error(*read_response(sock), 431)
    assert "--max-header-bytes" in error["message"]


def test_too_many_headers_is_431_naming_the_count(server: ThreadServer) -> None:
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(100))
    with server.connect() as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
        error = openai_error(*read_response(sock), 431)
    assert "101" in error["message"] and "32" in error["message"] and "--max-header-count" in error["message"]


def test_headers_at_the_limits_pass(server: ThreadServer) -> None:
    headers = {f"x-h{i}": "v" for i in range(25)} | {"x-pad": "a" * 6000}  # + httpx's own 5
    assert httpx.get(server.url + "/ok", headers=headers).status_code == 200


# ---- body --------------------------------------------------------------------------------------------
def test_declared_body_over_the_cap_is_413_before_it_is_sent(server: ThreadServer) -> None:
    with server.connect() as sock:
        sock.sendall(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 268435456\r\n\r\n"
        )
        status, headers, body = read_response(sock)  # answered with nothing of the body sent
        error = openai_error(status, headers, body, 413)
    assert "268435456" in error["message"] and str(1 << 20) in error["message"]
    assert error["type"] == "RequestTooLargeError" and headers["connection"] == "close"


def test_chunked_body_over_the_cap_is_413(server: ThreadServer) -> None:
    response = httpx.post(server.url + "/", content=(b"x" * 65536 for _ in range(64)))  # 4 MiB, chunked
    assert response.status_code == 413 and "--max-request-bytes" in response.json()["error"]["message"]
    response = httpx.post(server.url + "/", content=(b"x" * 65536 for _ in range(15)))  # within the cap
    assert response.json()["bytes"] == 15 * 65536


def test_body_at_the_cap_passes(server: ThreadServer) -> None:
    assert httpx.post(server.url + "/", content=b"x" * (1 << 20)).json()["bytes"] == 1 << 20


# ---- timeouts -------------------------------------------------------------------------------------------
def test_idle_connection_is_closed(server: ThreadServer) -> None:
    with server.connect() as sock:
        assert closed_within(sock, 3.0)
    with server.connect() as sock:
        sock.sendall(b"\r\n\r\n")  # blank lines begin no request
        assert closed_within(sock, 3.0)


def test_slow_headers_get_408(server: ThreadServer) -> None:
    with server.connect() as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        error = openai_error(*read_response(sock), 408)
        assert time.monotonic() - t0 < 3.0
    assert "--header-timeout" in error["message"]


def test_headers_trickled_after_an_idle_start_still_get_the_header_deadline() -> None:
    srv = ThreadServer(HttpLimits(header_timeout=0.5, idle_connection_timeout=30))
    try:
        with srv.connect() as sock:
            time.sleep(0.3)
            sock.sendall(b"GET / HTTP/1.1\r\n")  # the first byte ends the idle wait; the header deadline starts
            t0 = time.monotonic()
            error = openai_error(*read_response(sock), 408)
            assert 0.3 < time.monotonic() - t0 < 3.0
        assert "--header-timeout" in error["message"]
    finally:
        srv.stop()


def test_slow_body_gets_408(server: ThreadServer) -> None:
    with server.connect() as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
        error = openai_error(*read_response(sock), 408)
    assert "--body-timeout" in error["message"]


def test_idle_keep_alive_connection_is_closed_after_a_request(server: ThreadServer) -> None:
    with server.connect() as sock:
        sock.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[0] == 200
        t0 = time.monotonic()
        assert closed_within(sock, 3.0)
        assert time.monotonic() - t0 > 0.3
    with server.connect() as sock:
        sock.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[0] == 200
        time.sleep(0.3)
        sock.sendall(b"\r\n")  # cancels uvicorn's keep-alive timer, begins no request
        assert closed_within(sock, 3.0)


# ---- connections ------------------------------------------------------------------------------------------
def test_connections_over_the_cap_get_503_while_open_ones_work() -> None:
    srv = ThreadServer(HttpLimits(max_connections=4, keep_alive_timeout=30))
    idle = []
    try:
        with httpx.Client(base_url=srv.url) as client:
            assert client.get("/health").status_code == 200  # one open keep-alive connection
            idle = [srv.connect() for _ in range(3)]
            time.sleep(0.2)
            for _ in range(5):
                response = httpx.get(srv.url + "/health")
                assert response.status_code == 503, response.text
                error = response.json()["error"]
                assert "4" in error["message"] and error["type"] == "ServiceUnavailableError"
                assert response.headers["retry-after"] == "1"
            assert client.get("/health").status_code == 200  # the existing connection still works
            for sock in idle[:2]:
                sock.close()
            idle = idle[2:]
            time.sleep(0.2)
            assert httpx.get(srv.url + "/health").status_code == 200  # room again
    finally:
        for sock in idle:
            sock.close()
        srv.stop()


# ---- process setup and logging -------------------------------------------------------------------------
def test_fd_soft_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, 512)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        assert raise_fd_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if hard != resource.RLIM_INFINITY:
            assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_default_connection_cap_stays_below_the_fd_limit() -> None:
    assert default_max_connections(20000) == 20000 - 2048 - 256  # room for a burst of refused accepts
    assert default_max_connections(50_000) == 45_000
    assert default_max_connections(1024) == 512
    assert default_max_connections(10**7) == 65536


def test_a_condition_logs_one_line_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    notices = _Notices(interval=0.2)
    with caplog.at_level(logging.WARNING, logger="pagoda.server.http"):
        for _ in range(1000):
            notices.warn("k", "refused")
        time.sleep(0.25)
        notices.warn("k", "refused")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "refused" and len(lines) == 2 and "999 more" in lines[1]


def test_accept_failures_log_one_line_without_traceback(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    try:
        quiet_accept_errors(loop)
        with caplog.at_level(logging.DEBUG):
            for _ in range(2048):  # asyncio retries accept() up to the backlog per wake-up
                loop.call_exception_handler(
                    {
                        "message": "socket.accept() out of system resource",
                        "exception": OSError(24, "Too many open files"),
                    }
                )
            loop.call_exception_handler({"message": "something else"})
    finally:
        loop.close()
    accept = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(accept) == 1 and accept[0].exc_info is None and "Too many open files" in accept[0].getMessage()
    assert any(r.getMessage() == "something else" for r in caplog.records)  # other errors still reach asyncio


def test_serve_flags_build_the_limits() -> None:
    import argparse

    from pagoda.cli.args import config_from
    from pagoda.cli.serve import add_serve_args
    from pagoda.config.server import ServerConfig
    from pagoda.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_serve_args(parser)

    def limits_from(flags: list[str]) -> HttpLimits:
        return HttpLimits.from_server(config_from(parser.parse_args(flags), ServerConfig))

    limits = limits_from([])
    assert limits.max_request_bytes == 32 << 20 and limits.max_header_bytes == 64 << 10
    assert limits.max_header_count == 256 and limits.keep_alive_timeout == 75
    assert limits.max_connections == default_max_connections(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    limits = limits_from(
        [
            "--h11-max-incomplete-event-size",
            "4194304",
            "--h11-max-header-count",
            "10",
            "--max-connections",
            "7",
            "--idle-connection-timeout",
            "2",
        ]
    )
    assert (limits.max_header_bytes, limits.max_header_count, limits.max_connections) == (4194304, 10, 7)
    with pytest.raises(ConfigError, match="--body-timeout"):
        limits_from(["--body-timeout", "0"])
