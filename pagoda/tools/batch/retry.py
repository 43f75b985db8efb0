"""The retry rules of `pagoda batch` (the OpenAI Python SDK's conventions), shared by the sender and
the image fetcher.

- retried: connection errors, timeouts, HTTP 408, 409, 429 and every 5xx; a response header
  `x-should-retry: true|false` overrides the status (except for the never-retried statuses below);
- never retried: 400, 401, 403, 404, 413, 422 (and any other status not listed above);
- wait before retry n (n = 0, 1, ...): the server's `retry-after-ms` or `Retry-After` (delta-seconds or an
  HTTP-date) when it is in (0, 60] s, otherwise min(0.5 * 2**n, 8) s times a jitter factor in (0.75, 1];
- `--max-retries K` retries after the first attempt (K + 1 attempts at most).
"""

from __future__ import annotations

import email.utils
import random
import time
from collections.abc import Mapping

RETRY_STATUSES = frozenset({408, 409, 429})  # plus every status >= 500
NEVER_RETRY_STATUSES = frozenset({400, 401, 403, 404, 413, 422})
INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 8.0
MAX_RETRY_AFTER_S = 60.0
DEFAULT_MAX_RETRIES = 5


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        value = headers.get(name.title()) or headers.get(name.upper())
    return value


def should_retry_status(status: int, headers: Mapping[str, str] | None = None) -> bool:
    if status in NEVER_RETRY_STATUSES:
        return False
    override = (_header(headers or {}, "x-should-retry") or "").strip().lower()
    if override == "true":
        return True
    if override == "false":
        return False
    return status in RETRY_STATUSES or status >= 500


def parse_retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds the server asks us to wait: `retry-after-ms`, else `Retry-After` as delta-seconds or an
    HTTP-date (relative to `now`, a Unix time). None when absent or unparseable. Not clamped."""
    ms = _header(headers, "retry-after-ms")
    if ms is not None:
        try:
            return float(ms) / 1000.0
        except ValueError:
            pass
    value = _header(headers, "retry-after")
    if value is None:
        return None
    value = value.strip()
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return when.timestamp() - (time.time() if now is None else now)


def backoff_delay(retries_done: int, rng: random.Random | None = None) -> float:
    base = min(INITIAL_RETRY_DELAY_S * 2.0**retries_done, MAX_RETRY_DELAY_S)
    return base * (1.0 - 0.25 * (rng or random).random())


def retry_delay(
    retries_done: int,
    headers: Mapping[str, str] | None = None,
    rng: random.Random | None = None,
    now: float | None = None,
) -> tuple[float, bool]:
    """(seconds to wait, whether the server's Retry-After decided it)."""
    after = parse_retry_after(headers or {}, now)
    if after is not None and 0 < after <= MAX_RETRY_AFTER_S:
        return after, True
    return backoff_delay(retries_done, rng), False
