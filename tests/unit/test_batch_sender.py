"""`pagoda batch` sending rules: retry classification, Retry-After parsing, backoff with jitter, token bucket."""

from __future__ import annotations

import asyncio
import email.utils
import random
import time

import pytest

from pagoda.tools.batch.retry import (
    MAX_RETRY_DELAY_S,
    backoff_delay,
    parse_retry_after,
    retry_delay,
    should_retry_status,
)
from pagoda.tools.batch.sender import TokenBucket, _error_fields


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504, 599])
def test_retried_statuses(status: int) -> None:
    assert should_retry_status(status, {})


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422, 418, 302])
def test_not_retried_statuses(status: int) -> None:
    assert not should_retry_status(status, {})


def test_x_should_retry_overrides_except_for_never_retried() -> None:
    assert not should_retry_status(503, {"x-should-retry": "false"})
    assert should_retry_status(418, {"x-should-retry": "true"})
    assert should_retry_status(429, {"X-Should-Retry": "TRUE"})
    for status in (400, 401, 404, 413, 422):
        assert not should_retry_status(status, {"x-should-retry": "true"})


def test_parse_retry_after_forms() -> None:
    assert parse_retry_after({"retry-after": "3"}) == 3.0
    assert parse_retry_after({"Retry-After": " 1.5 "}) == 1.5
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25  # ms wins
    assert parse_retry_after({"retry-after-ms": "junk", "retry-after": "2"}) == 2.0
    now = 1_700_000_000.0
    date = email.utils.formatdate(now + 7, usegmt=True)
    assert parse_retry_after({"retry-after": date}, now=now) == pytest.approx(7.0, abs=1e-6)
    assert parse_retry_after({"retry-after": "soon"}) is None
    assert parse_retry_after({}) is None


def test_retry_delay_honours_retry_after_in_range() -> None:
    rng = random.Random(0)
    assert retry_delay(0, {"retry-after": "2"}, rng) == (2.0, True)
    assert retry_delay(3, {"retry-after-ms": "100"}, rng) == (0.1, True)
    assert retry_delay(0, {"retry-after": "60"}, rng) == (60.0, True)
    for headers in ({"retry-after": "61"}, {"retry-after": "0"}, {"retry-after": "-5"}, {}):
        delay, from_server = retry_delay(0, headers, rng)
        assert not from_server and 0.375 <= delay <= 0.5


def test_backoff_is_exponential_capped_with_jitter() -> None:
    rng = random.Random(1)
    for n in range(10):
        base = min(0.5 * 2**n, MAX_RETRY_DELAY_S)
        samples = [backoff_delay(n, rng) for _ in range(200)]
        assert all(0.75 * base <= s <= base for s in samples)
        assert max(samples) - min(samples) > 0.1 * base  # jitter is really applied
    assert backoff_delay(20, rng) <= MAX_RETRY_DELAY_S


def test_error_fields() -> None:
    code, message = _error_fields(
        400, {"error": {"message": "bad image", "type": "invalid_request_error", "code": None}}
    )
    assert code == "invalid_request_error" and message == "HTTP 400: bad image"
    assert _error_fields(422, {"detail": [{"loc": ["body"]}]})[1].startswith("HTTP 422: [")
    assert _error_fields(503, "upstream down") == ("http_503", "HTTP 503: upstream down")
    assert _error_fields(500, "") == ("http_500", "HTTP 500: (empty body)")


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_token_bucket_spaces_requests_at_the_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=10.0, capacity=1, clock=clock)
    waits = [bucket.reserve() for _ in range(21)]  # 21 callers at the same instant
    assert waits[0] == 0.0
    assert waits == pytest.approx([i / 10.0 for i in range(21)])
    clock.t += 5.0  # long idle: the bucket refills to its capacity only
    assert bucket.reserve() == 0.0
    assert bucket.reserve() == pytest.approx(0.1)


def test_token_bucket_burst_then_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, capacity=3, clock=clock)
    waits = [bucket.reserve() for _ in range(5)]
    assert waits == pytest.approx([0, 0, 0, 0.5, 1.0])
    # Over any long window the count never exceeds capacity + rate * window.
    clock.t += 100
    times = []
    for _ in range(200):
        times.append(clock.t + bucket.reserve())
    span = max(times) - min(times)
    assert 200 <= 3 + 2.0 * span + 1e-9


def test_token_bucket_pause_holds_everyone() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=10.0, capacity=1, clock=clock)
    assert bucket.reserve() == 0.0
    clock.t += 1.0
    bucket.pause(2.0)
    assert bucket.reserve() == pytest.approx(2.0)
    assert bucket.reserve() == pytest.approx(2.1)
    unlimited = TokenBucket(rate=None, clock=clock)
    assert unlimited.reserve() == 0.0 and unlimited.reserve() == 0.0
    unlimited.pause(1.5)
    assert unlimited.reserve() == pytest.approx(1.5)
    with pytest.raises(ValueError):
        TokenBucket(rate=0)


def test_token_bucket_shared_by_async_workers() -> None:
    """Eight workers, one bucket at 40/s: 21 acquisitions take about 0.5 s of wall time."""

    async def main() -> float:
        bucket = TokenBucket(rate=40.0, capacity=1)
        count = 0

        async def worker() -> None:
            nonlocal count
            while count < 21:
                count += 1
                await bucket.acquire()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(8)))
        return time.perf_counter() - t0

    elapsed = asyncio.run(main())
    assert 0.45 <= elapsed < 1.5
