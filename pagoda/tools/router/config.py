"""Router settings: frozen dataclasses, built from a TOML/YAML/JSON file and/or command-line flags.

The file is optional. When given, it is polled (content hash, every `--reload-interval` s) and a valid
new version replaces the running settings without a restart; an invalid one is logged and ignored.
Command-line flags override the file's values; `--backend` and `--api-key` add to the file's lists.
`host`, `port` and `workers` are read once at startup (a change needs a restart). With `workers` > 1 every
worker process polls the file and applies a change on its own.

File layout (TOML shown; the same keys work in YAML or JSON)::

    policy = "session"            # session | least-loaded | round-robin | prefix
    backend_api_key = "sk-backend"
    [[backends]]
    url = "http://10.0.0.1:8000"
    name = "gpu-a"                # optional: the X-Pagoda-Backend value (default: the URL)
    weight = 1                    # optional: share of the hash ring
    [api_keys]                    # optional: label = key (labels name usage in /usage and /metrics)
    alice = "sk-alice"
    [health]
    interval = 2.0
    [breaker]
    failures = 3
    [limits]
    max_request_bytes = 33554432
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from pagoda.config.server import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADER_COUNT,
)
from pagoda.errors import ConfigError

logger = logging.getLogger("pagoda.tools.router")

POLICIES = ("session", "least-loaded", "round-robin", "prefix")


@dataclass(frozen=True)
class BackendConfig:
    url: str  # scheme://host:port, no trailing slash or /v1
    name: str  # label in X-Pagoda-Backend, metrics, /health
    api_key: str | None = None  # sent to this backend (overrides RouterConfig.backend_api_key)
    weight: int = 1  # points on the hash ring relative to the others


@dataclass(frozen=True)
class HealthConfig:
    interval: float = 2.0  # seconds between active probes of each backend
    timeout: float = 2.0  # probe timeout
    fail_threshold: int = 2  # consecutive failed probes that eject a backend
    pass_threshold: int = 2  # consecutive passed probes that readmit it
    path: str = "/health"


@dataclass(frozen=True)
class BreakerConfig:
    failures: int = 3  # consecutive request failures (connect error, timeout, 502/503/504, broken body) that open it
    open_seconds: float = 10.0  # how long it stays open before one trial request (half-open)


@dataclass(frozen=True)
class RouterConfig:
    backends: tuple[BackendConfig, ...]
    policy: str = "session"
    session_header: str = "x-session-id"  # lower case
    load_factor: float = 1.25  # bounded load: owner may hold <= ceil(f * mean); 0 = off
    load_floor: int = 4  # ... and never spills below this many requests in flight
    vnodes: int = 160  # ring points per backend (times weight)
    prefix_chars: int = 1024  # "prefix" policy: characters of the rendered opening hashed
    api_keys: tuple[tuple[str, str], ...] = ()  # (label, key); empty = no authentication
    backend_api_key: str | None = None
    max_attempts: int = 3  # backends tried per request before the first byte
    connect_timeout: float = 5.0
    # Until the backend's first body byte (its whole answer, for a request that does not stream); None = none.
    first_byte_timeout: float | None = 300.0
    read_timeout: float | None = 60.0  # between upstream reads once the body has started; None = none
    max_request_bytes: int = 32 * 1024 * 1024
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # the client's request line + headers (431 beyond)
    max_header_count: int = DEFAULT_MAX_HEADER_COUNT  # header fields of a client's request (431 beyond)
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S  # a request's headers, from its first byte (408 beyond)
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S  # a request's body, from its headers (408 beyond)
    long_request_chars: int = 0  # requests with more message text go through the long queue; 0 = off
    long_request_concurrency: int = 4
    inject_usage: bool = True  # ask streams for usage (and hide it if the client did not)
    max_connections: int = 2048  # upstream connection pool (all backends)
    host: str = "0.0.0.0"
    port: int = 8080
    workers: int = 1  # router processes sharing the listening socket (read at startup)
    health: HealthConfig = field(default_factory=HealthConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)

    def key_labels(self) -> dict[str, str]:
        """sha256(key) -> label, for the constant-cost lookup of a bearer token."""
        return {hashlib.sha256(k.encode()).hexdigest(): label for label, k in self.api_keys}


def key_label(key: str) -> str:
    """The usage label of a key that has no configured name: never the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:10]


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    url = url.removesuffix("/v1").rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"backend URL {url!r} must start with http:// or https://")
    if url.count("/") > 2:
        raise ConfigError(f"backend URL {url!r} must be a server root such as http://host:8000")
    return url


