"""FastAPI app factory: routes, the one place errors become OpenAI-shaped JSON, API-key check.

Error mapping: a `PagodaError` carries its HTTP status and OpenAI error type; schema errors become
400 BadRequestError (not FastAPI's 422); anything else is a 500 whose body still has the OpenAI
shape. `Overloaded`, `EngineDead` and `ShuttingDown` add `Retry-After`.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.config.server import DEFAULT_MAX_REQUEST_BYTES
from pagoda.errors import EngineDead, Overloaded, PagodaError, ShuttingDown, Unauthorized
from pagoda.server.http_limits import BodyLimitMiddleware
from pagoda.server.metrics import HttpMetricsMiddleware
from pagoda.server.routes import router
from pagoda.server.serving import OpenAIServing
from pagoda.server.ui import UI_OPEN_PATHS, add_ui_routes

logger = logging.getLogger("pagoda.server")

# Paths that never need the API key (probes and scrapers); with the UI on, also its pages (server/ui.py).
OPEN_PATHS = frozenset({"/health", "/version", "/metrics", "/ping"})


class _ErrorJSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        # ASCII with \u escapes: a message quoting what the client sent (a lone surrogate, say) may
        # have no UTF-8 form, and the error must still go out.
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(
    status: int, message: str, error_type: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return _ErrorJSON(body, status_code=status, headers=headers)


def build_app(
    serving: OpenAIServing,
    api_key: str | None = None,
    lifespan: Any = None,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
    ui: bool = True,
) -> FastAPI:
    """`ui`: serve the playground and dashboard pages (server/ui.py); they load without the API key."""
    app = FastAPI(title="Pagoda OpenAI-compatible server", lifespan=lifespan)
    app.state.serving = serving
    app.include_router(router)
    if ui:
        add_ui_routes(app)
    app.openapi = lambda: _openapi_without_422(app)  # type: ignore[method-assign]

    @app.exception_handler(PagodaError)
    async def _pagoda_error(_: Request, exc: PagodaError) -> JSONResponse:
        headers = {"Retry-After": "5"} if isinstance(exc, (Overloaded, EngineDead, ShuttingDown)) else None
        return error_response(exc.http_status, exc.message, exc.error_type, exc.param, headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown route (404), wrong method (405)...: the OpenAI shape, not FastAPI's {"detail": ...}.
        error_type = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "BadRequestError")
        return error_response(exc.status_code, str(exc.detail), error_type, headers=dict(exc.headers or {}) or None)

    @app.exception_handler(RequestValidationError)
    async def _schema_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"The request body is not valid JSON: {first.get('msg')}", "BadRequestError")
        location = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{location}: {first.get('msg', 'invalid request')}" if location else str(first.get("msg", exc))
        return error_response(400, message, "BadRequestError", location or None)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"Internal server error: {type(exc).__name__}", "InternalServerError")

    if api_key:
        app.add_middleware(
            APIKeyMiddleware, api_key=api_key, open_paths=OPEN_PATHS | UI_OPEN_PATHS if ui else OPEN_PATHS
        )
    if max_request_bytes is not None:
        app.add_middleware(BodyLimitMiddleware, limit=max_request_bytes)  # before anything reads
    http_metrics = getattr(getattr(serving.ctx, "metrics", None), "http", None)
    if http_metrics is not None:  # outermost: every answer counts, a 401 or 413 too
        app.add_middleware(HttpMetricsMiddleware, metrics=http_metrics)

    return app


def _openapi_without_422(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema less the 422 it documents for every route that takes a body: this server answers
    schema errors with 400, in OpenAI's error shape, as the routes document."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)  # builds and caches app.openapi_schema
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):  # only the 422s referred to these
            schema.get("components", {}).get("schemas", {}).pop(name, None)
    return cast(dict[str, Any], app.openapi_schema)


class APIKeyMiddleware:
    """Pure ASGI (not `@app.middleware("http")`, whose BaseHTTPMiddleware wraps `receive` so that
    `request.is_disconnected()` never turns true downstream, and which relays every streamed chunk
    through an extra memory stream)."""

    def __init__(self, app: Any, api_key: str, open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self.api_key = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not secrets.compare_digest(token, self.api_key):
                err = Unauthorized("Invalid or missing API key; send 'Authorization: Bearer <key>'.")
                await error_response(err.http_status, err.message, err.error_type)(scope, receive, send)
                return
        await self.app(scope, receive, send)
