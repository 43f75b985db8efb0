"""The router's request path against fake backends (httpx.MockTransport): retries before the first byte, error
passthrough, stream passthrough and usage hiding, usage per key, auth, size limit, long-request queue,
model-aware routing and the merged /v1/models. No server process: the router app is driven via ASGITransport."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx

from pagoda.tools.router.app import RouterState, build_app
from pagoda.tools.router.config import build_config, key_label

URLS = {"a": "http://10.0.0.1:8000", "b": "http://10.0.0.2:8000", "c": "http://10.0.0.3:8000"}
BY_HOST = {httpx.URL(u).host: n for n, u in URLS.items()}
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj, separators=(",", ":")).encode()) + b"\n\n"


def stream_events(include_usage: bool) -> list[bytes]:
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
    events = [sse({"id": "c1", "choices": [role], "usage": None})]
    events += [sse({"id": "c1", "choices": [{"index": 0, "delta": {"content": t}}], "usage": None}) for t in "abc"]
    if include_usage:
        events.append(sse({"id": "c1", "choices": [], "usage": USAGE}))
    return events + [sse(b"[DONE]")]


def streamed(status: int, obj: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    """A JSON response whose body arrives as a stream, like a real server's (a bytes body would be pre-read)."""
    data = json.dumps(obj).encode()

    async def gen() -> Any:
        yield data

    return httpx.Response(
        status,
        headers={"content-type": "application/json", "content-length": str(len(data)), **(headers or {})},
        content=gen(),
    )


class Fakes:
    """Three fake backends; `behaviour[name]` is "ok", "refuse" (connection error) or an HTTP status to answer."""

    def __init__(self) -> None:
        self.behaviour = {n: "ok" for n in URLS}
        self.models = {n: ["smol"] for n in URLS}
        self.seen: list[tuple[str, dict[str, Any], httpx.Headers]] = []
        self.gate: asyncio.Event | None = None  # when set, completions wait for it (long-queue test)
        self.running = 0
        self.peak = 0

    async def handler(self, request: httpx.Request) -> httpx.Response:
        name = BY_HOST[request.url.host]
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(
                200,
                json={
                    "object": "list",
                    "data": [{"id": m, "object": "model", "owned_by": name} for m in self.models[name]],
                },
            )
        mode = self.behaviour[name]
        if mode == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        body = json.loads(request.content)
        self.seen.append((name, body, request.headers))
        if isinstance(mode, int):
            return streamed(
                mode,
                {"error": {"message": f"{name} says {mode}", "type": "X", "param": None, "code": mode}},
                {"retry-after": "3"},
            )
        if self.gate is not None:
            self.running += 1
            self.peak = max(self.peak, self.running)
            await self.gate.wait()
            self.running -= 1
        if body.get("stream"):
            include = bool((body.get("stream_options") or {}).get("include_usage"))
            events = stream_events(include)

            async def gen() -> Any:
                for e in events:
                    yield e

            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=gen())
        return streamed(
            200,
            {
                "id": "x",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": name}}],
                "usage": USAGE,
            },
        )


async def with_router(fakes: Fakes, test: Callable[[httpx.AsyncClient, RouterState], Any], **overrides: Any) -> Any:
    cfg = build_config(None, {"backends": list(URLS.values()), **overrides})
    state = RouterState(cfg, transport=httpx.MockTransport(fakes.handler))
    app = build_app(state, probes=False)
    await state.start(probes=False)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await test(client, state)
    finally:
        await state.stop()


def run(fakes: Fakes, test: Callable, **overrides: Any) -> Any:
    return asyncio.run(with_router(fakes, test, **overrides))


CHAT = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def owner_of(state: RouterState, session: str) -> str:
    name = state.balancer.owner("s:" + session)
    return next(n for n, u in URLS.items() if u == name)


def test_session_affinity_and_backend_header() -> None:
    fakes = Fakes()

    async def test(client: httpx.AsyncClient, state: RouterState) -> None:
        served = set()
        for _ in range(4):
            r = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s-42"})
            assert r.status_code == 200
            served.add(r.headers["x-pagoda-backend"])
        assert served == {URLS[owner_of(state, "s-42")]}
        assert {n for n, _, _ in fakes.seen} == {owner_of(state, "s-42")}

    run(fakes, test)


