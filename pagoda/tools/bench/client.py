"""One streamed request with client-side timings, plus the small HTTP helpers (readiness, model id, /metrics).

Timings are `time.perf_counter()` seconds. A *content chunk* is an SSE event whose first choice carries
non-empty text (`delta.content` / `delta.reasoning_content` for chat, `text` for completions); role-only
and finish-only chunks are not content. A request is failed when the status is not 200, the stream breaks or
ends before `[DONE]`, the server sends an error event, or no content chunk ever arrives (TTFT stays None).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

MAX_ERROR_BODY = 2000


@dataclass
class RequestResult:
    success: bool = False
    status: int | None = None
    error: str | None = None  # status + body / exception, truncated
    start: float = 0.0  # perf_counter at send (after any client-side wait)
    scheduled: float | None = None  # perf_counter the schedule wanted it sent (open loop), for queue time
    end: float = 0.0  # perf_counter at the last byte
    ttft: float | None = None  # s, first content chunk
    e2el: float | None = None  # s, send -> last byte
    itl: list[float] = field(default_factory=list)  # s, gaps between consecutive content chunks
    chunks: int = 0  # content chunks
    prompt_tokens: int | None = None  # usage.prompt_tokens
    completion_tokens: int | None = None  # usage.completion_tokens, or the content-chunk count without usage
    usage_reported: bool = False
    output_chars: int = 0

    def detail(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("scheduled")
        return d


def _content_of(event: dict[str, Any], chat: bool) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    first = choices[0] or {}
    if chat:
        delta = first.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
    return first.get("text") or ""


def _short(text: str) -> str:
    return text if len(text) <= MAX_ERROR_BODY else text[:MAX_ERROR_BODY] + "...[truncated]"


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    chat: bool,
    scheduled: float | None = None,
    timeout: float | None = None,
) -> RequestResult:
    """POST `body` (stream=True) and time it; never raises for HTTP or stream problems. `timeout` bounds the
    whole request (the client's own httpx timeouts bound each connect/read)."""
    r = RequestResult(scheduled=scheduled)
    r.start = time.perf_counter()
    done = False
    try:
        done = await asyncio.wait_for(_consume(client, url, body, headers, chat, r), timeout)
    except asyncio.TimeoutError:
        r.error = f"timeout: no complete response within {timeout:g} s (after {r.chunks} content chunks)"
    except (httpx.HTTPError, OSError) as exc:
        cause = exc.__cause__ or exc.__context__
        detail = str(exc) or (f"{type(cause).__name__}: {cause}" if cause is not None else "")
        where = (
            f" after {r.chunks} content chunks" if r.status == 200 else " before a response" if r.status is None else ""
        )
        r.error = _short(f"{type(exc).__name__}{where}" + (f": {detail}" if detail else ""))
    r.end = time.perf_counter()
    if r.error is not None:
        return r
    r.e2el = r.end - r.start
    if not done:
        r.error = "stream ended before data: [DONE]"
    elif r.ttft is None:
        r.error = "no content chunk received (status 200); TTFT undefined"
    else:
        if r.completion_tokens is None:
            r.completion_tokens = r.chunks  # approximation: the server sent no usage
        r.success = True
    return r


async def _consume(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], chat: bool, r: RequestResult
) -> bool:
    """Read the SSE stream into `r`; True when `data: [DONE]` arrived. Sets r.error on a bad response."""
    done = False
    last = r.start
    async with client.stream("POST", url, json=body, headers=headers) as response:
        r.status = response.status_code
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", "replace")
            r.error = _short(f"HTTP {response.status_code}: {text}")
            return False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments (": ping"), event:/id: fields
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                continue
            now = time.perf_counter()
            try:
                event = json.loads(payload)
            except ValueError:
                r.error = _short(f"bad SSE payload: {payload}")
                return False
            if not isinstance(event, dict):
                continue
            if event.get("error"):
                r.error = _short(f"stream error event: {json.dumps(event['error'])}")
                return False
            text = _content_of(event, chat)
            if text:
                if r.ttft is None:
                    r.ttft = now - r.start
                else:
                    r.itl.append(now - last)
                last = now
                r.chunks += 1
                r.output_chars += len(text)
            usage = event.get("usage")
            if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                r.usage_reported = True
                r.prompt_tokens = usage.get("prompt_tokens")
                r.completion_tokens = usage.get("completion_tokens")
    return done


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def wait_ready(base_url: str, headers: dict[str, str], timeout: float) -> str | None:
    """Poll /health, then /v1/models, until one answers 200 or `timeout` passes. Returns None when ready,
    else the last problem seen."""
    deadline = time.monotonic() + timeout
    problem = "not tried"
    with httpx.Client(base_url=base_url, headers=headers, timeout=5.0) as client:
        while True:
            for path in ("/health", "/v1/models"):
                try:
                    response = client.get(path)
                except httpx.HTTPError as exc:
                    problem = f"{path}: {type(exc).__name__}: {exc}"
                    continue
                if response.status_code == 200:
                    return None
                problem = f"{path}: HTTP {response.status_code} {_short(response.text)[:300]}"
            if time.monotonic() >= deadline:
                return problem
            time.sleep(0.5)


def first_model(base_url: str, headers: dict[str, str], timeout: float = 10.0) -> str:
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=timeout)
    if response.status_code != 200:
        raise RuntimeError(f"GET /v1/models: HTTP {response.status_code} {_short(response.text)[:300]}")
    data = response.json().get("data") or []
    if not data or not data[0].get("id"):
        raise RuntimeError("GET /v1/models listed no model; pass --model")
    return str(data[0]["id"])
