"""The router's ASGI app and its shared state.

`RouterASGI` sits in front: it checks the API key (every path but /health, /metrics and the page when keys
are configured) and hands the two generation endpoints straight to `proxy.ProxyHandler` (no FastAPI routing
or middleware on the hot path). Everything else goes to a small FastAPI app:

  GET /v1/models   union of the model ids of the healthy backends (first card per id wins)
  GET /health      200 while at least one backend is healthy, else 503; JSON with each backend's state
  GET /metrics     Prometheus text (router.metrics)
  GET /usage       per-key token totals as JSON (labels, never the keys)
  GET /            the live page of the backends and keys (router.ui; open, as /health and /metrics are)

With --workers N (router.workers) each worker process runs this app with its own RouterState; /health then
also names the worker that answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.server.http_limits import HttpLimits, http_protocol
from pagoda.tools.router.config import ConfigWatcher, RouterConfig, key_label, overrides_from
from pagoda.tools.router.health import Backend, HealthChecker, auth_headers
from pagoda.tools.router.metrics import GAUGE_PUBLISH_S, RouterMetrics
from pagoda.tools.router.policy import Balancer
from pagoda.tools.router.proxy import PROXY_PATHS, ProxyHandler, error_body, send_error
from pagoda.tools.router.ui import UI_PATHS, add_ui_routes
from pagoda.tools.router.upstream import FIRST_BYTE, FastHTTPTransport
from pagoda.tools.router.usage import UsageLedger, empty_row

logger = logging.getLogger("pagoda.tools.router")

OPEN_PATHS = frozenset({"/health", "/metrics"})
ROUTER_KEEP_ALIVE_S = 75.0


class LongQueue:
    """A concurrency limit for long requests only; short requests never wait behind them."""

    def __init__(self, limit: int):
        self.limit = limit
        self._sem = asyncio.Semaphore(limit)
        self.waiting = 0
        self.running = 0

    async def acquire(self) -> None:
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._sem.release()


class RouterState:
    """Everything one router process knows. With --workers N there is one per worker: backends' health, breakers,
    in-flight counts and the usage ledger are that worker's own; metrics and /usage aggregate through the
    multiprocess directory (`multiprocess_dir`, router.metrics)."""

    def __init__(
        self,
        config: RouterConfig,
        transport: httpx.AsyncBaseTransport | None = None,
        multiprocess_dir: str | None = None,
        worker_index: int = 0,
    ):
        self.config = config
        self.backends: list[Backend] = []
        self.usage = UsageLedger()
        self.reloads = 0
        self.worker_index = worker_index
        self.multiprocess = multiprocess_dir is not None
        self.long_queue = LongQueue(config.long_request_concurrency)
        self.metrics = RouterMetrics(self, multiprocess_dir, worker_index)
        self.client: httpx.AsyncClient | None = None
        self._upstreams: dict[str, httpx.AsyncBaseTransport] = {}
        self._limits = httpx.Limits()
        self.probe_client: httpx.AsyncClient | None = None
        self._transport = transport
        self._tasks: list[asyncio.Task] = []
        self.health: HealthChecker | None = None
        self.apply(config, initial=True)

    # -- configuration -------------------------------------------------------------------------------
    def apply(self, config: RouterConfig, initial: bool = False) -> None:
        """Install new settings; backends that keep their URL keep their health, breaker and in-flight count."""
        old = {b.url: b for b in self.backends}
        backends = []
        for bc in config.backends:
            backend = old.get(bc.url)
            if backend is None:
                backend = Backend(bc, config.breaker)
            else:
                backend.set_config(bc, config.breaker)
            backends.append(backend)
        balancer = Balancer(config.policy, config.vnodes, config.load_factor, config.load_floor)
        balancer.set_backends(backends)
        if not initial:
            if (config.host, config.port) != (self.config.host, self.config.port):
                logger.warning(
                    "router config: host/port changes need a restart; still on %s:%d",
                    self.config.host,
                    self.config.port,
                )
            if config.workers != self.config.workers:
                logger.warning("router config: a workers change needs a restart; still %d", self.config.workers)
                config = dataclasses.replace(config, workers=self.config.workers)
            if config.long_request_concurrency != self.long_queue.limit:
                self.long_queue = LongQueue(config.long_request_concurrency)
            self.reloads += 1
        self.backends = backends
        self.balancer = balancer
        self.key_labels = config.key_labels()
        self.session_header_bytes = config.session_header.encode("latin-1")
        self.timeout = httpx.Timeout(connect=config.connect_timeout, read=config.read_timeout, write=60.0, pool=60.0)
        self.timeout_extension = {"timeout": {**self.timeout.as_dict(), FIRST_BYTE: config.first_byte_timeout}}
        self.config = config

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self, probes: bool = True, watcher: Any = None) -> None:
        cfg = self.config
        # Idle upstream connections are dropped after 4 s, before the backend's own keep-alive timeout (uvicorn's
        # default is 5 s) can close one under a request we are sending.
        self._limits = httpx.Limits(
            max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections, keepalive_expiry=4.0
        )
        self.client = httpx.AsyncClient(timeout=self.timeout, transport=self._transport, trust_env=False)
        self.probe_client = httpx.AsyncClient(timeout=cfg.health.timeout, transport=self._transport, trust_env=False)
        self.health = HealthChecker(self, self.probe_client)
        if probes:
            self._tasks.append(asyncio.ensure_future(self.health.run()))
        if watcher is not None:
            self._tasks.append(asyncio.ensure_future(watcher.run()))
        if self.multiprocess:
            self._tasks.append(asyncio.ensure_future(self._publish_gauges()))

    async def _publish_gauges(self) -> None:
        while True:
            try:
                self.metrics.publish()
            except Exception:
                logger.exception("router metrics: publishing the gauges")
            await asyncio.sleep(GAUGE_PUBLISH_S)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        for client in (self.client, self.probe_client):
            if client is not None:
                await client.aclose()
        for transport in self._upstreams.values():
            if transport is not self._transport:
                await transport.aclose()
        self._upstreams.clear()

    def upstream_for(self, backend: Backend) -> httpx.AsyncBaseTransport:
        """The connection pool of one backend (an httpx transport, shared by all requests to it).

        The hot path sends through the transport, not through AsyncClient.send: a proxy must not keep a client
        cookie jar (one user's cookies would go out with another's requests) and needs no auth or redirect
        handling, and that layer alone is a measurable share of a request on a small CPU
        (benchmarks/profile/router_overhead.py). One pool per backend, not one
        for all (httpcore's pool, still used for https backends, does O(connections^2) work whenever a request
        starts or ends). The transport is upstream.FastHTTPTransport: httpcore's per-chunk cost was most of the
        router's CPU per relayed token.
        """
        transport = self._upstreams.get(backend.url)
        if transport is None:
            transport = self._upstreams[backend.url] = self._transport or FastHTTPTransport(limits=self._limits)
        return transport

    # -- accounting ----------------------------------------------------------------------------------
    def record_usage(self, label: str, tokens: tuple[int, int] | None) -> None:
        prompt, completion = tokens if tokens is not None else (0, 0)
        self.usage.add(label, prompt, completion, counted=tokens is not None)
        m = self.metrics
        m.child(m.key_requests, label).inc()
        if prompt:
            m.child(m.prompt_tokens, label).inc(prompt)
        if completion:
            m.child(m.completion_tokens, label).inc(completion)
        if tokens is None:
            m.child(m.key_no_usage, label).inc()

    def usage_snapshot(self) -> dict[str, dict[str, int]]:
        """Per-key totals: this process's ledger, or with --workers N the sum over all workers. Every configured
        key has a row, zeros until it is used (a key's row does not appear or vanish with its traffic)."""
        rows = self.metrics.usage_totals() if self.multiprocess else self.usage.snapshot()
        for label, _ in self.config.api_keys:
            rows.setdefault(label, empty_row())
        return rows

    def auth(self, scope: Any) -> str | None:
        """The caller's usage label, or None when keys are configured and the bearer token is not one."""
        token = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                if value[:7].lower() == b"bearer ":
                    token = value[7:].strip()
                break
        if not self.key_labels:
            return key_label(token.decode("latin-1")) if token else "anonymous"
        if not token:
            return None
        return self.key_labels.get(hashlib.sha256(token).hexdigest())


class RouterASGI:
    def __init__(self, state: RouterState, api: FastAPI):
        self.state = state
        self.api = api
        self.proxy = ProxyHandler(state)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)
            return
        path = scope["path"]
        label = "anonymous"
        if path not in OPEN_PATHS and path not in UI_PATHS:
            found = self.state.auth(scope)
            if found is None:
                self.state.metrics.child(self.state.metrics.rejected, "unauthorized").inc()
                await send_error(
                    send, 401, "Invalid or missing API key; send 'Authorization: Bearer <key>'.", "AuthenticationError"
                )
                return
            label = found
        if path in PROXY_PATHS and scope["method"] == "POST":
            await self.proxy(scope, receive, send, label)
            return

        async def tagged_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-pagoda-backend" for k, _ in headers):
                    headers.append((b"x-pagoda-backend", b"router"))
                message = {**message, "headers": headers}
            await send(message)

        await self.api(scope, receive, tagged_send)