def test_retry_on_connect_error_and_503_before_first_byte() -> None:
    fakes = Fakes()

    async def test(client: httpx.AsyncClient, state: RouterState) -> None:
        owner = owner_of(state, "s-1")
        fakes.behaviour[owner] = "refuse"
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s-1"})
        assert r.status_code == 200 and r.headers["x-pagoda-backend"] != URLS[owner]
        assert state.balancer.owner("s:s-1") == URLS[owner]
        fakes.behaviour[owner] = 503
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"X-Session-ID": "s-1"})
        assert r.status_code == 200 and r.headers["x-pagoda-backend"] != URLS[owner]
        assert r.text.endswith("data: [DONE]\n\n")
        backend = next(b for b in state.backends if b.url == URLS[owner])
        assert backend.breaker.consecutive_failures == 2
        text = state.metrics.render().decode()
        assert f'pagoda_router:retries_total{{backend="{URLS[owner]}"}} 2.0' in text
        assert f'pagoda_router:backend_errors_total{{backend="{URLS[owner]}",kind="connect"}} 1.0' in text
        # a third failure opens the breaker: the owner is skipped without trying it
        fakes.behaviour[owner] = 502
        await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s-1"})
        assert backend.breaker.state() == "open"
        tried = len(fakes.seen)
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s-1"})
        assert r.status_code == 200 and len(fakes.seen) == tried + 1 and fakes.seen[-1][0] != owner

    run(fakes, test)


def test_all_backends_failing() -> None:
    fakes = Fakes()

    async def test(client: httpx.AsyncClient, state: RouterState) -> None:
        for n in URLS:
            fakes.behaviour[n] = 503
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.headers["retry-after"] == "3"  # the last backend's own answer
        assert "says 503" in r.json()["error"]["message"]
        for n in URLS:
            fakes.behaviour[n] = "refuse"
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 502 and r.headers["x-pagoda-backend"] == "router"
        error = r.json()["error"]
        assert error["type"] == "BadGatewayError" and error["code"] == 502 and "ConnectError" in error["message"]

    run(fakes, test, max_attempts=3, **{"breaker.failures": 100})


def test_client_errors_pass_through_without_retry() -> None:
    fakes = Fakes()

    async def test(client: httpx.AsyncClient, state: RouterState) -> None:
        owner = owner_of(state, "s-9")
        fakes.behaviour[owner] = 400
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s-9"})
        assert r.status_code == 400 and r.headers["x-pagoda-backend"] == URLS[owner]
        assert len(fakes.seen) == 1

    run(fakes, test)


def test_stream_passthrough_and_usage_hidden_unless_asked() -> None:
    fakes = Fakes()

    async def test(client: httpx.AsyncClient, state: RouterState) -> None:
        r = await client.post(
            "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"Authorization": "Bearer k1"}
        )
        assert r.status_code == 200
        assert r.content == b"".join(stream_events(False))  # the usage chunk the router asked for is gone
        assert r.headers["x-accel-buffering"] == "no" and "x-pagoda-backend" in r.headers
        sent = fakes.seen[-1][1]
        assert sent["stream_options"] == {"include_usage": True}
        r = await client.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
            headers={"Authorization": "Bearer k1"},
        )
        assert r.content == b"".join(stream_events(True))  # asked for: byte for byte
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k1"})
        assert r.json()["usage"] == USAGE
        usage = (await client.get("/usage")).json()["keys"]
        assert usage == {
            key_label("k1"): {
                "requests": 3,
                "requests_without_usage": 0,
                "prompt_tokens": 21,
                "completion_tokens": 9,
                "total_tokens": 30,
            }
        }
        text = state.metrics.render().decode()
        assert f'pagoda_router:prompt_tokens_total{{key="{key_label("k1")}"}} 21.0' in text

    run(fakes, test)


