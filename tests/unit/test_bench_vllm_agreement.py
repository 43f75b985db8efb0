"""`pagoda bench` agrees with `vllm bench serve`: the success rule, the metric definitions on synthetic timelines
(values computed by hand here, not by the code under test), and the random-mm image workload.

Everything runs on httpx mock transports and a fake clock: no process, no socket."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import types
from collections.abc import AsyncIterator, Callable

import httpx
import numpy as np
import pytest

from pagoda.tools.bench import client as client_mod
from pagoda.tools.bench import runner
from pagoda.tools.bench.client import RequestResult, parse_chunk, stream_request
from pagoda.tools.bench.metrics import SLO, aggregate
from pagoda.tools.bench.workload import Workload, parse_image_sizes

CHAT_URL = "http://x/v1/chat/completions"
COMP_URL = "http://x/v1/completions"


# ---- helpers: SSE events and a stream whose every event arrives at a chosen fake time ----------------------


def role() -> dict:
    return {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}


def chat(text: str | None, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": {"role": None, "content": text}, "finish_reason": finish}]}


def comp(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def usage(completion: int, prompt: int = 20) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


DONE = "[DONE]"


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def timed_run(
    monkeypatch: pytest.MonkeyPatch, start: float, timeline: list[tuple[float, dict | str]], is_chat: bool
) -> RequestResult:
    """Send one request at fake time `start`; the server writes each (time, event) of `timeline` at that time."""
    clock = Clock(start)
    monkeypatch.setattr(client_mod, "time", types.SimpleNamespace(perf_counter=clock))

    async def body() -> AsyncIterator[bytes]:
        for at, event in timeline:
            clock.now = at
            payload = event if isinstance(event, str) else json.dumps(event)
            yield f"data: {payload}\n\n".encode()

    async def go() -> RequestResult:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body()))
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_request(client, CHAT_URL if is_chat else COMP_URL, {}, {}, chat=is_chat)

    return asyncio.run(go())


def run_events(events: list[dict | str], is_chat: bool = True, status: int = 200) -> RequestResult:
    raw = "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()

    async def go() -> RequestResult:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=raw))
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_request(client, CHAT_URL if is_chat else COMP_URL, {}, {}, chat=is_chat)

    return asyncio.run(go())


# ---- 1. the success rule -----------------------------------------------------------------------------------


def test_empty_text_stream_with_usage_is_a_success() -> None:
    """The vLLM-server case that was counted failed: 256 tokens that all decode to empty text."""
    events = [role()] + [chat("") for _ in range(255)] + [chat("", finish="length"), usage(256), DONE]
    r = run_events(events)
    assert r.success and r.error is None
    assert r.completion_tokens == 256 and r.output_chars == 0
    assert r.chunks == 256 and len(r.itl) == 255  # every empty chunk timed; the role preamble is not a token
    assert r.ttft is not None and r.e2el is not None and r.ttft <= r.e2el
    # The same on /v1/completions, where chunks carry `text`.
    c = run_events([comp("") for _ in range(255)] + [comp("", finish="length"), usage(256), DONE], is_chat=False)
    assert c.success and c.completion_tokens == 256 and c.chunks == 256 and len(c.itl) == 255


def test_finish_reason_without_done_marker_is_a_normal_end() -> None:
    r = run_events([chat("hi"), chat("", finish="stop"), usage(2)])
    assert r.success and r.completion_tokens == 2


@pytest.mark.parametrize(
    "events, status, needle",
    [
        ([chat(""), chat("", finish="length"), usage(0), DONE], 200, "no token"),  # zero completion tokens
        ([role(), usage(0), DONE], 200, "no token"),
        ([chat("a"), {"error": {"message": "engine died", "code": 500}}, DONE], 200, "engine died"),
        ([chat("a"), chat("b")], 200, "ended before"),  # cut: no [DONE], no finish_reason
        ([], 500, "HTTP 500"),
    ],
)
def test_real_errors_are_failures(events: list, status: int, needle: str) -> None:
    r = run_events(events, status=status)
    assert not r.success and needle in (r.error or "")


def test_transport_failure_is_a_failure() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
            return await stream_request(client, CHAT_URL, {}, {}, chat=True)

    r = asyncio.run(go())
    assert not r.success and "ConnectError" in (r.error or "") and r.status is None


def test_parse_chunk_token_rules() -> None:
    assert parse_chunk(role(), chat=True) == (False, "", False)  # preamble: not a token
    assert parse_chunk(chat(""), chat=True) == (True, "", False)  # empty text: still a token
    assert parse_chunk(chat("x", finish="stop"), chat=True) == (True, "x", True)
    assert parse_chunk(usage(3), chat=True) == (False, "", False)  # usage chunk: choices []
    assert parse_chunk(comp(""), chat=False) == (True, "", False)
    first = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "finish_reason": None}]}
    assert parse_chunk(first, chat=True) == (True, "Hi", False)  # a role chunk that carries text is a token


# ---- 2. metric definitions on hand-computed timelines ------------------------------------------------------

# Request A (chat), sent at t = 10.000 s:
#   10.010 role preamble (not a token)   10.100 ""  -> TTFT 100 ms     10.120 "a"  10.150 ""
#   10.200 "b" finish=length (last token chunk -> E2EL 200 ms)        10.300 usage: 5 tokens   10.400 [DONE]
#   ITL = 20, 30, 50 ms; TPOT = (200 - 100) / (5 - 1) = 25 ms (one chunk carried two tokens)
TIMELINE_A = [
    (10.010, role()),
    (10.100, chat("")),
    (10.120, chat("a")),
    (10.150, chat("")),
    (10.200, chat("b", finish="length")),
    (10.300, usage(5, prompt=30)),
    (10.400, DONE),
]
# Request B (completions), sent at t = 10.050 s:
#   10.350 "x" -> TTFT 300 ms   10.450 ""   10.650 "y" finish -> E2EL 600 ms   10.700 usage: 3 tokens   10.710 [DONE]
#   ITL = 100, 200 ms; TPOT = (600 - 300) / (3 - 1) = 150 ms
TIMELINE_B = [
    (10.350, comp("x")),
    (10.450, comp("")),
    (10.650, comp("y", finish="length")),
    (10.700, usage(3, prompt=10)),
    (10.710, DONE),
]


def test_request_timings_follow_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    a = timed_run(monkeypatch, 10.000, TIMELINE_A, is_chat=True)
    assert a.success
    assert a.ttft == pytest.approx(0.100)
    assert a.itl == pytest.approx([0.020, 0.030, 0.050])
    assert a.e2el == pytest.approx(0.200)  # the usage chunk and [DONE] do not extend it
    assert a.end == pytest.approx(10.400)  # last byte, kept apart
    assert (a.completion_tokens, a.prompt_tokens) == (5, 30)
    b = timed_run(monkeypatch, 10.050, TIMELINE_B, is_chat=False)
    assert b.success
    assert b.ttft == pytest.approx(0.300) and b.e2el == pytest.approx(0.600)
    assert b.itl == pytest.approx([0.100, 0.200])


def test_aggregate_on_hand_computed_timelines(monkeypatch: pytest.MonkeyPatch) -> None:
    a = timed_run(monkeypatch, 10.000, TIMELINE_A, is_chat=True)
    b = timed_run(monkeypatch, 10.050, TIMELINE_B, is_chat=False)
    failed = timed_run(monkeypatch, 10.060, [(10.5, comp("z")), (10.6, {"error": {"message": "boom"}})], False)
    assert not failed.success
    p = aggregate([a, b, failed], duration=2.0, slo=SLO(ttft_p95_ms=250, tpot_p95_ms=100))
    assert (p["completed"], p["failed"]) == (2, 1)
    assert p["total_output_tokens"] == 8 and p["total_input_tokens"] == 40  # usage counts, failed excluded
    assert p["output_throughput"] == pytest.approx(4.0)  # 8 tokens / 2 s
    assert p["request_throughput"] == pytest.approx(1.0)
    assert p["total_token_throughput"] == pytest.approx(24.0)
    assert p["mean_ttft_ms"] == pytest.approx(200.0) and p["median_ttft_ms"] == pytest.approx(200.0)
    assert p["mean_tpot_ms"] == pytest.approx(87.5)  # (25 + 150) / 2
    assert p["p99_tpot_ms"] == pytest.approx(25 + 0.99 * 125)  # linear interpolation between 25 and 150
    assert p["mean_itl_ms"] == pytest.approx(80.0)  # (20 + 30 + 50 + 100 + 200) / 5
    assert p["median_itl_ms"] == pytest.approx(50.0)
    assert p["mean_e2el_ms"] == pytest.approx(400.0)  # (200 + 600) / 2
    assert p["std_e2el_ms"] == pytest.approx(200.0)  # population std, as numpy / vLLM
    assert p["request_goodput"] == pytest.approx(0.5)  # A meets 250 ms / 100 ms; B's TTFT 300 ms does not
    assert p["max_concurrent_requests"] == 2  # [10.0, 10.2) and [10.05, 10.65)
    assert p["max_output_tokens_per_s"] == 7.0  # the 7 token chunks all land in second 0 from 10.000
    assert p["error_counts"] == {"stream": 1} and "boom" in p["errors"][0]


def test_peak_tokens_per_second_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks at 0.5, 1.2, 1.4, 1.9, 2.1 s after the start: buckets [1, 3, 1] -> peak 3.
    times = [0.5, 1.2, 1.4, 1.9, 2.1]
    events: list[tuple[float, dict | str]] = [(t, comp("w")) for t in times[:-1]]
    events += [(times[-1], comp("w", finish="length")), (2.2, usage(5)), (2.3, DONE)]
    r = timed_run(monkeypatch, 0.0, events, is_chat=False)
    p = aggregate([r], duration=2.3)
    assert p["max_output_tokens_per_s"] == 3.0
    assert p["mean_tpot_ms"] == pytest.approx((2100 - 500) / 4)


# ---- the point's duration: first request dispatched -> last response done --------------------------------


def _patch_async_client(monkeypatch: pytest.MonkeyPatch, handler: Callable) -> None:
    real = httpx.AsyncClient
    transport = httpx.MockTransport(handler)

    def make(*args, **kwargs):  # noqa: ANN002, ANN003 - httpx's own signature
        kwargs["transport"] = transport
        return real(*args, **kwargs)

    monkeypatch.setattr(runner.httpx, "AsyncClient", make)


def test_point_duration_and_throughput(monkeypatch: pytest.MonkeyPatch) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(404)

        async def body() -> AsyncIterator[bytes]:
            for i in range(4):
                await asyncio.sleep(0.025)
                yield f"data: {json.dumps(comp('', finish='length' if i == 3 else None))}\n\n".encode()
            yield f"data: {json.dumps(usage(16))}\n\ndata: [DONE]\n\n".encode()

        return httpx.Response(200, content=body())

    _patch_async_client(monkeypatch, handler)
    target = runner.Target(root="http://x", headers={}, timeout=30.0, endpoint="completions")
    workload = Workload(endpoint="completions", model="m", input_len=8, output_len=16)
    cfg = runner.PointConfig(concurrency=2, num_prompts=6, warmup=2)  # the warm-up wave is not timed
    point = asyncio.run(runner.run_point(target, workload, cfg, SLO(), seed=0, show_progress=False, keep_details=True))
    assert point["completed"] == 6 and point["failed"] == 0 and len(point["requests"]) == 6
    assert point["total_output_tokens"] == 96  # usage (16 each), not the 4 empty chunks
    reqs = point["requests"]
    span = max(r["end"] for r in reqs) - min(r["start"] for r in reqs)
    # Three waves of ~100 ms: the duration covers first send -> last response, and little more.
    assert span <= point["duration"] < span + 0.05
    assert point["output_throughput"] == pytest.approx(96 / point["duration"])
    assert all(len(r["itl"]) == 3 and r["success"] for r in reqs)


# ---- 3. the random-mm image workload -----------------------------------------------------------------------


def _decode(uri: str):
    from PIL import Image

    head, _, data = uri.partition(",")
    assert head == "data:image/jpeg;base64"
    image = Image.open(io.BytesIO(base64.b64decode(data)))
    image.load()
    return image


def test_image_request_body_shape_and_image() -> None:
    w = Workload(endpoint="chat", model="m", input_len=20, output_len=128, image_sizes=parse_image_sizes("1000x750"))
    w.words_per_prompt = 20
    body = w.body(w.next_specs(1)[0])
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 128 and "prompt" not in body
    (message,) = body["messages"]
    assert message["role"] == "user"
    text, image = message["content"]  # text first, then exactly one image (vLLM's mm_position "last")
    assert text["type"] == "text" and len(text["text"].split()) == 20
    assert image["type"] == "image_url" and set(image["image_url"]) == {"url"}
    decoded = _decode(image["image_url"]["url"])
    assert decoded.format == "JPEG" and decoded.mode == "RGB" and decoded.size == (1000, 750)  # W x H
    # Per-pixel noise as vLLM draws it (iid uniform), not smooth blocks: neighbours differ by ~85 on average.
    pixels = np.asarray(decoded, dtype=float)
    assert np.abs(np.diff(pixels, axis=1)).mean() > 40


def test_images_are_deterministic_per_seed() -> None:
    def urls(seed: int, words: int = 4) -> list[str]:
        w = Workload(endpoint="chat", model="m", input_len=4, output_len=4, seed=seed, image_sizes=[(64, 48)])
        w.words_per_prompt = words
        return [s.images[0] for s in w.next_specs(3)]

    first = urls(7)
    assert urls(7) == first  # same seed, same images
    assert urls(7, words=50) == first  # whatever the text length calibration picked
    assert len(set(first)) == 3  # every request its own image
    assert urls(8) != first  # another seed, other images
    assert all(_decode(u).size == (64, 48) for u in first)


def test_image_calibration_counts_text_tokens_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """With images, --input-len is the text's own length (vLLM's --random-input-len), so the chat template's
    overhead is not taken off it. The fake server counts 1.5 tokens per word plus 12 of template."""
    seen: list[dict] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        content = body["messages"][-1]["content"]
        words = len((content if isinstance(content, str) else content[0]["text"]).split())
        prompt = 12 + math.ceil(1.5 * words)
        events = [chat("", finish="length"), usage(1, prompt=prompt), DONE]
        return httpx.Response(200, content="".join(f"data: {e if e == DONE else json.dumps(e)}\n\n" for e in events))

    _patch_async_client(monkeypatch, handler)
    target = runner.Target(root="http://x", headers={}, timeout=30.0, endpoint="chat")
    with_image = Workload(endpoint="chat", model="m", input_len=30, output_len=8, image_sizes=[(32, 32)])
    info = asyncio.run(runner.calibrate(target, with_image))
    assert info["calibrated"] and info["tokens_per_word"] == pytest.approx(1.5)
    assert with_image.words_per_prompt == 20  # 30 text tokens / 1.5; the 12 template tokens not subtracted
    assert all(isinstance(b["messages"][-1]["content"], str) for b in seen)  # probes carry no image
    text_only = Workload(endpoint="chat", model="m", input_len=30, output_len=8)
    asyncio.run(runner.calibrate(target, text_only))
    assert text_only.words_per_prompt == 12  # (30 - 12) / 1.5: the whole prompt lands on --input-len


def test_cli_image_flag_builds_the_random_mm_workload() -> None:
    import argparse

    from pagoda.tools.bench.cli import BenchUsageError, _build_workload, add_bench_args

    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    w = _build_workload(parser.parse_args(["--image", "1000x750", "--input-len", "20", "--seed", "3"]), "m")
    assert w.endpoint == "chat" and w.image_sizes == [(1000, 750)] and w.images_per_request == 1 and w.seed == 3
    assert all("detail" not in p.get("image_url", {}) for p in w.body(w.next_specs(1)[0])["messages"][-1]["content"])
    low = _build_workload(parser.parse_args(["--image", "1000x750", "--image-detail", "low"]), "m")
    parts = low.body(low.next_specs(1)[0])["messages"][-1]["content"]
    assert [p["image_url"]["detail"] for p in parts if p["type"] == "image_url"] == ["low"]
    with pytest.raises(BenchUsageError, match="--image-detail needs --image"):
        _build_workload(parser.parse_args(["--image-detail", "low"]), "m")
    with pytest.raises(BenchUsageError):
        _build_workload(parser.parse_args(["--image", "1000x750", "--endpoint", "completions"]), "m")
