"""One streamed request with client-side timings, plus the small HTTP helpers (readiness, model id, /metrics).

Timings are `time.perf_counter()` seconds, with the definitions of vLLM's `bench serve` client
(`vllm/benchmarks/lib/endpoint_request_func.py`):

- A *token chunk* is an SSE event with a non-empty `choices` list, whatever its text: a token that decodes to
  empty text (a special token, half of a UTF-8 character) still arrives as a chunk and still counts. The one
  exception is a chat stream's role preamble (`delta.role` set, no text, no finish_reason), which some servers
  send before any token is generated; vLLM's client counts it, vLLM's server sends it together with the first
  token, so skipping it changes nothing against vLLM and keeps TTFT honest against servers that send it early.
- TTFT = send -> first token chunk; ITL = the gaps between consecutive token chunks; E2EL = send -> the last
  token chunk (the trailing usage chunk and `[DONE]` do not move it). `end` is the last byte, kept apart.
- Output tokens = `usage.completion_tokens` (the server's count); without usage, the token-chunk count.

A request succeeds when the status is 200, the stream ends normally (`data: [DONE]`, or a choice with a
finish_reason and a clean close) and it generated at least one token, whatever the text. It fails on an HTTP
error, an error event, a transport error or timeout, a stream that ends before finishing, or zero tokens.
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
    ttft: float | None = None  # s, first token chunk
    e2el: float | None = None  # s, send -> last token chunk (vLLM's `latency`)
    itl: list[float] = field(default_factory=list)  # s, gaps between consecutive token chunks
    chunks: int = 0  # token chunks (empty-text ones included)
    prompt_tokens: int | None = None  # usage.prompt_tokens
    completion_tokens: int | None = None  # usage.completion_tokens, or the token-chunk count without usage
    usage_reported: bool = False
    finished: bool = False  # [DONE] or a finish_reason arrived
    output_chars: int = 0

    def detail(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("scheduled")
        return d


def parse_chunk(event: dict[str, Any], chat: bool) -> tuple[bool, str, bool]:
    """(is a token chunk, its text, carries a finish_reason) for one decoded SSE event."""
    choices = event.get("choices") or []
    if not isinstance(choices, list) or not choices:
        return False, "", False  # the usage-only chunk, or anything without choices
    first = choices[0] if isinstance(choices[0], dict) else {}
    finished = any(isinstance(c, dict) and c.get("finish_reason") is not None for c in choices)
    if not chat:
        return True, first.get("text") or "", finished
    delta = first.get("delta") or {}
    text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
    preamble = bool(delta.get("role")) and not text and not delta.get("tool_calls") and not finished
    return not preamble, text, finished


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
    last: list[float | None] = [None]  # perf_counter of the last token chunk
    try:
        await asyncio.wait_for(_consume(client, url, body, headers, chat, r, last), timeout)
    except asyncio.TimeoutError:
        r.error = f"timeout: no complete response within {timeout:g} s (after {r.chunks} token chunks)"
    except (httpx.HTTPError, OSError) as exc:
        cause = exc.__cause__ or exc.__context__
        detail = str(exc) or (f"{type(cause).__name__}: {cause}" if cause is not None else "")
        where = (
            f" after {r.chunks} token chunks" if r.status == 200 else " before a response" if r.status is None else ""
        )
        r.error = _short(f"{type(exc).__name__}{where}" + (f": {detail}" if detail else ""))
    r.end = time.perf_counter()
    if r.error is not None:
        return r
    if r.completion_tokens is None:
        r.completion_tokens = r.chunks  # approximation: the server sent no usage
    if not r.finished:
        r.error = f"stream ended before data: [DONE] or a finish_reason (after {r.chunks} token chunks)"
    elif not r.completion_tokens:
        r.error = "no token generated (usage.completion_tokens = 0, status 200)"
    else:
        if r.ttft is None:  # tokens reported but no chunk with choices: the whole answer came at the end
            r.ttft = r.end - r.start
        r.e2el = (last[0] if last[0] is not None else r.end) - r.start
        r.success = True
    return r


async def _consume(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    chat: bool,
    r: RequestResult,
    last: list[float | None],
) -> None:
    """Read the SSE stream into `r` (timings, usage, r.finished); sets r.error on a bad response."""
    async with client.stream("POST", url, json=body, headers=headers) as response:
        r.status = response.status_code
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", "replace")
            r.error = _short(f"HTTP {response.status_code}: {text}")
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments (": ping"), event:/id: fields
            payload = line[5:].strip()
            if payload == "[DONE]":
                r.finished = True
                continue
            now = time.perf_counter()
            try:
                event = json.loads(payload)
            except ValueError:
                r.error = _short(f"bad SSE payload: {payload}")
                return
            if not isinstance(event, dict):
                continue
            if event.get("error"):
                r.error = _short(f"stream error event: {json.dumps(event['error'])}")
                return
            token, text, finished = parse_chunk(event, chat)
            if token:
                if r.ttft is None:
                    r.ttft = now - r.start
                else:
                    r.itl.append(now - last[0])  # type: ignore[operator]
                last[0] = now
                r.chunks += 1
                r.output_chars += len(text)
            r.finished = r.finished or finished
            usage = event.get("usage")
            if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                r.usage_reported = True
                r.prompt_tokens = usage.get("prompt_tokens")
                r.completion_tokens = usage.get("completion_tokens")


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