def test_no_usage_injection() -> None:
    fakes = Fakes()

    async def test(client: httpx.AsyncClient, state: RouterState) -> None:
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.content == b"".join(stream_events(False))
        assert "stream_options" not in fakes.seen[-1][1]
        assert (await client.get("/usage")).json()["keys"]["anonymous"]["requests_without_usage"] == 1

    run(fakes, test, inject_usage=False)


def test_api_keys_and_backend_key() -> None:
    fakes = Fakes()

    async def test(client: httpx.AsyncClient, state: RouterState) -> None:
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.headers["x-pagoda-backend"] == "router"
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/health")).status_code == 200  # probes and scrapers need no key
        assert (await client.get("/metrics")).status_code == 200
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-alice"})
        assert r.status_code == 200
        assert fakes.seen[-1][2]["authorization"] == "Bearer backend-secret"  # the router's key, not the client's
        r = await client.get("/usage", headers={"Authorization": "Bearer sk-bob"})
        keys = r.json()["keys"]
        assert keys["alice"]["requests"] == 1 and keys["alice"]["total_tokens"] == 10
        assert keys["bob"] == dict.fromkeys(keys["alice"], 0)  # every configured key has a row, zeros until used

    run(fakes, test, api_keys=[("alice", "sk-alice"), ("bob", "sk-bob")], backend_api_key="backend-secret")


def test_request_limits() -> None:
    fakes = Fakes()

    async def test(client: httpx.AsyncClient, state: RouterState) -> None:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
        r = await client.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        r = await client.post(
            "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
        r = await client.post("/v1/chat/completions", json=[1, 2])
        assert r.status_code == 400
        assert fakes.seen == []
        assert 'pagoda_router:rejected_total{reason="too_large"} 1.0' in state.metrics.render().decode()

    run(fakes, test, max_request_bytes=4096)


def test_long_requests_have_their_own_queue() -> None:
    fakes = Fakes()

    async def test(client: httpx.AsyncClient, state: RouterState) -> None:
        fakes.gate = asyncio.Event()
        long_body = {**CHAT, "messages": [{"role": "user", "content": "y" * 300}]}
        longs = [asyncio.ensure_future(client.post("/v1/chat/completions", json=long_body)) for _ in range(3)]
        for _ in range(50):
            await asyncio.sleep(0.01)
            if state.long_queue.waiting == 2:
                break
        assert (state.long_queue.running, state.long_queue.waiting) == (1, 2)
        shorts = [asyncio.ensure_future(client.post("/v1/chat/completions", json=CHAT)) for _ in range(3)]
        for _ in range(50):
            await asyncio.sleep(0.01)
            if fakes.running == 4:
                break
        assert fakes.running == 4  # the three short ones did not wait behind the long queue
        fakes.gate.set()
        results = await asyncio.gather(*longs, *shorts)
        assert all(r.status_code == 200 for r in results)
        assert state.long_queue.running == state.long_queue.waiting == 0

    run(fakes, test, long_request_chars=200, long_request_concurrency=1)


def test_models_merged_and_model_aware_routing() -> None:
    fakes = Fakes()
    fakes.models["c"] = ["smol", "big"]

    async def test(client: httpx.AsyncClient, state: RouterState) -> None:
        r = await client.get("/v1/models")
        assert r.status_code == 200
        assert [m["id"] for m in r.json()["data"]] == ["smol", "big"]
        assert set(r.headers["x-pagoda-backend"].split(",")) == set(URLS.values())
        for i in range(6):  # only c serves "big"
            r = await client.post(
                "/v1/chat/completions", json={**CHAT, "model": "big"}, headers={"X-Session-ID": str(i)}
            )
            assert r.headers["x-pagoda-backend"] == URLS["c"]

    run(fakes, test)


def test_round_robin_and_least_loaded_spread() -> None:
    for policy in ("round-robin", "least-loaded"):
        fakes = Fakes()

        async def test(
            client: httpx.AsyncClient, state: RouterState, fakes: Fakes = fakes, policy: str = policy
        ) -> None:
            for _ in range(6):
                assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            counts = {n: sum(1 for s, _, _ in fakes.seen if s == n) for n in URLS}
            assert counts == {"a": 2, "b": 2, "c": 2}, (policy, counts)

        run(fakes, test, policy=policy)
