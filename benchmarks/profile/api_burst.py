"""Where a burst's time to first token goes in the API process: N streaming requests sent at the same instant.

    python benchmarks/profile/api_burst.py --burst 64,256 [--rounds 3] [--tokenizer .gpu/smol-tokenizer] [--out FILE]

The same real API process and fake engine core as `api_overhead.py` (core_process's loop and wire, no
model, one token per running request per `--step-ms`), with text prompts tokenized by a real tokenizer
(`--tokenizer`, default the SmolLM2 BPE the H200 runs serve with; `--token-ids` sends ids instead). The
client opens N keep-alive connections, then each round writes N `/v1/completions` streaming requests at
once and waits for all of them to finish (a closed-loop level whose requests all end together, as with
`pagoda bench` at 256 x 256-token outputs). Timestamps are CLOCK_MONOTONIC, shared by the processes:

  client send → ASGI call         accept / HTTP parse / event-loop queueing
  ASGI call → body read           the request body reaches the app
  body read → route               JSON parse + pydantic validation (FastAPI)
  route → AddRequest sent         tokenize, checks, SamplingParams, ZMQ send
  sent → core got it              pipe + the core finishing its current step
  core got it → core sent output  the (fake) step that makes the first token
  core sent → API got it          pipe + the API event loop's backlog
  API got it → first body write   the stream's wake-up, SSE chunk, uvicorn write
  first write → client read       kernel + the client's own loop

Client TTFT = client send → first `data:` read.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from api_overhead import (
    REPO,
    FakeEngine,
    cpu_seconds,
    fake_core,
    free_port,
    serve_fake_api,
    start_py_spy,
    stop,
    wait_healthy,
)

WORDS = [
    "time",
    "person",
    "year",
    "way",
    "day",
    "thing",
    "man",
    "world",
    "life",
    "hand",
    "part",
    "child",
    "eye",
    "woman",
    "place",
    "work",
    "week",
    "case",
    "point",
    "government",
    "company",
    "number",
    "group",
    "problem",
]
SEGMENTS = [
    ("accept", "send", "asgi"),
    ("body", "asgi", "body"),
    ("validate", "body", "route"),
    ("prepare+send", "route", "sent"),
    ("to core", "sent", "core_add"),
    ("core step", "core_add", "core_out"),
    ("to API", "core_out", "api_out"),
    ("SSE write", "api_out", "write"),
    ("to client", "write", "first"),
]


# -- the fake core, recording when each request arrived and when its first output left ------------------------
class TimedEngine(FakeEngine):
    def __init__(self, step_s: float, path: str):
        super().__init__(step_s)
        self.path = path
        self.times: dict[str, list[float]] = {}

    def add_request(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        super().add_request(request_id, *args, **kwargs)
        self.times[request_id] = [time.monotonic(), 0.0]

    def step(self) -> list[Any]:
        outs = super().step()
        now = time.monotonic()
        for out in outs:
            entry = self.times.get(out.request_id)
            if entry is not None and not entry[1]:
                entry[1] = now
        if not self.running:  # idle: hand the times over (all so far)
            Path(self.path).write_text(json.dumps(self.times))
        return outs


def _timed_core(
    step_s: float,
    path: str,
    config: Any,
    input_address: str,
    control_address: str,
    client_addresses: list[str],
    heartbeat: Any = None,
) -> None:
    fake_core(step_s, input_address, control_address, client_addresses, TimedEngine(step_s, path))


# -- the API process's instrumentation ----------------------------------------------------------------------
PROFILER: list[Any] = []


def instrument(app: Any, engine: Any) -> Any:
    """Record per request (keyed by the client's x-bench-id header = its request_id): ASGI call, body read,
    route entry, AddRequest sent, first output received, first body write. GET /bench-times hands them over."""
    import gc

    from pagoda.engine import async_engine
    from pagoda.engine.core_process import AddRequest
    from pagoda.server.serving import OpenAIServing

    times: dict[str, dict[str, float]] = {}
    gc_time = [[0, 0.0] for _ in range(3)]  # per generation: collections, seconds
    gc_start = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_time[info["generation"]][0] += 1
            gc_time[info["generation"]][1] += time.perf_counter() - gc_start[0]

    gc.callbacks.append(on_gc)
    send_pyobj = engine._outbox.send_pyobj

    async def timed_send(message: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(message, AddRequest):
            times.setdefault(message.request_id, {})["sent"] = time.monotonic()
        return await send_pyobj(message, *args, **kwargs)

    engine._outbox.send_pyobj = timed_send
    from_wire = async_engine.from_wire

    def timed_from_wire(wire: Any, *args: Any) -> Any:
        entry = times.setdefault(wire[0], {})
        entry.setdefault("api_out", time.monotonic())
        return from_wire(wire, *args)

    async_engine.from_wire = timed_from_wire
    completion_stream = OpenAIServing.completion_stream

    async def timed_completion_stream(self: Any, req: Any, arrival: float) -> Any:
        times.setdefault(req.request_id, {})["route"] = arrival
        return await completion_stream(self, req, arrival)

    OpenAIServing.completion_stream = timed_completion_stream  # type: ignore[method-assign]

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/bench-times":
            if PROFILER:
                PROFILER[0].dump_stats(os.environ["API_BURST_CPROFILE"])  # (which stops it)
                PROFILER[0].enable()
            body = json.dumps({**times, "_gc": gc_time}).encode()
            times.clear()
            gc_time[:] = [[0, 0.0] for _ in range(3)]
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": body})
            return
        rid = dict(scope.get("headers") or ()).get(b"x-bench-id")
        if scope["type"] != "http" or rid is None:
            await app(scope, receive, send)
            return
        entry = times.setdefault(rid.decode(), {})
        entry["asgi"] = time.monotonic()

        async def timed_receive() -> Any:
            message = await receive()
            entry.setdefault("body", time.monotonic())
            return message

        async def timed_send(message: Any) -> None:
            await send(message)
            if message["type"] == "http.response.body" and message.get("body") and "write" not in entry:
                entry["write"] = time.monotonic()

        await app(scope, timed_receive, timed_send)

    return wrapped


def serve(port: int, step_s: float, loop: str, tokenizer_path: str, core_times: str) -> None:
    tokenizer = None
    if tokenizer_path:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    if os.environ.get("API_BURST_CPROFILE"):  # written on GET /bench-times (uvicorn dies by its signal)
        import cProfile

        PROFILER.append(cProfile.Profile())
        PROFILER[0].enable()
    serve_fake_api(
        port, step_s, loop == "uvloop", tokenizer, functools.partial(_timed_core, step_s, core_times), instrument
    )


# -- the client ---------------------------------------------------------------------------------------------
async def burst_rounds(host: str, port: int, n: int, rounds: int, ns: argparse.Namespace) -> list[dict[str, float]]:
    """`rounds` bursts of `n` requests over `n` kept-alive connections (opened, then used once unrecorded, so
    that accepting them is not part of a burst); per request its send / first-read times."""
    import random

    rng = random.Random(0)
    conns = [await asyncio.open_connection(host, port) for _ in range(n)]
    results: list[dict[str, float]] = []
    try:
        for r in range(rounds + 1):
            requests = []
            for i in range(n):
                rid = f"b{r}-{i}-{rng.getrandbits(32):08x}"
                prompt: Any = (
                    list(range(100, 100 + ns.input_len))
                    if ns.token_ids
                    else " ".join(rng.choice(WORDS) for _ in range(ns.input_len))
                )
                body = json.dumps(
                    {
                        "model": "fake",
                        "stream": True,
                        "max_tokens": ns.output_len,
                        "ignore_eos": True,
                        "prompt": prompt,
                        "request_id": rid,
                        "stream_options": {"include_usage": True},
                    }
                ).encode()
                requests.append(
                    (
                        rid,
                        (
                            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                            f"application/json\r\nx-bench-id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n"
                        ).encode()
                        + body,
                    )
                )

            async def one(k: int, requests: list[tuple[str, bytes]] = requests) -> dict[str, float]:
                reader, writer = conns[k]
                rid, request = requests[k]
                times = {"id": rid, "send": time.monotonic()}  # type: ignore[dict-item]
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(head.decode(errors="replace"))
                tail = b""
                while not tail.endswith(b"0\r\n\r\n"):
                    chunk = await reader.read(65536)
                    if not chunk:
                        raise ConnectionError("closed mid-stream")
                    if "first" not in times and b"data:" in chunk:
                        times["first"] = time.monotonic()
                    tail = (tail + chunk)[-400:]
                return times

            timed = await asyncio.gather(*(one(k) for k in range(n)))
            if r:
                results += timed
            await asyncio.sleep(0.3)
    finally:
        for _, writer in conns:
            writer.close()
    return results


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> int:
    if len(sys.argv) == 7 and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--burst", default="64,256", help="burst sizes, comma-separated (default 64,256)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=40, help="prompt words (or ids with --token-ids)")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=8.0, help="fake decode step time (default 8)")
    p.add_argument("--tokenizer", default=str(REPO / ".gpu" / "smol-tokenizer"))
    p.add_argument("--token-ids", action="store_true", help="send token-id prompts (no tokenizer)")
    p.add_argument("--uvloop", action="store_true")
    p.add_argument("--profile", metavar="SVG", help="also record the API process with py-spy into SVG")
    p.add_argument("--cprofile", metavar="FILE", help="cProfile the API process into FILE (pstats)")
    p.add_argument("--out", help="write the results as JSON here")
    ns = p.parse_args()
    port = free_port()
    core_times = tempfile.mktemp(prefix="pagoda-burst-", suffix=".json")
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "API_BURST_CPROFILE": os.path.abspath(ns.cprofile) if ns.cprofile else "",
    }
    api = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve",
            str(port),
            str(ns.step_ms / 1000),
            "uvloop" if ns.uvloop else "asyncio",
            "" if ns.token_ids else ns.tokenizer,
            core_times,
        ],
        env=env,
    )
    spy = None
    report: dict[str, Any] = {"config": vars(ns), "bursts": {}}
    try:
        wait_healthy(f"http://127.0.0.1:{port}", api)
        asyncio.run(burst_rounds("127.0.0.1", port, 8, 1, ns))  # warm-up
        httpx.get(f"http://127.0.0.1:{port}/bench-times")
        if ns.cprofile:
            Path(ns.cprofile).unlink(missing_ok=True)
        if ns.profile:
            spy = start_py_spy(ns.profile, api.pid)
        for n in [int(x) for x in ns.burst.split(",")]:
            httpx.get(f"http://127.0.0.1:{port}/bench-times")
            c0 = sum(cpu_seconds(api.pid))
            client = asyncio.run(burst_rounds("127.0.0.1", port, n, ns.rounds, ns))
            cpu = sum(cpu_seconds(api.pid)) - c0
            server = httpx.get(f"http://127.0.0.1:{port}/bench-times").json()
            gc_seconds = server.pop("_gc")
            core = json.loads(Path(core_times).read_text())
            rows = []
            for c in client:
                t = {**server.get(c["id"], {}), **c}
                if c["id"] in core:
                    t["core_add"], t["core_out"] = core[c["id"]]
                rows.append(t)
            ttft = [(r["first"] - r["send"]) * 1e3 for r in rows]
            summary = {
                "requests": len(rows),
                "ttft_p50_ms": pct(ttft, 0.5),
                "ttft_p95_ms": pct(ttft, 0.95),
                "ttft_mean_ms": statistics.fmean(ttft),
                "api_cpu_ms_per_request": cpu / (n * (ns.rounds + 1)) * 1e3,
                "segments_ms": {},
                "gc_ms_per_round": {
                    f"gen{g}": [count / (ns.rounds + 1), seconds / (ns.rounds + 1) * 1e3]
                    for g, (count, seconds) in enumerate(gc_seconds)
                },
            }
            print(
                f"burst {n}: {len(rows)} requests, client TTFT P50 {summary['ttft_p50_ms']:.1f} ms, "
                f"P95 {summary['ttft_p95_ms']:.1f} ms, mean {summary['ttft_mean_ms']:.1f} ms; API CPU "
                f"{summary['api_cpu_ms_per_request']:.2f} ms per request",
                file=sys.stderr,
            )
            for name, a, b in SEGMENTS:
                values = [(r[b] - r[a]) * 1e3 for r in rows if a in r and b in r]
                if values:
                    seg = {"mean": statistics.fmean(values), "p50": pct(values, 0.5), "p95": pct(values, 0.95)}
                    summary["segments_ms"][name] = seg
                    print(
                        f"  {name:14s} mean {seg['mean']:7.1f}  p50 {seg['p50']:7.1f}  p95 {seg['p95']:7.1f} ms",
                        file=sys.stderr,
                    )
            print(
                "  GC per round (collections / ms): "
                + ", ".join(f"{k} {c:.0f} / {ms:.1f}" for k, (c, ms) in summary["gc_ms_per_round"].items()),
                file=sys.stderr,
            )
            report["bursts"][str(n)] = summary
        print(json.dumps({n: {k: v for k, v in s.items() if k != "segments_ms"} for n, s in report["bursts"].items()}))
        if ns.out:
            Path(ns.out).write_text(json.dumps(report, indent=2))
    finally:
        stop(api, spy)
        Path(core_times).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
