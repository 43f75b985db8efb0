"""Circuit breaker state machine and the active-probe thresholds (eject / readmit) of the router's backends."""

from __future__ import annotations

import asyncio

import httpx

from pagoda.tools.router.config import BackendConfig, BreakerConfig, HealthConfig, build_config
from pagoda.tools.router.health import CLOSED, HALF_OPEN, OPEN, Backend, CircuitBreaker, HealthChecker


def test_breaker_opens_after_consecutive_failures_only() -> None:
    b = CircuitBreaker(BreakerConfig(failures=3, open_seconds=10))
    b.record_failure(now=0)
    b.record_failure(now=1)
    b.record_success()  # a success resets the count
    b.record_failure(now=2)
    b.record_failure(now=3)
    assert b.state(now=3) == CLOSED and b.can_try(now=3)
    b.record_failure(now=4)
    assert b.state(now=4) == OPEN and not b.can_try(now=13.9)
    assert b.opens == 1


def test_breaker_half_open_lets_one_trial_through() -> None:
    b = CircuitBreaker(BreakerConfig(failures=1, open_seconds=10))
    b.record_failure(now=0)
    assert b.state(now=5) == OPEN
    assert b.state(now=10) == HALF_OPEN and b.can_try(now=10)
    assert b.begin_attempt(now=10) is True  # the trial
    assert not b.can_try(now=10.5)  # nobody else while it runs
    b.record_failure(now=11)  # trial failed: open again, cool-down restarts
    assert b.state(now=20) == OPEN and b.state(now=21) == HALF_OPEN
    b.begin_attempt(now=21)
    b.release()  # the client went away: no verdict, next one may try
    assert b.can_try(now=21)
    b.begin_attempt(now=22)
    b.record_success()
    assert b.state(now=22) == CLOSED and b.consecutive_failures == 0
    assert b.begin_attempt(now=23) is False  # closed: not a trial


def test_breaker_late_failure_while_open_keeps_cooldown() -> None:
    b = CircuitBreaker(BreakerConfig(failures=1, open_seconds=10))
    b.record_failure(now=0)
    b.record_failure(now=5)  # a request sent before it opened fails late
    assert b.state(now=10) == HALF_OPEN


def test_probe_thresholds_eject_and_readmit() -> None:
    answers: list[int | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "smol"}]})
        code = answers.pop(0)
        if code is None:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(code)

    cfg = build_config(None, {"backends": ["http://x:1"], "health.fail_threshold": 2, "health.pass_threshold": 3})

    class State:
        config = cfg
        backends = (Backend(cfg.backends[0], cfg.breaker),)

    async def go() -> list[tuple[bool, str]]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            checker = HealthChecker(State, client)
            backend = State.backends[0]
            seen = []
            answers.extend([200, None, 503, None, 200, 200, 200, 200])
            for _ in range(8):
                await checker.probe_all()
                seen.append((backend.healthy, backend.breaker.state()))
                if len(seen) == 3:
                    for _ in range(3):
                        backend.breaker.record_failure()
            return seen

    seen = asyncio.run(go())
    healthy = [h for h, _ in seen]
    # pass, fail, fail (ejected), fail, pass, pass, pass (readmitted), pass
    assert healthy == [True, True, False, False, False, False, True, True]
    assert seen[5][1] == OPEN and seen[6][1] == CLOSED  # readmission closes the breaker
    assert State.backends[0].models == ["smol"]  # learned from /v1/models on (re)admission


def test_backend_availability_needs_health_and_breaker() -> None:
    b = Backend(BackendConfig(url="http://x:1", name="x"), BreakerConfig(failures=1, open_seconds=5))
    assert b.available(now=0)
    b.breaker.record_failure(now=0)
    assert not b.available(now=1) and b.available(now=6)
    b.healthy = False
    assert not b.available(now=6)
    assert HealthConfig().path == "/health"