# File keys -> flat names. Sections flatten to "section.key" except [limits], whose keys are top-level.
_LIMITS = {
    "max_request_bytes",
    "max_header_bytes",
    "max_header_count",
    "header_timeout",
    "body_timeout",
    "long_request_chars",
    "long_request_concurrency",
}
_TOP = {
    "host",
    "port",
    "workers",
    "policy",
    "session_header",
    "load_factor",
    "load_floor",
    "vnodes",
    "prefix_chars",
    "backend_api_key",
    "max_attempts",
    "connect_timeout",
    "first_byte_timeout",
    "read_timeout",
    "inject_usage",
    "max_connections",
    "backends",
    "api_keys",
} | _LIMITS
_SECTIONS = {
    "health": {f.name for f in dataclasses.fields(HealthConfig)},
    "breaker": {f.name for f in dataclasses.fields(BreakerConfig)},
    "limits": _LIMITS,
}


def parse_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML (.toml), YAML (.yaml/.yml, needs PyYAML) or JSON file into flat settings."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"router config {p}: {exc.strerror or exc}") from None
    return parse_text(text, p.suffix.lower(), str(p))


def parse_text(text: bytes, suffix: str, where: str = "router config") -> dict[str, Any]:
    try:
        if suffix == ".toml":
            data = tomllib.loads(text.decode())
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml  # lazy: optional (PyYAML)
            except ImportError:
                raise ConfigError(f"{where}: YAML needs PyYAML; use a .toml or .json file") from None
            data = yaml.safe_load(text) or {}
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"{where}: unknown format {suffix!r}; use .toml, .yaml/.yml or .json")
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any parser's error becomes one line
        raise ConfigError(f"{where}: cannot parse: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a table/mapping")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in _SECTIONS and isinstance(value, dict):
            for sub, v in value.items():
                if sub not in _SECTIONS[key]:
                    raise ConfigError(f"{where}: unknown key [{key}] {sub!r}")
                flat[sub if key == "limits" else f"{key}.{sub}"] = v
        elif key in _TOP:
            flat[key] = value
        else:
            raise ConfigError(f"{where}: unknown key {key!r}")
    return flat


def _backends(items: Any) -> list[BackendConfig]:
    if not isinstance(items, (list, tuple)):
        raise ConfigError("backends must be a list of URLs or of {url, name, api_key, weight} tables")
    out: list[BackendConfig] = []
    for item in items:
        if isinstance(item, BackendConfig):
            out.append(item)
            continue
        if isinstance(item, str):
            item = {"url": item}
        if not isinstance(item, dict) or "url" not in item:
            raise ConfigError(f"backend entry {item!r} needs a url")
        unknown = set(item) - {"url", "name", "api_key", "weight"}
        if unknown:
            raise ConfigError(f"backend {item['url']!r}: unknown keys {sorted(unknown)}")
        url = normalize_url(str(item["url"]))
        weight = item.get("weight", 1)
        if not isinstance(weight, int) or weight < 1:
            raise ConfigError(f"backend {url}: weight must be an integer >= 1")
        out.append(
            BackendConfig(url=url, name=str(item.get("name") or url), api_key=item.get("api_key"), weight=weight)
        )
    return out


