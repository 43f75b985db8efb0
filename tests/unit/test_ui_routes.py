"""The playground and dashboard pages (pagoda/server/ui.py), in-process: they and their assets load without the
API key even when the server has one, with the right content types; the API behind them still needs the key;
with the UI off (`--no-ui`) `/` is an OpenAI-style 404; and every file the pages load is one the server serves
and the package ships."""

from __future__ import annotations

import re
import types

import pytest
from fastapi.testclient import TestClient

from pagoda.config.server import ServerConfig
from pagoda.server.app import build_app
from pagoda.server.serving import OpenAIServing, ServingContext
from pagoda.server.ui import ASSETS, UI_DIR

KEY = "k-123"


def make_client(ui: bool = True, api_key: str | None = KEY) -> TestClient:
    ctx = ServingContext(
        engine=types.SimpleNamespace(is_dead=False, dead_reason=None),
        tokenizer=None,
        served_model_names=["m"],
        max_model_len=64,
        vocab_size=100,
        architecture="LlamaForCausalLM",
        chat_template=None,
        metrics=None,
    )  # type: ignore[arg-type]
    return TestClient(build_app(OpenAIServing(ctx), api_key=api_key, ui=ui), raise_server_exceptions=False)


@pytest.mark.parametrize("path,marker", [("/", "Pagoda playground"), ("/dashboard", "Pagoda dashboard")])
def test_pages_load_without_the_key(path: str, marker: str) -> None:
    response = make_client().get(path)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/html")
    assert marker in response.text
    # The pages hold the API key: no other site may frame them.
    policy = {d.split()[0]: d.split()[1:] for d in response.headers["content-security-policy"].split(";")}
    assert policy["frame-ancestors"] == ["'none'"]
    assert response.headers["x-frame-options"] == "DENY"


def test_assets_have_their_content_types_and_need_no_key() -> None:
    client = make_client()
    kinds = {"js": "text/javascript", "css": "text/css"}
    for name in ASSETS:
        response = client.get(f"/ui/{name}")
        assert response.status_code == 200, name
        assert response.headers["content-type"].startswith(kinds[name.rsplit(".", 1)[1]]), name
        assert response.headers["x-content-type-options"] == "nosniff"


def test_the_api_still_needs_the_key_and_nothing_else_is_open() -> None:
    client = make_client()
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    # Only the named assets: no other path under /ui/ is served (nor let through without the key).
    assert client.get("/ui/../pagoda/server/app.py").status_code in (401, 404)
    assert client.get("/ui/secret.txt").status_code == 401
    assert client.get("/ui/secret.txt", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


def test_no_ui_turns_the_pages_off() -> None:
    client = make_client(ui=False)
    # With the UI off the pages are not exempt from the key either: with the key, a 404 in OpenAI's shape.
    assert client.get("/").status_code == 401
    for path in ("/", "/dashboard", "/ui/app.js"):
        response = client.get(path, headers={"Authorization": f"Bearer {KEY}"})
        assert response.status_code == 404, path
        assert response.json()["error"]["type"] == "NotFoundError"
    response = make_client(ui=False, api_key=None).get("/")
    assert response.status_code == 404 and set(response.json()) == {"error"}


def test_the_flag_is_on_by_default_and_no_ui_turns_it_off() -> None:
    import argparse

    from pagoda.cli.args import add_config_args, config_from

    parser = argparse.ArgumentParser()
    add_config_args(parser, ServerConfig)
    assert config_from(parser.parse_args([]), ServerConfig).ui is True
    assert config_from(parser.parse_args(["--no-ui"]), ServerConfig).ui is False


def test_the_pages_load_only_served_assets_and_the_package_ships_them() -> None:
    for page in ("index.html", "dashboard.html"):
        html = (UI_DIR / page).read_text()
        loaded = re.findall(r'(?:src|href)="(/ui/[^"]+)"', html)
        assert loaded, page
        assert {path.removeprefix("/ui/") for path in loaded} <= set(ASSETS), page
        assert "http://" not in html and "https://" not in html, f"{page} must work offline"
    for name in ASSETS:
        assert (UI_DIR / name).is_file(), name
        text = (UI_DIR / name).read_text()
        assert "http://" not in text and "https://" not in text, f"{name} must work offline"


def test_a_non_editable_install_ships_the_files() -> None:
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["pagoda.server"]
    shipped = {p.name for p in UI_DIR.iterdir() if any(fnmatch.fnmatch(f"ui/{p.name}", pat) for pat in patterns)}
    assert {"index.html", "dashboard.html", *ASSETS} <= shipped


def test_the_routers_page_is_open_and_the_rest_still_needs_a_key() -> None:
    import asyncio

    import httpx

    from pagoda.tools.router.app import RouterState
    from pagoda.tools.router.app import build_app as build_router
    from pagoda.tools.router.config import build_config
    from pagoda.tools.router.ui import UI_DIR as ROUTER_UI_DIR
    from pagoda.tools.router.ui import UI_PATHS

    assert ROUTER_UI_DIR == UI_DIR  # one folder of static files, shipped once
    html = (UI_DIR / "router.html").read_text()
    assert set(re.findall(r'(?:src|href)="(/ui/[^"]+)"', html)) <= set(UI_PATHS)

    async def check() -> None:
        cfg = build_config(None, {"backends": ["http://127.0.0.1:9"], "api_keys": {"alice": KEY}})
        state = RouterState(cfg, transport=httpx.MockTransport(lambda request: httpx.Response(503)))
        app = build_router(state, probes=False)
        await state.start(probes=False)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
                for path in UI_PATHS:
                    response = await client.get(path)
                    assert response.status_code == 200, path
                page = await client.get("/")
                assert page.headers["content-type"].startswith("text/html") and "Pagoda router" in page.text
                assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
                assert page.headers["x-frame-options"] == "DENY"
                assert (await client.get("/ui/router.js")).headers["content-type"].startswith("text/javascript")
                assert (await client.get("/ui/app.js")).status_code == 401  # not the router's: not open
                assert (await client.get("/usage")).status_code == 401
        finally:
            await state.stop()

    asyncio.run(check())
