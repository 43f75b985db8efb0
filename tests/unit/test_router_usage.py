"""Reading `usage` from a streamed SSE body as it passes (any chunking), hiding the usage-only chunk the router
asked for, and the per-key ledger."""

from __future__ import annotations

import json
import random

from pagoda.tools.router.usage import SSEUsageTap, UsageLedger, tokens_of, usage_of_json

USAGE = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}


def event(obj: object, sep: bytes = b"\n\n") -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + sep


def stream(sep: bytes = b"\n\n", with_usage: bool = True) -> tuple[bytes, bytes]:
    """(full stream, the same stream without the usage-only event)."""
    head = [
        event({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": None}, sep)
    ]
    # a content that mentions "usage" (escaped inside the JSON string) must not confuse the tap
    head += [
        event({"id": "x", "choices": [{"index": 0, "delta": {"content": t}}], "usage": None}, sep)
        for t in ["The ", '"usage": {1}', " end"]
    ]
    tail = [b"data: [DONE]" + sep]
    usage = [event({"id": "x", "choices": [], "usage": USAGE}, sep)] if with_usage else []
    return b"".join(head + usage + tail), b"".join(head + tail)


def chunked(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), 12))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


def run_tap(tap: SSEUsageTap, chunks: list[bytes]) -> tuple[bytes, list[bytes]]:
    outs = [tap.feed(c) for c in chunks]
    outs.append(tap.flush())
    return b"".join(outs), outs


def test_inspection_mode_is_byte_for_byte_and_immediate() -> None:
    full, _ = stream()
    for seed in range(20):
        chunks = chunked(full, random.Random(seed))
        tap = SSEUsageTap(drop_usage_chunk=False)
        out, outs = run_tap(tap, chunks)
        assert outs[:-1] == chunks and out == full  # every chunk goes out as it came, untouched
        assert tap.usage == USAGE


def test_drop_mode_hides_only_the_usage_event() -> None:
    for sep in (b"\n\n", b"\r\n\r\n"):
        full, without = stream(sep)
        for seed in range(20):
            tap = SSEUsageTap(drop_usage_chunk=True)
            out, _ = run_tap(tap, chunked(full, random.Random(seed)))
            assert out == without and tap.usage == USAGE and tap.dropped == 1


def test_drop_mode_forwards_complete_events_at_once() -> None:
    full, _ = stream()
    events = full.split(b"\n\n")[:-1]
    tap = SSEUsageTap(drop_usage_chunk=True)
    assert tap.feed(events[0] + b"\n\n" + events[1][:10]) == events[0] + b"\n\n"  # only the partial one waits
    assert tap.feed(events[1][10:] + b"\n\n") == events[1] + b"\n\n"  # whole once complete


def test_no_usage_and_continuous_usage() -> None:
    full, _ = stream(with_usage=False)
    tap = SSEUsageTap(drop_usage_chunk=True)
    assert run_tap(tap, [full])[0] == full and tap.usage is None
    # continuous_usage_stats: every chunk has usage; the last one counts and content chunks are never dropped
    events = [
        event({"choices": [{"delta": {"content": "a"}}], "usage": {"prompt_tokens": 3, "completion_tokens": i}})
        for i in (1, 2)
    ]
    events.append(event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}))
    tap = SSEUsageTap(drop_usage_chunk=False)
    run_tap(tap, [b"".join(events) + b"data: [DONE]\n\n"])
    assert tokens_of(tap.usage) == (3, 2)


def test_unterminated_last_event_and_non_sse() -> None:
    tap = SSEUsageTap(drop_usage_chunk=False)
    last = event({"choices": [], "usage": USAGE})[:-2]
    assert run_tap(tap, [b"data: [DONE]\n\n", last])[0] == b"data: [DONE]\n\n" + last
    assert tap.usage == USAGE
    tap = SSEUsageTap(drop_usage_chunk=True)
    blob = b"x" * (2 << 20)
    assert run_tap(tap, [blob[:100], blob[100:]])[0] == blob  # not SSE: passed through whole


def test_json_usage_and_ledger() -> None:
    body = json.dumps({"choices": [], "usage": USAGE}).encode()
    assert tokens_of(usage_of_json(body)) == (12, 5)
    assert usage_of_json(b"not json") is None and tokens_of(None) is None
    ledger = UsageLedger()
    ledger.add("alice", 12, 5, counted=True)
    ledger.add("alice", 0, 0, counted=False)
    assert ledger.snapshot() == {
        "alice": {
            "requests": 2,
            "requests_without_usage": 1,
            "prompt_tokens": 12,
            "completion_tokens": 5,
            "total_tokens": 17,
        }
    }


def test_whole_events_without_usage_skip_the_parse(monkeypatch: object) -> None:
    """A chunk of whole events whose "usage" keys are all null goes out as it came without being split or
    parsed; a chunk that carries usage (or ends mid-event) is still examined event by event."""
    examined = []
    original = SSEUsageTap._examine

    def spy(self: SSEUsageTap, ev: bytes) -> bool:
        examined.append(ev)
        return original(self, ev)

    monkeypatch.setattr(SSEUsageTap, "_examine", spy)
    full, without = stream()
    plain = without.split(b"data: [DONE]")[0]
    for drop in (False, True):
        examined.clear()
        tap = SSEUsageTap(drop_usage_chunk=drop)
        assert tap.feed(plain) == plain and examined == [] and tap.usage is None
        tap = SSEUsageTap(drop_usage_chunk=drop)
        assert tap.feed(full) == (without if drop else full) and tap.usage == USAGE and examined
        examined.clear()
        tap = SSEUsageTap(drop_usage_chunk=drop)
        assert tap.feed(plain[:-1]) == (plain[:-1] if not drop else plain.rsplit(b"\n\n", 2)[0] + b"\n\n")
        assert examined  # ends mid-event: the slow path, which keeps the partial event pending
