"""The hot path: POST /v1/chat/completions and /v1/completions, as a raw ASGI handler.

Per request: read the body (413 beyond --max-request-bytes), parse the JSON once (session key, model,
stream flag), optionally ask a stream for usage, wait in the long-request queue if the message text is
long, pick backends (policy.Balancer), then send upstream.

- Upstream: one connection pool per backend, an httpx transport (upstream.FastHTTPTransport: asyncio
  protocols + httptools; httpx's own for https), requests sent through it directly (see
  RouterState.upstream_for for why not AsyncClient.send).
- Retries: a connection error or timeout, or a 502/503/504 status, before anything was sent to the
  client marks the backend failed (circuit breaker) and the request goes to the next backend in the
  plan (ring order), up to --max-attempts. A non-streamed answer is read whole (up to 16 MiB) before any
  of it is sent, so one whose body stalls or breaks is retried too (and never reaches a client as a 200
  with half a body; when no backend answers whole, the client gets a 502, or a 504 when they all timed
  out). Once our status line is sent nothing is retried.
- Timeouts: --first-byte-timeout until the backend's first body byte (a stream's first event, or the whole
  answer of a request that does not stream), --read-timeout between reads after it. A stream that stalls
  or breaks mid-way counts against the backend's breaker and ends with an SSE error event (OpenAI error
  JSON, 504 or 502) and no [DONE].
- Passthrough: our status line and headers go out only when the upstream status is known (so errors
  pass through as the backend's own JSON with its status); a stream's body is forwarded as it arrives:
  the bytes read from the socket since the last send go out in one piece (never held back, never split),
  with `X-Accel-Buffering: no`.
  Every response carries `X-Pagoda-Backend` (the backend's name; "router" when the router answered).
- Accounting: a request's metrics and usage are recorded before its last byte is sent (router --workers N:
  another worker reading the shared metric files right after the client got its answer sees them).
- Disconnects: a watcher task waits for `http.disconnect` and cancels the handler; closing the
  half-read upstream response closes that connection, so the backend aborts the request and frees
  its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import httpx

from pagoda.tools.router.policy import prefix_key, request_chars, session_key
from pagoda.tools.router.usage import SSEUsageTap, _loads, tokens_of, usage_of_json

logger = logging.getLogger("pagoda.tools.router")

PROXY_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
RETRY_STATUSES = frozenset({502, 503, 504})
# Hop-by-hop and per-connection headers: never forwarded either way. accept-encoding is replaced by
# identity so that usage can be read from the bytes; authorization is set per backend.
_UP_SKIP = frozenset(
    {
        b"host",
        b"content-length",
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authorization",
        b"proxy-connection",
        b"accept-encoding",
        b"authorization",
        b"expect",
    }
)
_DOWN_SKIP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authenticate",
        b"proxy-connection",
        b"date",
        b"server",
    }
)
_MAX_BUFFERED = 16 * 1024 * 1024  # a non-streamed answer up to this size is read whole before any of it is sent


def error_body(status: int, message: str, error_type: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": error_type, "param": param, "code": status}}).encode()


async def send_error(
    send: Any, status: int, message: str, error_type: str, extra_headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = error_body(status, message, error_type)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-pagoda-backend", b"router"),
        *(extra_headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


_USAGE_OPTION = b'"stream_options":{"include_usage":true},'


def _with_usage_option(raw: bytes, body: dict[str, Any], absent: bool) -> bytes:
    """The body asking for stream usage. When the client sent no stream_options, the member is spliced in after
    the opening brace (the client's bytes otherwise unchanged, and no re-encoding of a large body)."""
    if absent:
        start = len(raw) - len(raw.lstrip())
        if raw[start : start + 1] == b"{":
            rest = raw[start + 1 :].lstrip()
            return raw[: start + 1] + (_USAGE_OPTION if rest[:1] != b"}" else _USAGE_OPTION[:-1]) + raw[start + 1 :]
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


class _Flags:
    __slots__ = ("disconnected", "done")

    def __init__(self) -> None:
        self.done = False
        self.disconnected = False


class _Reject(Exception):
    def __init__(self, status: int, reason: str, message: str, error_type: str):
        self.status, self.reason, self.message, self.error_type = status, reason, message, error_type


class ProxyHandler:
    def __init__(self, state: Any):
        self.state = state  # app.RouterState

    async def __call__(self, scope: Any, receive: Any, send: Any, label: str) -> None:
        state = self.state
        t0 = time.perf_counter()
        try:
            raw = await self._read_body(scope, receive, state.config.max_request_bytes)
            if raw is None:
                return  # the client left while sending the body
            try:
                body = _loads(raw)
            except ValueError as exc:
                raise _Reject(
                    400, "bad_request", f"The request body is not valid JSON: {exc}", "BadRequestError"
                ) from None
            if not isinstance(body, dict):
                raise _Reject(400, "bad_request", "The request body must be a JSON object.", "BadRequestError")
        except _Reject as rej:
            state.metrics.child(state.metrics.rejected, rej.reason).inc()
            await send_error(send, rej.status, rej.message, rej.error_type)
            return

        flags = _Flags()
        task = asyncio.current_task()
        watcher = asyncio.ensure_future(self._watch(receive, task, flags))
        try:
            await self._serve(scope, send, label, raw, body, flags, t0)
        except asyncio.CancelledError:
            if not flags.disconnected:
                raise
            if task is not None and hasattr(task, "uncancel"):
                task.uncancel()
        finally:
            watcher.cancel()

    @staticmethod
    async def _read_body(scope: Any, receive: Any, limit: int) -> bytes | None:
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    raise _Reject(
                        413,
                        "too_large",
                        f"The request body is {declared} bytes; this router accepts "
                        f"at most {limit} (--max-request-bytes).",
                        "RequestTooLargeError",
                    )
        parts, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _Reject(
                    413,
                    "too_large",
                    f"The request body exceeds {limit} bytes (--max-request-bytes).",
                    "RequestTooLargeError",
                )
            parts.append(chunk)
            more = message.get("more_body", False)
        return b"".join(parts) if len(parts) != 1 else parts[0]

    @staticmethod
    async def _watch(receive: Any, task: Any, flags: _Flags) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not flags.done:
                    flags.disconnected = True
                    task.cancel()
                return

    async def _serve(
        self, scope: Any, send: Any, label: str, raw: bytes, body: dict[str, Any], flags: _Flags, t0: float
    ) -> None:
        state = self.state
        cfg = state.config
        metrics = state.metrics
        stream = body.get("stream") is True

        if cfg.policy == "session":
            header = None
            wanted = state.session_header_bytes
            for name, value in scope["headers"]:
                if name == wanted:
                    header = value.decode("latin-1").strip()
                    break
            key, source = session_key(body, header)
        elif cfg.policy == "prefix":
            key, source = prefix_key(body, cfg.prefix_chars)
        else:
            key, source = None, "none"
        metrics.child(metrics.key_source, source).inc()

        drop_usage = False
        if stream and cfg.inject_usage:
            options = body.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage")):
                absent = "stream_options" not in body
                body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
                raw = _with_usage_option(raw, body, absent)
                drop_usage = True

        queue = None
        if cfg.long_request_chars and request_chars(body) > cfg.long_request_chars:
            queue = state.long_queue
            await queue.acquire()
        try:
            await self._forward(scope, send, label, raw, body, key, drop_usage, flags, t0)
        finally:
            if queue is not None:
                queue.release()

    def _candidates(self, model: Any) -> list[Any]:
        backends = self.state.backends
        if isinstance(model, str) and any(b.models is not None and model in b.models for b in backends):
            return [b for b in backends if b.serves(model)]
        return backends

    async def _forward(
        self,
        scope: Any,
        send: Any,
        label: str,
        raw: bytes,
        body: dict[str, Any],
        key: str | None,
        drop_usage: bool,
        flags: _Flags,
        t0: float,
    ) -> None:
        state = self.state
        cfg = state.config
        metrics = state.metrics
        path = scope["path"]
        endpoint = PROXY_PATHS[path]
        plan = state.balancer.plan(key, self._candidates(body.get("model")))
        if not plan.order:
            metrics.child(metrics.rejected, "no_backend").inc()
            flags.done = True
            await send_error(send, 503, "No backend is configured.", "ServiceUnavailableError")
            return
        base_headers = [(k, v) for k, v in scope["headers"] if k not in _UP_SKIP]
        base_headers.append((b"accept-encoding", b"identity"))
        client_auth = None
        if not cfg.api_keys:
            client_auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)

        response: httpx.Response | None = None
        backend = None
        buffered: _Buffered | None = None
        failures: list[str] = []
        timeouts = 0
        last_failed: tuple[Any, httpx.Response, bytes] | None = None
        attempts = plan.order[: cfg.max_attempts]
        for i, candidate in enumerate(attempts):
            if i:
                metrics.child(metrics.retries, attempts[i - 1].name).inc()
            headers = list(base_headers)
            backend_key = candidate.cfg.api_key or cfg.backend_api_key
            if backend_key:
                headers.append((b"authorization", b"Bearer " + backend_key.encode()))
            elif client_auth is not None:
                headers.append((b"authorization", client_auth))
            candidate.inflight += 1
            trial = candidate.breaker.begin_attempt()
            handed_over = False
            try:
                request = httpx.Request(
                    "POST",
                    candidate.endpoint_url(path),
                    content=raw,
                    headers=headers,
                    extensions=state.timeout_extension,
                )
                try:
                    upstream = await state.upstream_for(candidate).handle_async_request(request)
                except httpx.TransportError as exc:
                    # Connect errors and timeouts count against the backend; a connection dropped under the request
                    # (e.g. a keep-alive race) is retried elsewhere without blame -- if the backend is really
                    # gone, the next connect fails and counts.
                    dropped = isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError))
                    kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "dropped" if dropped else "connect"
                    if not dropped:
                        candidate.breaker.record_failure()
                    timeouts += kind == "timeout"
                    metrics.child(metrics.errors, candidate.name, kind).inc()
                    failures.append(f"{candidate.name}: {self._failure(exc)}")
                    continue
                if upstream.status_code in RETRY_STATUSES:
                    try:
                        content = await upstream.aread()
                    except httpx.TransportError:
                        content = b""
                    finally:
                        await upstream.aclose()
                    candidate.breaker.record_failure()
                    metrics.child(metrics.errors, candidate.name, f"http_{upstream.status_code}").inc()
                    failures.append(f"{candidate.name}: HTTP {upstream.status_code}")
                    last_failed = (candidate, upstream, content)
                    continue
                answer = None
                if not _is_sse(upstream):
                    # A non-streamed answer is read whole before any of it is sent: one whose body stalls or breaks
                    # (a cut or malformed chunked body) still goes to the next backend, and no client gets a 200
                    # with half a body.
                    answer = _Buffered()
                    try:
                        await answer.read(upstream)
                    except BaseException as exc:
                        await upstream.aclose()
                        if not isinstance(exc, httpx.TransportError):
                            raise
                        candidate.breaker.record_failure()
                        kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "broken_body"
                        timeouts += kind == "timeout"
                        metrics.child(metrics.errors, candidate.name, kind).inc()
                        failures.append(f"{candidate.name}: {self._failure(exc, answer.first_at is not None)}")
                        continue
                buffered = answer
                if upstream.status_code >= 500:
                    if trial:
                        candidate.breaker.release()
                elif buffered is not None:
                    candidate.breaker.record_success()
                # A stream's verdict comes at its end (_relay; a half-open trial's at its first event): one that
                # stalls after its headers must count as a failure, not as a success followed by a failure.
                response, backend, handed_over = upstream, candidate, True
                break
            finally:
                if not handed_over:
                    candidate.inflight -= 1
                    if trial and candidate.breaker.trial_in_flight:
                        candidate.breaker.release()

        if response is None or backend is None:
            if last_failed is not None:  # every attempt answered 502/503/504: pass the last answer through
                failed_backend, upstream, content = last_failed
                headers = self._down_headers(upstream, failed_backend, False, False)
                metrics.child(metrics.requests, failed_backend.name, endpoint, str(upstream.status_code)).inc()
                flags.done = True
                await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers})
                await send({"type": "http.response.body", "body": content, "more_body": False})
                return
            status, error_type = (504, "GatewayTimeoutError") if timeouts == len(failures) else (502, "BadGatewayError")
            metrics.child(metrics.requests, "none", endpoint, str(status)).inc()
            flags.done = True
            await send_error(
                send,
                status,
                f"No backend could take the request ({len(failures)} tried): " + "; ".join(failures),
                error_type,
            )
            return
        await self._relay(send, response, backend, plan, endpoint, label, drop_usage, flags, t0, buffered, trial)

    def _failure(self, exc: Exception, body_started: bool = False) -> str:
        """What went wrong with one attempt, for the client's error message."""
        cfg = self.state.config
        if isinstance(exc, httpx.ConnectTimeout):
            return f"no connection within {cfg.connect_timeout:g} s (--connect-timeout)"
        if isinstance(exc, httpx.ReadTimeout):
            if body_started:
                return f"its answer stopped for {cfg.read_timeout:g} s (--read-timeout)"
            return f"no answer within {cfg.first_byte_timeout:g} s (--first-byte-timeout)"
        return f"{type(exc).__name__}{': ' + str(exc) if str(exc) else ''}"

    def _down_headers(
        self, upstream: httpx.Response, backend: Any, is_sse: bool, drop_usage: bool
    ) -> list[tuple[bytes, bytes]]:
        headers = []
        for name, value in upstream.headers.raw:
            name = name.lower()
            if name in _DOWN_SKIP or (drop_usage and name == b"content-length"):
                continue
            headers.append((name, value))
        headers.append((b"x-pagoda-backend", backend.name_bytes))
        if is_sse:
            present = {n for n, _ in headers}
            if b"x-accel-buffering" not in present:
                headers.append((b"x-accel-buffering", b"no"))
            if b"cache-control" not in present:
                headers.append((b"cache-control", b"no-cache"))
        return headers

    async def _relay(
        self,
        send: Any,
        upstream: httpx.Response,
        backend: Any,
        plan: Any,
        endpoint: str,
        label: str,
        drop_usage: bool,
        flags: _Flags,
        t0: float,
        buffered: _Buffered | None,
        trial: bool,
    ) -> None:
        """Send the chosen backend's answer: a buffered one at once, a stream as it arrives. Everything this
        request counts (metrics, usage) is recorded before its last byte is sent, so a client that has read
        its whole answer finds it in /metrics and /usage, whichever router worker it asks."""
        metrics = self.state.metrics
        status = upstream.status_code
        is_sse = buffered is None
        tap = SSEUsageTap(drop_usage) if is_sse else None
        accounted = False
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": self._down_headers(upstream, backend, is_sse, drop_usage),
                }
            )
            if buffered is not None:
                if buffered.first_at is not None:
                    metrics.child(metrics.ttfb, backend.name).observe(buffered.first_at - t0)
                if buffered.rest is None:  # the whole answer
                    usage = usage_of_json(buffered.data) if status == 200 else None
                    accounted = self._account(backend, plan, endpoint, label, status, t0, upstream, usage)
                    flags.done = True
                    await send({"type": "http.response.body", "body": buffered.data, "more_body": False})
                    return
                # Larger than the buffer: the rest is passed through as it comes (and cut if the backend fails now).
                await send({"type": "http.response.body", "body": buffered.data, "more_body": True})
                try:
                    async for chunk in buffered.rest:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except httpx.TransportError as exc:
                    self._cut(backend, exc, False)
                    status = 502
                    return  # the connection is closed under the client: a truncated body cannot pass for whole
                accounted = self._account(backend, plan, endpoint, label, status, t0, upstream, None)
                flags.done = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            first = True
            tail = b""
            try:
                # The transport's byte stream itself: Response.aiter_raw only adds a generator layer per chunk
                # (the same bytes; aclose in `finally` below releases the connection either way).
                async for chunk in upstream.stream:
                    if first:
                        metrics.child(metrics.ttfb, backend.name).observe(time.perf_counter() - t0)
                        first = False
                        if trial:  # a half-open trial that streams: the backend is back (no wait for its end)
                            backend.breaker.record_success()
                    chunk = tap.feed(chunk)
                    if chunk:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                tail = tap.flush()
                if status < 500:
                    backend.breaker.record_success()
            except httpx.TransportError as exc:
                # The backend broke or went silent mid-stream: too late to retry. The client gets an error event
                # and no [DONE], so that it cannot take the answer for complete.
                status, error_type, message = self._cut(backend, exc, first)
                tail = b"data: " + error_body(status, message, error_type) + b"\n\n"
            accounted = self._account(backend, plan, endpoint, label, status, t0, upstream, tap.usage)
            flags.done = True
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        except asyncio.CancelledError:
            if flags.disconnected:
                metrics.child(metrics.disconnects, backend.name).inc()
            raise
        finally:
            await upstream.aclose()
            backend.inflight -= 1
            if trial and backend.breaker.trial_in_flight:  # a half-open trial without a verdict (the client left)
                backend.breaker.release()
            if not accounted:  # the client left, or the answer was cut: no usage to count
                self._account(backend, plan, endpoint, None, status, t0, upstream, None)

    def _account(
        self,
        backend: Any,
        plan: Any,
        endpoint: str,
        label: str | None,
        status: int,
        t0: float,
        upstream: httpx.Response,
        usage: Any,
    ) -> bool:
        """Record one answered request; its usage too unless `label` is None (the answer did not reach its end)."""
        state = self.state
        metrics = state.metrics
        metrics.child(metrics.requests, backend.name, endpoint, str(status)).inc()
        metrics.child(metrics.latency, backend.name).observe(time.perf_counter() - t0)
        metrics.child(
            metrics.affinity,
            backend.name,
            "none" if plan.owner is None else "hit" if backend.name == plan.owner else "miss",
        ).inc()
        if label is not None and upstream.status_code == 200:
            state.record_usage(label, tokens_of(usage))
        return True

    def _cut(self, backend: Any, exc: httpx.TransportError, before_first: bool) -> tuple[int, str, str]:
        """A backend that failed after its answer started: it counts against its breaker. Returns the status,
        error type and message for the client."""
        metrics = self.state.metrics
        cfg = self.state.config
        backend.breaker.record_failure()
        if isinstance(exc, httpx.TimeoutException):
            metrics.child(metrics.errors, backend.name, "timeout").inc()
            if before_first:
                limit = f"{cfg.first_byte_timeout:g} s (--first-byte-timeout)"
            else:
                limit = f"{cfg.read_timeout:g} s (--read-timeout)"
            logger.warning("backend %s sent nothing for %s; ending its stream", backend.name, limit)
            return 504, "GatewayTimeoutError", f"The backend {backend.name} sent nothing for {limit}."
        metrics.child(metrics.errors, backend.name, "stream_cut").inc()
        logger.warning("backend %s cut a response short: %s", backend.name, type(exc).__name__)
        return 502, "BadGatewayError", f"The backend {backend.name} failed mid-response: {type(exc).__name__}"


class _Buffered:
    """A non-streamed answer read before any of it is sent: all of it, or the first `_MAX_BUFFERED` bytes and
    the stream's iterator for the rest (`rest`)."""

    __slots__ = ("data", "first_at", "rest")

    def __init__(self) -> None:
        self.data = b""
        self.first_at: float | None = None  # when its first body byte came
        self.rest: Any = None

    async def read(self, upstream: httpx.Response) -> None:
        it = upstream.stream.__aiter__()
        parts: list[bytes] = []
        size = 0
        try:
            while size <= _MAX_BUFFERED:
                try:
                    chunk = await it.__anext__()
                except StopAsyncIteration:
                    return
                if self.first_at is None:
                    self.first_at = time.perf_counter()
                parts.append(chunk)
                size += len(chunk)
            self.rest = it
        finally:
            self.data = b"".join(parts)


def _is_sse(upstream: httpx.Response) -> bool:
    return upstream.headers.get("content-type", "").startswith("text/event-stream")