def _api_keys(items: Any) -> list[tuple[str, str]]:
    if items is None:
        return []
    if isinstance(items, dict):
        pairs = [(str(k), str(v)) for k, v in items.items()]
    elif isinstance(items, (list, tuple)):
        pairs = [tuple(x) if isinstance(x, (list, tuple)) else (key_label(str(x)), str(x)) for x in items]
    else:
        raise ConfigError("api_keys must be a list of keys or a table of label = key")
    for label, key in pairs:
        if not key:
            raise ConfigError(f"api key {label!r} is empty")
    return pairs  # type: ignore[return-value]


def build_config(file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None) -> RouterConfig:
    """Merge file values and command-line overrides (None = not given) into a validated RouterConfig."""
    values = dict(file_values or {})
    extra = {k: v for k, v in (overrides or {}).items() if v is not None}
    backends = _backends(values.pop("backends", []) or []) + _backends(extra.pop("backends", []) or [])
    api_keys = _api_keys(values.pop("api_keys", None)) + _api_keys(extra.pop("api_keys", None))
    values.update(extra)

    seen: dict[str, BackendConfig] = {}
    for b in backends:
        if b.url in seen:
            continue  # the same URL twice (file and flag): keep the first
        seen[b.url] = b
    backends = list(seen.values())
    if not backends:
        raise ConfigError("no backends: give --backend URL (repeatable) or backends in --config")
    names = [b.name for b in backends]
    if len(set(names)) != len(names):
        raise ConfigError(f"backend names must be unique, got {names}")

    health = {k.split(".", 1)[1]: values.pop(k) for k in list(values) if k.startswith("health.")}
    breaker = {k.split(".", 1)[1]: values.pop(k) for k in list(values) if k.startswith("breaker.")}
    try:
        hc = HealthConfig(**{k: _num(k, v) if k != "path" else str(v) for k, v in health.items()})
        bc = BreakerConfig(**{k: _num(k, v) for k, v in breaker.items()})
        cfg = RouterConfig(
            backends=tuple(backends),
            api_keys=tuple(api_keys),
            health=hc,
            breaker=bc,
            **{k: v for k, v in values.items()},
        )
    except TypeError as exc:
        raise ConfigError(f"router config: {exc}") from None
    cfg = dataclasses.replace(
        cfg,
        session_header=cfg.session_header.lower(),
        read_timeout=cfg.read_timeout or None,
        first_byte_timeout=cfg.first_byte_timeout or None,
    )
    _validate(cfg)
    return cfg


def _num(name: str, value: Any) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    return value


def _validate(cfg: RouterConfig) -> None:
    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    check(cfg.policy in POLICIES, f"policy must be one of {', '.join(POLICIES)}; got {cfg.policy!r}")
    check(cfg.load_factor == 0 or cfg.load_factor >= 1, "load_factor must be >= 1 (or 0 to turn bounded load off)")
    check(cfg.load_floor >= 1, "load_floor must be >= 1")
    check(cfg.vnodes >= 1, "vnodes must be >= 1")
    check(cfg.prefix_chars >= 1, "prefix_chars must be >= 1")
    check(cfg.max_attempts >= 1, "max_attempts must be >= 1")
    check(cfg.connect_timeout > 0, "connect_timeout must be > 0")
    check(cfg.read_timeout is None or cfg.read_timeout > 0, "read_timeout must be > 0 (or 0 for none)")
    check(
        cfg.first_byte_timeout is None or cfg.first_byte_timeout > 0, "first_byte_timeout must be > 0 (or 0 for none)"
    )
    check(cfg.max_request_bytes >= 1024, "max_request_bytes must be >= 1024")
    check(cfg.max_header_bytes >= 1024, "max_header_bytes must be >= 1024")
    check(cfg.max_header_count >= 16, "max_header_count must be >= 16")
    check(cfg.header_timeout > 0 and cfg.body_timeout > 0, "header_timeout and body_timeout must be > 0")
    check(cfg.long_request_chars >= 0, "long_request_chars must be >= 0 (0 = off)")
    check(cfg.long_request_concurrency >= 1, "long_request_concurrency must be >= 1")
    check(cfg.max_connections >= 1, "max_connections must be >= 1")
    check(0 <= cfg.port <= 65535, "port must be in 0..65535")
    check(
        isinstance(cfg.workers, int) and not isinstance(cfg.workers, bool) and 1 <= cfg.workers <= 256,
        "workers must be an integer in 1..256",
    )
    check(bool(cfg.session_header), "session_header must not be empty")
    h, b = cfg.health, cfg.breaker
    check(h.interval > 0 and h.timeout > 0, "health interval and timeout must be > 0")
    check(h.fail_threshold >= 1 and h.pass_threshold >= 1, "health thresholds must be >= 1")
    check(h.path.startswith("/"), "health path must start with /")
    check(b.failures >= 1 and b.open_seconds > 0, "breaker failures must be >= 1 and open_seconds > 0")


