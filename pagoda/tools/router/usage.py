"""Per-key usage accounting: the ledger, and a tap that reads `usage` out of SSE streams as they pass.

Non-streamed responses: `usage` of the JSON body. Streams: the router asks the backend for usage
(`stream_options.include_usage = true`) and reads the chunk that carries it (the last `data:` chunk
with a non-null `usage`; with `continuous_usage_stats` every chunk has one and the last wins). When the
client did not ask for usage itself, that usage-only chunk (`"choices": []`) is removed from what the
client receives -- some clients index `choices[0]` of every chunk -- and every other event passes
unchanged. The tap never waits for more than the rest of the SSE event it is inside: complete events
go out with the network chunk that completes them (and in pure inspection mode every chunk goes out as
it arrived, untouched).
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

_EVENT_END = re.compile(rb"\r?\n\r?\n")
_NO_USAGE = b'"usage":null'
_MAX_PENDING = 1 << 20  # an "event" longer than this is not SSE: stop inspecting, pass it through


def _loads(data: bytes) -> Any:
    return json.loads(data)


try:  # faster when present; not a dependency
    import orjson

    _loads = orjson.loads  # type: ignore[assignment]
except ImportError:  # pragma: no cover
    pass


def tokens_of(usage: Any) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) of an OpenAI usage object, or None if it is not one."""
    if not isinstance(usage, dict):
        return None
    try:
        return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    except (TypeError, ValueError):
        return None


def usage_of_json(body: bytes) -> dict[str, Any] | None:
    try:
        obj = _loads(body)
    except ValueError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None


class SSEUsageTap:
    """Feed it the raw upstream stream chunk by chunk; forward what `feed` returns; read `.usage` at the end.

    drop_usage_chunk=False: pure inspection, `feed` returns its input unchanged (byte-for-byte, no delay).
    drop_usage_chunk=True: whole events are returned as soon as they are complete; the usage-only event
    is left out.
    """

    def __init__(self, drop_usage_chunk: bool = False):
        self.drop = drop_usage_chunk
        self.usage: dict[str, Any] | None = None
        self.dropped = 0
        self._pending = b""
        self._inspecting = True

    def feed(self, chunk: bytes) -> bytes:
        if not self._inspecting:
            return chunk
        if not self._pending and chunk.endswith(b"\n\n") and chunk.count(b'"usage"') == chunk.count(_NO_USAGE):
            # The common case, one token's chunk: whole events (nothing left pending), and every "usage" key in
            # them is null, so no event carries usage or is the usage-only one. Nothing to split or parse.
            return chunk
        data = self._pending + chunk if self._pending else chunk
        pos = 0
        kept: list[bytes] | None = None  # only built once an event is dropped
        for m in _EVENT_END.finditer(data):
            start, end = pos, m.end()
            pos = end
            if self._examine(data[start : m.start()]):
                if kept is not None:
                    kept.append(data[start:end])
            else:
                if kept is None:
                    kept = [data[:start]]
                self.dropped += 1
        rest = data[pos:]
        if len(rest) > _MAX_PENDING:  # not SSE after all: pass everything through from here on
            self._inspecting = False
            self._pending = b""
            if not self.drop:
                return chunk
            return b"".join(kept) + rest if kept is not None else data
        self._pending = rest
        if not self.drop:
            return chunk
        if kept is None:
            return data[:pos]
        return b"".join(kept)

    def flush(self) -> bytes:
        """At the end of the stream: whatever is left of an unterminated last event."""
        rest, self._pending = self._pending, b""
        if not rest or not self._inspecting:
            return b""
        keep = self._examine(rest)
        if not self.drop:
            return b""
        return rest if keep else b""

    def _examine(self, event: bytes) -> bool:
        """Record usage carried by this event; False when it is the usage-only event to drop."""
        i = event.find(b'"usage"')
        if i < 0:
            return True
        after = event[i + 7 : i + 16].lstrip(b" \t:")
        if after.startswith(b"null"):
            return True
        lines = [line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")]
        if not lines:
            return True
        try:
            obj = _loads(b"\n".join(lines))
        except ValueError:
            return True
        if not isinstance(obj, dict) or not isinstance(obj.get("usage"), dict):
            return True
        self.usage = obj["usage"]
        return not (self.drop and obj.get("choices") == [])


def empty_row() -> dict[str, int]:
    """A key's usage row before any request."""
    return {"requests": 0, "requests_without_usage": 0, "prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


class UsageLedger:
    """Token totals per key label (thread-safe; the router runs on one loop but tests read from others)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[str, dict[str, int]] = {}

    def add(self, label: str, prompt_tokens: int, completion_tokens: int, counted: bool) -> None:
        with self._lock:
            row = self._rows.get(label)
            if row is None:
                row = self._rows[label] = empty_row()
            row["requests"] += 1
            if not counted:
                row["requests_without_usage"] += 1
            row["prompt_tokens"] += prompt_tokens
            row["completion_tokens"] += completion_tokens
            row["total_tokens"] += prompt_tokens + completion_tokens

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {k: dict(v) for k, v in self._rows.items()}
