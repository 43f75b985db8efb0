"""The browser pages `pagoda serve` ships: a chat playground at `/` and a live dashboard at `/dashboard`.

Both are static files in `pagoda/server/ui/` (package data: HTML, one CSS file, dependency-free JS; no build
step, nothing fetched from a CDN), served as they are. All they know they learn from the public API, in the
browser: the model from /v1/models, replies from /v1/chat/completions (SSE), prompts and token counts from
/tokenize and /detokenize, and the dashboard's numbers from /metrics (Prometheus text, parsed and turned
into rates and percentiles client side, one snapshot a second).

Invariants: the pages and their assets hold nothing secret, so they load without the API key (the API-key
middleware lets exactly `UI_OPEN_PATHS` through, and only when the UI is on); the key a user types stays in
the browser and goes out only as `Authorization: Bearer` on the API calls. Only the files named in `ASSETS`
are served (no path from the URL ever reaches the file system).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

UI_DIR = Path(__file__).resolve().parent / "ui"
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
ASSET_PREFIX = "/ui/"
# file name -> content type
ASSETS = {
    "app.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "common.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
UI_OPEN_PATHS = frozenset(PAGES) | frozenset(ASSET_PREFIX + name for name in ASSETS)
_HTML = "text/html; charset=utf-8"
# The pages change with the package, not per request: revalidate, never serve a stale copy after an upgrade.
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
# The pages keep the API key in the browser: no other site may frame them (clickjacking; X-Frame-Options for
# browsers without CSP level 2), embed plugins or rebase their relative URLs. Scripts, images, media and
# fetches are left alone: the playground shows attachments from blob: and data: URLs, and browser
# automation (the UI tests) evaluates scripts in the page.
CONTENT_SECURITY_POLICY = "frame-ancestors 'none'; object-src 'none'; base-uri 'none'"
_PAGE_HEADERS = {**_HEADERS, "Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Frame-Options": "DENY"}


def _file(name: str, media_type: str) -> Response:
    headers = _PAGE_HEADERS if media_type == _HTML else _HEADERS
    return Response((UI_DIR / name).read_bytes(), media_type=media_type, headers=headers)


def add_ui_routes(app: FastAPI) -> None:
    """The pages and their assets, as GET routes (left out of /openapi.json: they are not API)."""
    for path, name in PAGES.items():

        async def page(name: str = name) -> Response:
            return _file(name, _HTML)

        app.add_api_route(path, page, methods=["GET"], include_in_schema=False, name=f"ui:{name}")

    for name, media_type in ASSETS.items():

        async def asset(name: str = name, media_type: str = media_type) -> Response:
            return _file(name, media_type)

        app.add_api_route(ASSET_PREFIX + name, asset, methods=["GET"], include_in_schema=False, name=f"ui:{name}")
