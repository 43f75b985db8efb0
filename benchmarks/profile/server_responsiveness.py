"""Server responsiveness under streaming load: is the HTTP side still snappy while the engine is busy?

Usage:
    python benchmarks/profile/server_responsiveness.py [--url http://127.0.0.1:8000] [--api-key KEY]
        [--model smol] [--concurrency 32] [--max-tokens 64] [--health-interval 0.05]
        [--json out.json] [--server-arg=--max-model-len --server-arg=2048 ...]

Method:
  * Without --url, starts `python -m pagoda serve` (default model, served as --model, on a free
    127.0.0.1 port, plus any --server-arg), waits for /health, and stops it with SIGTERM at the end.
  * One warm-up request, then --concurrency streaming /v1/completions clients start together, each
    with its own short prompt, asking for exactly --max-tokens tokens (ignore_eos via the request
    body, temperature 0, stream_options.include_usage).
  * Meanwhile a separate connection GETs /health every --health-interval seconds until the last
    stream ends; each probe's latency is recorded.
  * TTFT: request start → first non-empty content chunk. Inter-token latency: gap between
    successive content chunks of one stream (one token per chunk here). Output tok/s: completion
    tokens (from the usage chunks) / wall time from the first request to the last [DONE].
  * All clients run in this process with httpx's asyncio client; on a small CPU the client shares
    cores with the server, so the numbers include that contention (the 1-minute load average is
    printed before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default="smol", help="model name to request (and --served-model-name when starting)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--health-interval", type=float, default=0.05)
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra flag for the started server (repeat; use --server-arg=--flag)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


@dataclass
class StreamResult:
    start: float
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    end: float = 0.0
    error: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="pagoda-serve-", suffix=".log", delete=False)
    cmd = [
        sys.executable,
        "-m",
        "pagoda",
        "serve",
        "--served-model-name",
        args.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args.server_arg,
    ]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    print(f"starting: {' '.join(cmd)}  (log: {log.name})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    while time.monotonic() - started < args.startup_timeout:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                print(f"server ready in {time.monotonic() - started:.1f} s", flush=True)
                return proc, url, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop_server(proc)
    sys.exit(f"server not healthy after {args.startup_timeout:.0f} s; see {log.name}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything left of its session
    except (ProcessLookupError, PermissionError):
        pass


async def one_stream(client: httpx.AsyncClient, args: argparse.Namespace, i: int) -> StreamResult:
    body = {
        "model": args.model,
        "prompt": f"Story {i}: once upon a time, in a faraway land,",
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = StreamResult(start=time.perf_counter())
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    result.error = event["error"]["message"]
                elif event.get("usage"):
                    result.completion_tokens = event["usage"]["completion_tokens"]
                elif event["choices"] and event["choices"][0]["text"]:
                    result.chunk_times.append(time.perf_counter())
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter()
    return result


async def probe_health(url: str, interval: float, done: asyncio.Event) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as probe:
        while not done.is_set():
            start = time.perf_counter()
            response = await probe.get("/health")
            latencies.append(time.perf_counter() - start)
            if response.status_code != 200:
                print(f"/health answered {response.status_code}", file=sys.stderr)
            await asyncio.sleep(interval)
    return latencies


async def run(url: str, args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        warm = await client.post("/v1/completions", json={"model": args.model, "prompt": "Hello", "max_tokens": 4})
        warm.raise_for_status()
        done = asyncio.Event()
        prober = asyncio.create_task(probe_health(url, args.health_interval, done))
        start = time.perf_counter()
        results = await asyncio.gather(*[one_stream(client, args, i) for i in range(args.concurrency)])
        wall = time.perf_counter() - start
        done.set()
        health = await prober

    ok = [r for r in results if r.error is None]
    ttft = [r.chunk_times[0] - r.start for r in ok if r.chunk_times]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "wall_s": wall,
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "output_tokens": tokens,
        "output_tok_per_s": tokens / wall if wall > 0 else 0.0,
        "health": summarize(health),
        "ttft": summarize(ttft),
        "itl": summarize(itl),
    }


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(values: list[float]) -> dict:
    return {
        "n": len(values),
        "p50": quantile(values, 0.5),
        "p99": quantile(values, 0.99),
        "max": max(values) if values else float("nan"),
    }


def print_table(r: dict) -> None:
    ms = lambda v: f"{v * 1000:10.1f}"  # noqa: E731
    print()
    print(
        f"{r['concurrency']} streaming clients x {r['max_tokens']} tokens: {r['requests_ok']} ok, "
        f"{r['requests_failed']} failed, wall {r['wall_s']:.1f} s"
    )
    print(f"{'metric':<28}{'p50 (ms)':>10}{'p99 (ms)':>11}{'max (ms)':>11}{'samples':>9}")
    print("-" * 69)
    for label, key in [("/health latency", "health"), ("time to first token", "ttft"), ("inter-token latency", "itl")]:
        s = r[key]
        print(f"{label:<28}{ms(s['p50'])}{ms(s['p99'])} {ms(s['max'])}{s['n']:>9}")
    print("-" * 69)
    print(f"{'total output throughput':<28}{r['output_tok_per_s']:10.1f} tok/s  ({r['output_tokens']} tokens)")
    if r["errors"]:
        print("errors:", *r["errors"], sep="\n  ")


def main() -> None:
    args = parse_args()
    proc = None
    if args.url is None:
        proc, url, _ = start_server(args)
    else:
        url = args.url.rstrip("/")
    try:
        print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
        result = asyncio.run(run(url, args))
        result["load_average_after"] = os.getloadavg()[0]
        print_table(result)
        print(f"load average after: {result['load_average_after']:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    finally:
        if proc is not None:
            stop_server(proc)


if __name__ == "__main__":
    main()