def _error(status: int, message: str, error_type: str, headers: dict[str, str] | None = None) -> Response:
    return Response(
        error_body(status, message, error_type), status_code=status, media_type="application/json", headers=headers
    )


def build_app(state: RouterState, watcher: Any = None, probes: bool = True) -> RouterASGI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        await state.start(probes=probes, watcher=watcher)
        try:
            yield
        finally:
            await state.stop()

    api = FastAPI(title="Pagoda router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        error_type = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "BadRequestError")
        return _error(exc.status_code, str(exc.detail), error_type, dict(exc.headers or {}) or None)

    add_ui_routes(api)

    @api.get("/health")
    async def health() -> Response:
        backends = [b.describe() for b in state.backends]
        ok = any(b.healthy for b in state.backends)
        answer: dict[str, Any] = {
            "status": "ok" if ok else "unavailable",
            "policy": state.config.policy,
            "backends": backends,
        }
        if state.multiprocess:  # --workers N: this is the view of the worker that answered
            answer["worker"] = {"index": state.worker_index, "pid": os.getpid(), "reloads": state.reloads}
        return JSONResponse(answer, status_code=200 if ok else 503)

    @api.get("/metrics")
    async def metrics() -> Response:
        # lazy: prometheus_client, imported only once the workers have set PROMETHEUS_MULTIPROC_DIR
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @api.get("/usage")
    async def usage() -> Response:
        return JSONResponse({"keys": state.usage_snapshot()})

    @api.get("/v1/models")
    async def models() -> Response:
        cfg = state.config
        targets = [b for b in state.backends if b.available()] or list(state.backends)

        async def fetch(backend: Backend) -> tuple[Backend, list[dict[str, Any]] | None]:
            try:
                r = await state.client.get(
                    backend.url + "/v1/models",
                    timeout=max(cfg.health.timeout, 5.0),
                    headers=auth_headers(backend, cfg.backend_api_key),
                )
                if r.status_code != 200:
                    return backend, None
                cards = [c for c in r.json().get("data", []) if isinstance(c, dict) and "id" in c]
                backend.models = [str(c["id"]) for c in cards]
                return backend, cards
            except Exception:  # noqa: BLE001 - a backend that cannot answer is left out of the union
                return backend, None

        results = await asyncio.gather(*(fetch(b) for b in targets))
        merged: dict[str, dict[str, Any]] = {}
        answered = []
        for backend, cards in results:
            if cards is None:
                continue
            answered.append(backend.name)
            for card in cards:
                merged.setdefault(str(card["id"]), card)
        if not answered:
            return _error(503, "No backend answered /v1/models.", "ServiceUnavailableError")
        return JSONResponse(
            {"object": "list", "data": list(merged.values())}, headers={"x-pagoda-backend": ",".join(answered)}
        )

    return RouterASGI(state, api)


def make_server(ns: argparse.Namespace, config: Any, multiprocess_dir: str | None = None, worker_index: int = 0) -> Any:
    """The uvicorn server of one router process (the only one, or worker `worker_index` of --workers N)."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    overrides = overrides_from(ns)
    state = RouterState(config, multiprocess_dir=multiprocess_dir, worker_index=worker_index)
    watcher = ConfigWatcher(ns.config, overrides, state.apply, ns.reload_interval) if ns.config else None
    app = build_app(state, watcher)
    # The client side gets `pagoda serve`'s transport limits (the same protocol class: request line and headers
    # counted as they arrive, 431 beyond --max-header-bytes/--max-header-count; 408 for headers or a body that
    # do not arrive in time; a silent new connection closed after the idle timeout). No connection cap: the
    # router's --max-connections is its upstream pool.
    limits = HttpLimits(
        max_request_bytes=config.max_request_bytes,
        max_header_bytes=config.max_header_bytes,
        max_header_count=config.max_header_count,
        header_timeout=config.header_timeout,
        body_timeout=config.body_timeout,
        keep_alive_timeout=ROUTER_KEEP_ALIVE_S,
        max_connections=1 << 30,
    )
    # timeout_keep_alive 75 s (uvicorn: 5 s): longer than clients' pools keep idle connections (httpx 5 s, aiohttp
    # 15 s), so a client never reuses a connection the router is closing at that moment.
    return uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=ns.uvicorn_log_level,
            access_log=False,
            timeout_graceful_shutdown=ns.shutdown_timeout,
            backlog=4096,
            proxy_headers=False,
            timeout_keep_alive=ROUTER_KEEP_ALIVE_S,
            http=http_protocol(limits),
        )
    )
