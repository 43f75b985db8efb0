"""Backends' runtime state: in-flight count, active health (probes) and the passive circuit breaker.

A backend takes new requests when it is healthy by the probes *and* its breaker lets a request through.

- Active: GET `/health` every `interval` s; `fail_threshold` consecutive failures eject the backend,
  `pass_threshold` consecutive passes readmit it (which also closes its breaker and refreshes the
  model ids it serves from `/v1/models`). Every ejection and readmission is logged.
- Passive (circuit breaker): request failures (connection errors, timeouts, 502/503/504, bodies that
  break) and streams that stall or are cut count; a stream's success counts at its clean end (a trial's at
  its first event); `failures` consecutive ones open the breaker; after `open_seconds` one trial request
  goes through (half-open): success closes it, failure reopens it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from pagoda.tools.router.config import BackendConfig, BreakerConfig, HealthConfig

logger = logging.getLogger("pagoda.tools.router")

CLOSED, HALF_OPEN, OPEN = "closed", "half-open", "open"
STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


class CircuitBreaker:
    def __init__(self, cfg: BreakerConfig, name: str = ""):
        self.cfg = cfg
        self.name = name
        self._state = CLOSED
        self.consecutive_failures = 0
        self.opened_at = 0.0
        self.trial_in_flight = False
        self.opens = 0

    def state(self, now: float | None = None) -> str:
        """The effective state: an open breaker whose cool-down has passed reads as half-open."""
        if self._state == OPEN:
            now = time.monotonic() if now is None else now
            if now - self.opened_at >= self.cfg.open_seconds:
                return HALF_OPEN
        return self._state

    def can_try(self, now: float | None = None) -> bool:
        state = self.state(now)
        return state == CLOSED or (state == HALF_OPEN and not self.trial_in_flight)

    def begin_attempt(self, now: float | None = None) -> bool:
        """Called when a request is sent; returns True when it is the half-open trial."""
        if self.state(now) == HALF_OPEN:
            self._state = HALF_OPEN
            self.trial_in_flight = True
            return True
        return False

    def record_success(self) -> None:
        if self._state != CLOSED:
            logger.info("backend %s: circuit breaker closed", self.name)
        self._state = CLOSED
        self.consecutive_failures = 0
        self.trial_in_flight = False

    def record_failure(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.consecutive_failures += 1
        self.trial_in_flight = False
        state = self.state(now)
        if state == OPEN:
            return  # already open (a request sent before it opened failed late)
        if state == HALF_OPEN or self.consecutive_failures >= self.cfg.failures:
            self._state = OPEN
            self.opened_at = now
            self.opens += 1
            logger.warning(
                "backend %s: circuit breaker open for %.1f s after %d consecutive failures",
                self.name,
                self.cfg.open_seconds,
                self.consecutive_failures,
            )

    def release(self) -> None:
        """A trial that ended without a verdict (the client went away): let another one through."""
        self.trial_in_flight = False

    def reset(self) -> None:
        self._state = CLOSED
        self.consecutive_failures = 0
        self.trial_in_flight = False


class Backend:
    """One upstream server: its settings and everything the router learns about it at run time."""

    def __init__(self, cfg: BackendConfig, breaker: BreakerConfig):
        self.cfg = cfg
        self.url = cfg.url
        self._urls: dict[str, Any] = {}
        self.set_config(cfg, breaker)
        self.inflight = 0
        self.healthy = True  # optimistic until the first probe says otherwise
        self.probe_fails = 0
        self.probe_passes = 0
        self.last_probe_error: str | None = None
        self.models: list[str] | None = None  # ids from /v1/models; None = not known yet
        self.breaker = CircuitBreaker(breaker, cfg.name)

    def set_config(self, cfg: BackendConfig, breaker: BreakerConfig) -> None:
        """New settings for the same URL (config reload): runtime state is kept."""
        self.cfg = cfg
        self.name = cfg.name
        self.name_bytes = cfg.name.encode("utf-8")
        if hasattr(self, "breaker"):
            self.breaker.cfg = breaker
            self.breaker.name = cfg.name

    def endpoint_url(self, path: str) -> Any:
        """The parsed httpx.URL of url + path, cached (parsing costs more than the rest of a routing decision)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self.url + path)
        return url

    def available(self, now: float | None = None) -> bool:
        return self.healthy and self.breaker.can_try(now)

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "healthy": self.healthy,
            "circuit": self.breaker.state(),
            "inflight": self.inflight,
            "models": self.models,
            "last_probe_error": self.last_probe_error,
        }


def auth_headers(backend: Backend, default_key: str | None) -> dict[str, str]:
    key = backend.cfg.api_key or default_key
    return {"authorization": f"Bearer {key}"} if key else {}


class HealthChecker:
    """Probes every backend of `state` concurrently every `interval` seconds."""

    def __init__(self, state: Any, client: Any):
        self.state = state  # RouterState: .backends (list), .config
        self.client = client  # httpx.AsyncClient used for probes only

    async def probe(self, backend: Backend, cfg: HealthConfig, key: str | None) -> bool:
        try:
            response = await self.client.get(
                backend.url + cfg.path, timeout=cfg.timeout, headers=auth_headers(backend, key)
            )
            ok = response.status_code == 200
            error = None if ok else f"HTTP {response.status_code}"
        except Exception as exc:  # noqa: BLE001 - any failure to answer is a failed probe
            ok, error = False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.record(backend, ok, error, cfg)
        if ok and backend.models is None:
            await self.refresh_models(backend, key, cfg.timeout)
        return ok

    def record(self, backend: Backend, ok: bool, error: str | None, cfg: HealthConfig) -> None:
        backend.last_probe_error = error
        if ok:
            backend.probe_passes += 1
            backend.probe_fails = 0
            if not backend.healthy and backend.probe_passes >= cfg.pass_threshold:
                backend.healthy = True
                backend.breaker.reset()
                backend.models = None  # re-learn what it serves after a restart
                logger.warning(
                    "backend %s readmitted after %d passed health probes", backend.name, backend.probe_passes
                )
        else:
            backend.probe_fails += 1
            backend.probe_passes = 0
            if backend.healthy and backend.probe_fails >= cfg.fail_threshold:
                backend.healthy = False
                logger.warning(
                    "backend %s ejected after %d failed health probes (%s)", backend.name, backend.probe_fails, error
                )

    async def refresh_models(self, backend: Backend, key: str | None, timeout: float) -> list[str] | None:
        try:
            response = await self.client.get(
                backend.url + "/v1/models", timeout=timeout, headers=auth_headers(backend, key)
            )
            if response.status_code == 200:
                backend.models = [str(m["id"]) for m in response.json().get("data", []) if "id" in m]
        except Exception as exc:  # noqa: BLE001 - model ids are an optimisation; routing works without them
            logger.debug("backend %s: /v1/models failed: %s", backend.name, exc)
        return backend.models

    async def probe_all(self) -> None:
        cfg = self.state.config
        await asyncio.gather(*(self.probe(b, cfg.health, cfg.backend_api_key) for b in list(self.state.backends)))

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.probe_all()
            except Exception:
                logger.exception("health probes")
            interval = self.state.config.health.interval
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
