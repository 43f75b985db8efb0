"""Sending: the shared token bucket and the async worker pool; the retry rules are `retry.py`'s.

A Retry-After also pauses the shared rate limiter, so every worker backs off, not only the one that got it.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from pagoda.tools.batch import media, output
from pagoda.tools.batch.inputs import BatchItem, ImageRef, set_image_url
from pagoda.tools.batch.retry import (
    DEFAULT_MAX_RETRIES,
    retry_delay,
    should_retry_status,
)

# ---------------------------------------------------------------------------------------------- rate limit


class TokenBucket:
    """A token bucket shared by every worker: `rate` tokens/s, at most `capacity` stored, one token per HTTP
    attempt. `reserve` takes a token now and returns how long to wait for it; the balance may go negative
    (tokens owed), so concurrent callers are spaced 1/rate apart without a lock. `rate=None`: no limit
    (only pauses apply). `pause(s)`: no token is handed out for `s` seconds (a server's Retry-After); tokens
    still accrue meanwhile, up to `capacity`."""

    def __init__(self, rate: float | None, capacity: float = 1.0, clock: Callable[[], float] = time.monotonic):
        if rate is not None and rate <= 0:
            raise ValueError("rate must be > 0")
        self.rate = rate
        self.capacity = max(1.0, float(capacity))
        self._clock = clock
        self._tokens = self.capacity
        self._last = clock()

    def _refill(self, now: float) -> None:
        if now > self._last:
            if self.rate is not None:
                self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.rate)
            self._last = now

    def reserve(self, now: float | None = None) -> float:
        now = self._clock() if now is None else now
        self._refill(now)
        wait = max(0.0, self._last - now)  # inside a pause, _last is the pause's end
        if self.rate is None:
            return wait
        self._tokens -= 1.0
        return wait + (max(0.0, -self._tokens) / self.rate)

    def pause(self, seconds: float, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        self._refill(now)
        end = now + seconds
        if end > self._last:
            if self.rate is not None:
                self._tokens = min(self.capacity, self._tokens + (end - self._last) * self.rate)
            self._last = end

    async def acquire(self) -> None:
        delay = self.reserve()
        if delay > 0:
            await asyncio.sleep(delay)


# ---------------------------------------------------------------------------------------------- the pool


@dataclass
class SendConfig:
    root: str  # server root, no trailing /v1
    headers: dict[str, str] = field(default_factory=dict)
    concurrency: int = 16
    timeout: float = 600.0  # s per HTTP attempt, whole response
    max_retries: int = DEFAULT_MAX_RETRIES
    rate: float | None = None  # requests (attempts) per second
    burst: float = 1.0
    send_urls: bool = False
    max_pixels: int | None = None
    fetch_timeout: float = media.DEFAULT_FETCH_TIMEOUT_S
    max_image_bytes: int = media.DEFAULT_MAX_IMAGE_BYTES
    progress: bool = True
    seed: int | None = None


@dataclass
class Stats:
    total: int = 0
    ok: int = 0
    failed: int = 0
    abandoned: int = 0  # started but stopped by an interrupt before a result: no row, redone next run
    retrying: int = 0  # now waiting for a retry
    retries: int = 0  # retry attempts made (HTTP and image fetch)
    in_flight: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    statuses: Counter = field(default_factory=Counter)  # final HTTP status of every written row
    error_codes: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)
    interrupted: bool = False
    forced: bool = False

    def tokens_per_s(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.completion_tokens / elapsed if elapsed > 0 else 0.0


@dataclass
class Outcome:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None
    request_id: str | None = None
    code: str | None = None  # set on failure
    message: str | None = None
    retryable: bool = False
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.code is None


def _truncate(text: str, limit: int = output.MAX_TEXT_BODY) -> str:
    return text if len(text) <= limit else text[:limit] + "...[truncated]"


def _error_fields(status: int, body: Any) -> tuple[str, str]:
    """(code, message) from an error response: OpenAI's {"error": {...}}, FastAPI's {"detail": ...}, or text."""
    code, message = f"http_{status}", ""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            code = str(err.get("code") or err.get("type") or code)
            message = str(err.get("message") or "")
        elif isinstance(err, str):
            message = err
        elif "detail" in body:
            message = body["detail"] if isinstance(body["detail"], str) else json.dumps(body["detail"])
        if not message and "message" in body:
            message = str(body["message"])
    elif isinstance(body, str):
        message = body
    return code, (f"HTTP {status}: " + (message[:1000] if message else "(empty body)"))


class Runner:
    """Sends `items` with `concurrency` workers sharing one TokenBucket; appends a success row to `out` or a
    failure row to `err` per finished item. First SIGINT/SIGTERM: stop taking items, let in-flight attempts
    finish (no further retries), return. Second SIGINT: cancel what is in flight and return at once."""

    def __init__(
        self,
        cfg: SendConfig,
        items: list[BatchItem],
        out: output.JsonlWriter,
        err: output.JsonlWriter,
        attempts_before: dict[str, int] | None = None,
        log: Callable[[str], None] | None = None,
    ):
        self.cfg = cfg
        self.queue: deque[BatchItem] = deque(items)
        self.out = out
        self.err = err
        self.attempts_before = attempts_before or {}
        self.stats = Stats(total=len(items))
        self.bucket = TokenBucket(cfg.rate, cfg.burst)
        self.rng = random.Random(cfg.seed)
        self.stopping = False
        self._stop_event: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._bar: Any = None
        self._drawn = 0.0
        self._redraw_s = 0.2
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    # ---- lifecycle

    def _on_signal(self, signum: int) -> None:
        if not self.stopping:
            self.stopping = True
            self.stats.interrupted = True
            assert self._stop_event is not None
            self._stop_event.set()
            name = signal.Signals(signum).name
            self._log(
                f"\npagoda batch: {name}: finishing {self.stats.in_flight} in-flight request(s), "
                "then flushing; Ctrl-C again to abort them"
            )
        else:
            self.stats.forced = True
            self._log("\npagoda batch: aborting in-flight requests")
            for task in self._tasks:
                task.cancel()

    async def run(self) -> Stats:
        self._stop_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # no signal handlers here (not the main thread, or Windows): Ctrl-C stays default
        if self.cfg.progress:
            tty = sys.stderr.isatty()
            self._redraw_s = 0.2 if tty else 2.0
            self._bar = tqdm(
                total=self.stats.total,
                unit="req",
                file=sys.stderr,
                dynamic_ncols=True,
                desc="batch",
                smoothing=0.1,
                mininterval=self._redraw_s,
            )
            self._refresh(force=True)
        limits = httpx.Limits(
            max_connections=self.cfg.concurrency + 4, max_keepalive_connections=self.cfg.concurrency + 4
        )
        timeout = httpx.Timeout(self.cfg.timeout, connect=min(self.cfg.timeout, 10.0))
        try:
            async with httpx.AsyncClient(
                base_url=self.cfg.root, headers=self.cfg.headers, timeout=timeout, limits=limits
            ) as client:
                self._tasks = [
                    asyncio.create_task(self._worker(client))
                    for _ in range(max(1, min(self.cfg.concurrency, len(self.queue) or 1)))
                ]
                await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            if self._bar is not None:
                self._refresh(force=True)
                self._bar.close()
        return self.stats

    def _refresh(self, force: bool = False) -> None:
        """Update the bar's counters; redraw at most every 0.2 s (a terminal) or 2 s (a log file)."""
        if self._bar is None:
            return
        s = self.stats
        self._bar.set_postfix_str(
            f"ok={s.ok} failed={s.failed} retrying={s.retrying} tok/s={s.tokens_per_s():.1f}", refresh=False
        )
        now = time.monotonic()
        if force or now - self._drawn >= self._redraw_s:
            self._drawn = now
            self._bar.refresh()

    async def _worker(self, client: httpx.AsyncClient) -> None:
        while self.queue and not self.stopping:
            item = self.queue.popleft()
            self.stats.in_flight += 1
            try:
                await self._process(client, item)
            except asyncio.CancelledError:
                self.stats.abandoned += 1
                raise
            finally:
                self.stats.in_flight -= 1
                if item.image is not None:
                    item.image.data = None  # prefetched page bytes are no longer needed

    async def _sleep(self, seconds: float) -> bool:
        """Sleep, waking early on an interrupt. True when the full time passed."""
        assert self._stop_event is not None
        if self.stopping:
            return False
        try:
            await asyncio.wait_for(self._stop_event.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            return True
        return False

    # ---- one item

    def _meta(
        self,
        item: BatchItem,
        attempts: int,
        started_wall: float,
        t0: float,
        history: list[dict[str, Any]],
        extra: dict[str, Any],
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "attempts": attempts,
            "latency_s": round(time.perf_counter() - t0, 4),
            "source": item.source,
            "started_at": round(started_wall, 3),
            "finished_at": round(time.time(), 3),
        }
        if self.attempts_before.get(item.custom_id):
            meta["attempts_before"] = self.attempts_before[item.custom_id]
        if history:
            meta["history"] = history
        meta.update(extra)
        return meta

    def _finish_ok(self, item: BatchItem, o: Outcome, meta: dict[str, Any]) -> None:
        self.out.write(output.success_row(item.custom_id, o.status or 200, o.request_id, o.body, meta))
        self.stats.ok += 1
        self.stats.statuses[o.status] += 1
        usage = o.body.get("usage") if isinstance(o.body, dict) else None
        if isinstance(usage, dict):
            self.stats.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            self.stats.completion_tokens += int(usage.get("completion_tokens") or 0)
        self._done()

    def _finish_error(self, item: BatchItem, o: Outcome, meta: dict[str, Any]) -> None:
        self.err.write(
            output.error_row(item.custom_id, o.status, o.request_id, o.body, o.code or "error", o.message or "", meta)
        )
        self.stats.failed += 1
        self.stats.statuses[o.status if o.status is not None else "none"] += 1
        self.stats.error_codes[o.code or "error"] += 1
        self._done()

    def _done(self) -> None:
        if self._bar is not None:
            self._refresh()
            self._bar.update(1)

    async def _wait_retry(self, retries_done: int, headers: Mapping[str, str]) -> tuple[bool, float, bool]:
        delay, from_server = retry_delay(retries_done, headers, self.rng)
        if from_server:
            self.bucket.pause(delay)  # everyone backs off, not only this worker
        self.stats.retrying += 1
        self._refresh()
        try:
            slept = await self._sleep(delay)
        finally:
            self.stats.retrying -= 1
            self._refresh()
        return slept, delay, from_server

    async def _process(self, client: httpx.AsyncClient, item: BatchItem) -> None:
        started_wall, t0 = time.time(), time.perf_counter()
        history: list[dict[str, Any]] = []
        extra: dict[str, Any] = {}
        body = item.body
        if item.image is not None:
            resolved = await self._resolve_image(item.image, history)
            if isinstance(resolved, Outcome):
                if resolved.code == "interrupted":
                    self.stats.abandoned += 1
                    return
                self._finish_error(item, resolved, self._meta(item, 0, started_wall, t0, history, {"stage": "image"}))
                return
            url, extra = resolved
            body = set_image_url(body, url)
        attempts = 0
        while True:
            attempts += 1
            await self.bucket.acquire()
            o = await self._attempt(client, item.url, body)
            if o.ok:
                self._finish_ok(item, o, self._meta(item, attempts, started_wall, t0, history, extra))
                return
            entry: dict[str, Any] = {
                "attempt": attempts,
                "status": o.status,
                "code": o.code,
                "latency_s": round(o.latency_s, 4),
            }
            history.append(entry)
            if not o.retryable or attempts > self.cfg.max_retries:
                meta = self._meta(item, attempts, started_wall, t0, history, extra)
                meta["retryable"] = o.retryable
                if o.headers:
                    meta["headers"] = {
                        k: v
                        for k, v in o.headers.items()
                        if k in ("retry-after", "retry-after-ms", "x-should-retry", "x-request-id", "content-type")
                    }
                self._finish_error(item, o, meta)
                return
            if self.stopping:
                self.stats.abandoned += 1  # no row: it is simply redone by the next run
                return
            slept, delay, from_server = await self._wait_retry(attempts - 1, o.headers)
            entry["retry_in_s"] = round(delay, 3)
            if from_server:
                entry["retry_after"] = True
            if not slept:
                self.stats.abandoned += 1
                return
            self.stats.retries += 1

    async def _attempt(self, client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Outcome:
        t = time.perf_counter()
        o = Outcome()
        try:
            response = await asyncio.wait_for(client.post(path, json=body), self.cfg.timeout)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            o.code, o.retryable = "timeout", True
            o.message = f"no complete response within {self.cfg.timeout:g} s"
        except httpx.TransportError as exc:
            cause = exc.__cause__ or exc.__context__
            detail = str(exc) or (f"{type(cause).__name__}: {cause}" if cause is not None else "")
            o.code, o.retryable = "connection_error", True
            o.message = f"{type(exc).__name__}: {detail}"[:1000]
        if o.code is not None:
            o.latency_s = time.perf_counter() - t
            return o
        o.latency_s = time.perf_counter() - t
        o.status = response.status_code
        o.headers = {k.lower(): v for k, v in response.headers.items()}
        try:
            o.body = response.json()
        except ValueError:
            o.body = _truncate(response.text)
        o.request_id = o.headers.get("x-request-id") or (
            o.body.get("id") if isinstance(o.body, dict) and isinstance(o.body.get("id"), str) else None
        )
        if 200 <= o.status < 300:
            if not isinstance(o.body, dict):
                o.code, o.message = "invalid_response", f"HTTP {o.status} with a body that is not a JSON object"
            return o
        o.code, o.message = _error_fields(o.status, o.body)
        o.retryable = should_retry_status(o.status, o.headers)
        return o

    async def _resolve_image(self, ref: ImageRef, history: list[dict[str, Any]]) -> tuple[str, dict] | Outcome:
        """The URL to put in the request (a data URI, or the http URL with --send-urls) and facts for x_meta;
        an Outcome on failure. Fetching and encoding run in a thread; fetch errors follow the retry rules."""
        if self.cfg.send_urls and ref.kind in ("url", "page"):
            return ref.location, {"image_url": ref.location}
        tries = 0
        while True:
            tries += 1
            try:
                img = await asyncio.to_thread(load_image, ref, self.cfg)
            except media.MediaError as exc:
                history.append({"attempt": tries, "stage": "image", "status": exc.status, "code": exc.code})
                if not exc.retryable or tries > self.cfg.max_retries:
                    return Outcome(status=None, code=exc.code, message=exc.message, retryable=exc.retryable)
                if self.stopping:
                    return Outcome(code="interrupted")
                slept, delay, _ = await self._wait_retry(tries - 1, exc.headers)
                history[-1]["retry_in_s"] = round(delay, 3)
                if not slept:
                    return Outcome(code="interrupted")
                self.stats.retries += 1
                continue
            facts: dict[str, Any] = {
                "image_sha256": img.sha256,
                "image_size": list(img.original_size),
                "image_bytes": img.original_bytes,
            }
            if (img.width, img.height) != img.original_size:
                facts["sent_size"] = [img.width, img.height]
            if ref.kind != "file":
                facts["image_url"] = ref.location
            if ref.page:
                facts["page"] = ref.page
            return img.data_uri(), facts


def load_image(ref: ImageRef, cfg: SendConfig) -> media.ImageData:
    """Blocking: read or fetch the bytes, check and optionally downscale them."""
    if ref.data is not None:
        data = ref.data
    elif ref.kind == "file":
        data = media.read_file_bytes(ref.location, cfg.max_image_bytes)
    else:
        data = media.fetch(ref.location, timeout=cfg.fetch_timeout, max_bytes=cfg.max_image_bytes).data
    return media.prepare(data, cfg.max_pixels, ref.location)
