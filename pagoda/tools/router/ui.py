"""The router's live page at `/` (and `/dashboard`): its backends' health, circuit breakers, requests in flight,
traffic and affinity hit rate, and tokens per API key, from the router's own /health and /metrics.

The page's files live with the server's pages in `pagoda/server/ui/` (one folder of static files, package data:
`router.html`, `router.js`, and the shared `common.js` and `style.css`); they are read from there as data, so
the router still imports nothing of the server. Both endpoints the page reads are open on the router, so the
page and its files are too (`UI_PATHS`); only these files are served.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

UI_DIR = Path(__file__).resolve().parents[2] / "server" / "ui"
_HTML, _JS, _CSS = "text/html; charset=utf-8", "text/javascript; charset=utf-8", "text/css; charset=utf-8"
# URL path -> (file in UI_DIR, content type)
UI_PATHS = {
    "/": ("router.html", _HTML),
    "/dashboard": ("router.html", _HTML),
    "/ui/router.js": ("router.js", _JS),
    "/ui/common.js": ("common.js", _JS),
    "/ui/style.css": ("style.css", _CSS),
}
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
# The server's pages' framing policy (server/ui.py), written here too since the router imports nothing of the
# server: no other site may frame the page (clickjacking), embed plugins or rebase its URLs.
_PAGE_HEADERS = {
    **_HEADERS,
    "Content-Security-Policy": "frame-ancestors 'none'; object-src 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
}


def add_ui_routes(api: FastAPI) -> None:
    for path, (name, media_type) in UI_PATHS.items():

        async def serve(name: str = name, media_type: str = media_type) -> Response:
            headers = _PAGE_HEADERS if media_type == _HTML else _HEADERS
            return Response((UI_DIR / name).read_bytes(), media_type=media_type, headers=headers)

        api.add_api_route(path, serve, methods=["GET"], include_in_schema=False)