class ConfigWatcher:
    """Polls a config file; on a content change builds a new RouterConfig and hands it to `on_change`.

    `check()` does one poll (the unit tests call it directly); `run()` polls forever.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        overrides: dict[str, Any],
        on_change: Callable[[RouterConfig], None],
        interval: float = 1.0,
    ):
        self.path = Path(path)
        self.overrides = overrides
        self.on_change = on_change
        self.interval = interval
        self.reloads = 0
        self.errors = 0
        self._digest = self._read_digest()

    def _read_digest(self) -> str | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).hexdigest()
        except OSError:
            return None

    def check(self) -> bool:
        digest = self._read_digest()
        if digest is None or digest == self._digest:
            return False
        self._digest = digest
        try:
            cfg = build_config(parse_file(self.path), self.overrides)
        except ConfigError as exc:
            self.errors += 1
            logger.error("router config %s not reloaded, keeping the running settings: %s", self.path, exc.message)
            return False
        self.on_change(cfg)
        self.reloads += 1
        logger.info("router config %s reloaded: %d backends, policy %s", self.path, len(cfg.backends), cfg.policy)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.check()
            except Exception:
                logger.exception("router config watcher")


def overrides_from(ns: argparse.Namespace) -> dict[str, Any]:
    """Flag values as config keys (None = not given, the file or the default applies)."""
    return {
        "host": ns.host,
        "port": ns.port,
        "workers": ns.workers,
        "backends": ns.backend,
        "policy": ns.policy,
        "session_header": ns.session_header,
        "load_factor": ns.load_factor,
        "load_floor": ns.load_floor,
        "vnodes": ns.vnodes,
        "prefix_chars": ns.prefix_chars,
        "max_attempts": ns.max_attempts,
        "api_keys": ns.api_key,
        "backend_api_key": ns.backend_api_key,
        "max_request_bytes": ns.max_request_bytes,
        "long_request_chars": ns.long_request_chars,
        "long_request_concurrency": ns.long_request_concurrency,
        "inject_usage": ns.inject_usage,
        "connect_timeout": ns.connect_timeout,
        "first_byte_timeout": ns.first_byte_timeout,
        "read_timeout": ns.read_timeout,
        "max_header_bytes": ns.max_header_bytes,
        "max_header_count": ns.max_header_count,
        "header_timeout": ns.header_timeout,
        "body_timeout": ns.body_timeout,
        "max_connections": ns.max_connections,
        "health.interval": ns.health_interval,
        "health.timeout": ns.health_timeout,
        "health.fail_threshold": ns.health_fail_threshold,
        "health.pass_threshold": ns.health_pass_threshold,
        "breaker.failures": ns.breaker_failures,
        "breaker.open_seconds": ns.breaker_open_seconds,
    }
