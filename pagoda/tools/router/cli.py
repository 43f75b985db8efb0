"""`pagoda router`: flags and the runner. Only argparse is imported at module level (`pagoda --help` stays
cheap); the router itself imports no torch and no engine code, so it starts in a fraction of a second.

    pagoda router --port 8080 --backend http://10.0.0.1:8000 --backend http://10.0.0.2:8000 [--policy session]
    pagoda router --config router.toml            # reloaded when the file changes
    pagoda router --workers 4 ...                 # four processes on one socket (router.workers)
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib.util import find_spec

from pagoda.errors import ConfigError
from pagoda.tools.router.config import build_config, overrides_from, parse_file


def add_router_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("listen and backends")
    g.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="TOML, YAML or JSON settings (backends, keys, policy...); reloaded when it changes. "
        "Flags override its values; --backend/--api-key add to its lists",
    )
    g.add_argument("--host", default=None, help="listen address (default 0.0.0.0)")
    g.add_argument("--port", type=int, default=None, help="listen port (default 8080)")
    g.add_argument(
        "--backend",
        action="append",
        default=None,
        metavar="URL",
        help="a backend server root, e.g. http://127.0.0.1:8000 (repeat for each backend)",
    )
    g.add_argument("--reload-interval", type=float, default=1.0, help="seconds between config file checks")
    g.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="router processes serving the one listening socket (default 1). Each has its own event "
        "loop, health probes, breakers and in-flight counts; /metrics and /usage add up all of them",
    )

    g = p.add_argument_group("routing")
    g.add_argument(
        "--policy",
        choices=("session", "least-loaded", "round-robin", "prefix"),
        default=None,
        help="session (default): consistent hash of X-Session-ID > user > conversation fingerprint; "
        "least-loaded; round-robin; prefix: hash of the first --prefix-chars of the opening",
    )
    g.add_argument("--session-header", default=None, help="header that carries the session id (default X-Session-ID)")
    g.add_argument(
        "--load-factor",
        type=float,
        default=None,
        help="bounded load: a backend above ceil(F x mean in-flight) passes new requests to the "
        "least-loaded one (default 1.25; 0 = off)",
    )
    g.add_argument(
        "--load-floor",
        type=int,
        default=None,
        help="bounded load never moves a request off a backend with fewer in flight than this (default 4)",
    )
    g.add_argument("--vnodes", type=int, default=None, help="hash-ring points per backend (default 160)")
    g.add_argument("--prefix-chars", type=int, default=None, help="prefix policy: characters hashed (default 1024)")
    g.add_argument(
        "--max-attempts", type=int, default=None, help="backends tried per request before its first byte (default 3)"
    )

    g = p.add_argument_group("health")
    g.add_argument("--health-interval", type=float, default=None, help="seconds between /health probes (default 2)")
    g.add_argument("--health-timeout", type=float, default=None, help="probe timeout in s (default 2)")
    g.add_argument("--health-fail-threshold", type=int, default=None, help="failed probes that eject (default 2)")
    g.add_argument("--health-pass-threshold", type=int, default=None, help="passed probes that readmit (default 2)")
    g.add_argument(
        "--breaker-failures",
        type=int,
        default=None,
        help="consecutive request failures that open a backend's circuit breaker (default 3)",
    )
    g.add_argument(
        "--breaker-open-seconds",
        type=float,
        default=None,
        help="seconds an open breaker waits before a trial request (default 10)",
    )

    g = p.add_argument_group("keys, limits, upstream")
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="accept this bearer key (repeatable); without any, every request is accepted",
    )
    g.add_argument("--backend-api-key", default=None, help="bearer key sent to the backends")
    g.add_argument("--max-request-bytes", type=int, default=None, help="413 beyond this body size (default 32 MiB)")
    g.add_argument(
        "--max-header-bytes",
        type=int,
        default=None,
        help="431 beyond this size of a request's line and headers (default 64 KiB, as pagoda serve)",
    )
    g.add_argument(
        "--max-header-count", type=int, default=None, help="431 beyond this many request header fields (default 256)"
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=None,
        help="s a client has to send a request's headers after its first byte (default 60; 408 beyond)",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=None,
        help="s a client has to send a request's body after its headers (default 300; 408 beyond)",
    )
    g.add_argument(
        "--long-request-chars",
        type=int,
        default=None,
        help="requests with more message text than this go through the long-request queue (default off)",
    )
    g.add_argument(
        "--long-request-concurrency",
        type=int,
        default=None,
        help="long requests in flight at once (default 4); short requests never wait for them",
    )
    g.add_argument(
        "--no-inject-usage",
        dest="inject_usage",
        action="store_false",
        default=None,
        help="do not ask streams for usage (stream usage is then counted only when clients ask)",
    )
    g.add_argument("--connect-timeout", type=float, default=None, help="upstream connect timeout in s (default 5)")
    g.add_argument(
        "--first-byte-timeout",
        type=float,
        default=None,
        help="s a backend has for the first byte of its answer body: the first event of a stream, the whole "
        "answer of a request that does not stream (default 300; 0 = none). Beyond it the request goes to the "
        "next backend",
    )
    g.add_argument(
        "--read-timeout",
        type=float,
        default=None,
        help="s a backend may stay silent once its body has started, e.g. between two events of a stream "
        "(default 60; 0 = none). Beyond it a stream ends with an SSE error event",
    )
    g.add_argument("--max-connections", type=int, default=None, help="upstream connection pool size (default 2048)")
    g.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds open streams get to finish after SIGTERM"
    )
    g.add_argument("--uvicorn-log-level", default="warning")


def run_router(ns: argparse.Namespace) -> int:
    from pagoda.tools.router.app import make_server  # lazy: FastAPI, uvicorn (every `pagoda` run imports this)

    logger = logging.getLogger("pagoda.tools.router")
    overrides = overrides_from(ns)
    try:
        config = build_config(parse_file(ns.config) if ns.config else None, overrides)
    except ConfigError as exc:
        print(f"pagoda router: error: {exc.message}", file=sys.stderr)
        return 2
    if config.workers > 1:
        from pagoda.tools.router.workers import run_workers  # lazy: FastAPI, uvicorn, prometheus_client

        return run_workers(ns, config)

    server = make_server(ns, config)
    # uvicorn's "auto" loop and HTTP parser are uvloop and httptools when installed (dependencies): they and the
    # httptools-based upstream client (router.upstream) cut the router's CPU per relayed event by about 4x.
    stack = (
        ("uvloop" if find_spec("uvloop") else "asyncio") + " + " + ("httptools" if find_spec("httptools") else "h11")
    )
    logger.info(
        "pagoda router on http://%s:%d: %d backends (%s), policy %s, %s%s",
        config.host,
        config.port,
        len(config.backends),
        ", ".join(b.name for b in config.backends),
        config.policy,
        stack,
        f", config {ns.config} (reloaded on change)" if ns.config else "",
    )
    server.run()
    return 0 if server.started else 1
