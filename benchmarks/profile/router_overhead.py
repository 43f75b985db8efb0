"""What `pagoda router` costs: `pagoda bench` around the router (straight to the backends) and through it.

    python benchmarks/profile/router_overhead.py --backend http://10.0.0.1:8000 --backend http://10.0.0.2:8000 \
        --api-key KEY --concurrency 256 --num-prompts 1024 --input-len 512 --output-len 256 [--rounds 2]
    python benchmarks/profile/router_overhead.py --fake-backends 3 --concurrency 256   # the router alone, no model

"Around": one `pagoda bench` per backend, all at once, each with its share of the concurrency and prompts.
"Through": one `pagoda bench` at the full concurrency against a router started here over the same backends
(policy least-loaded by default, so the split matches; `--policy session` to measure the default policy).
Runs alternate (around/through, then through/around...) and every run uses its own seed, so no run is
helped by the previous one's prefix cache. From the per-request records (`--save-detailed`) it reports,
pooled over the runs of each side: P50 TTFT, output tokens/s (all tokens / wall time of the run) and the
median per-stream decode rate ((completion tokens - 1) / (E2E - TTFT)). Targets: +<= 1 ms P50 TTFT,
>= 95 % tokens/s.

Closed loop (the default) starts streams in waves of `--concurrency` when every stream has the same
length: the router then sets up hundreds of requests at the same instant. `--request-rate R` runs open
loop instead (Poisson arrivals, R requests/s in all, split between the backends around the router), the
way independent users arrive; R x stream duration is the number of streams open at once.

`--cpu-per-event` measures instead the router's own CPU per relayed stream event: a light in-process client
opens `--concurrency` streams (`--num-prompts` in all) through the router, and the router's CPU seconds
(utime + stime of its process tree, from /proc) are divided by the SSE events the clients received. At a
moderate concurrency the router is not saturated even on a small machine, so this is what one event costs,
and 1e6 / (us per event) is the event rate one core sustains.

`--router-workers N` starts the router with `--workers N` (N processes on one socket). `--router-cpu C` pins
the router to cores C .. C+N-1, one per worker (the workers float over those cores; the parent only
supervises); leave it out to let the kernel place them.

`--fake-backends N` starts N tiny OpenAI-compatible servers here that stream `--output-len` chunks
`--fake-tpot-ms` apart after `--fake-ttft-ms`: no model, so what remains is the router's own overhead
(and the client's), measurable even on a small CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ok(url: str, timeout: float = 60.0, check: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200 and (check is None or check(r)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


# -- a fake backend: `python router_overhead.py --serve-fake PORT TTFT_MS TPOT_MS` ---------------------------
def serve_fake(port: int, ttft_ms: float, tpot_ms: float) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def health(_: Any) -> Response:
        return Response(status_code=200)

    async def models(_: Any) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "bench"}]})

    async def chat(request: Any) -> Any:
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
        created, rid = int(time.time()), f"chatcmpl-{os.urandom(8).hex()}"

        def frame(choices: list, usage: Any = None) -> str:
            return (
                "data: "
                + json.dumps(
                    {
                        "id": rid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": "fake",
                        "choices": choices,
                        "usage": usage,
                    },
                    separators=(",", ":"),
                )
                + "\n\n"
            )

        async def events() -> Any:
            await asyncio.sleep(ttft_ms / 1000)
            yield frame([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            for i in range(n):
                if i:
                    await asyncio.sleep(tpot_ms / 1000)
                yield frame([{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}])
            yield frame([{"index": 0, "delta": {}, "finish_reason": "length"}])
            if (body.get("stream_options") or {}).get("include_usage"):
                yield frame(
                    [], {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, backlog=4096)


# -- router CPU per relayed event ------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> tuple[float, float]:
    """(utime, stime) of a process and its live children, in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            pids += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    except OSError:
        pass
    user = system = 0.0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user += int(fields[11]) / tick
        system += int(fields[12]) / tick
    return user, system


async def drive_streams(url: str, concurrency: int, prompts: int, ns: argparse.Namespace) -> tuple[int, int]:
    """Stream `prompts` chat completions through `url`, `concurrency` at once; (events received, failures)."""
    body = json.dumps(
        {
            "model": "fake",
            "stream": True,
            "max_tokens": ns.output_len,
            "messages": [{"role": "user", "content": "word " * ns.input_len}],
        }
    ).encode()
    headers = {"content-type": "application/json"}
    if ns.api_key:
        headers["authorization"] = f"Bearer {ns.api_key}"
    events = failures = 0
    todo = iter(range(prompts))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60.0), limits=limits, trust_env=False) as client:

        async def worker() -> None:
            nonlocal events, failures
            for _ in todo:
                try:
                    async with client.stream("POST", "/v1/chat/completions", content=body, headers=headers) as r:
                        n = 0
                        async for chunk in r.aiter_raw():
                            n += chunk.count(b"data:")
                        if r.status_code != 200:
                            failures += 1
                        events += n
                except httpx.HTTPError:
                    failures += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return events, failures


def cpu_per_event(router: str, pid: int, ns: argparse.Namespace) -> dict[str, Any]:
    asyncio.run(drive_streams(router, min(ns.concurrency, 8), min(ns.num_prompts, 16), ns))  # warm-up
    rows = []
    for _ in range(ns.rounds):
        c0, t0 = cpu_seconds(pid), time.monotonic()
        events, failures = asyncio.run(drive_streams(router, ns.concurrency, ns.num_prompts, ns))
        c1, wall = cpu_seconds(pid), time.monotonic() - t0
        user, system = c1[0] - c0[0], c1[1] - c0[1]
        cpu = user + system
        rows.append(
            {
                "events": events,
                "failures": failures,
                "router_cpu_s": cpu,
                "router_user_s": user,
                "router_system_s": system,
                "wall_s": wall,
                "us_per_event": cpu / max(events, 1) * 1e6,
                "events_per_s": events / wall,
                "router_cores_busy": cpu / wall,
            }
        )
        print(
            f"{events} events in {wall:.2f} s ({events / wall:.0f}/s), {failures} failed; router CPU {cpu:.2f} s "
            f"({cpu / wall:.2f} cores, {system / max(cpu, 1e-9):.0%} kernel): "
            f"{rows[-1]['us_per_event']:.1f} us/event -> one core relays "
            f"{1e6 / max(rows[-1]['us_per_event'], 1e-9):.0f} events/s",
            file=sys.stderr,
        )
    best = min(r["us_per_event"] for r in rows)
    return {
        "runs": rows,
        "us_per_event_min": best,
        "us_per_event_median": statistics.median(r["us_per_event"] for r in rows),
        "events_per_core_s": 1e6 / best,
    }


# -- driver ---------------------------------------------------------------------------------------------------
def bench_cmd(
    url: str,
    concurrency: int,
    prompts: int,
    seed: int,
    out: Path,
    ns: argparse.Namespace,
    processes: int = 1,
    rate: float | None = None,
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "pagoda",
        "bench",
        "--base-url",
        url,
        "--concurrency",
        str(concurrency),
        "--num-prompts",
        str(prompts),
        "--warmup",
        str(min(concurrency, ns.warmup)),
        "--input-len",
        str(ns.input_len),
        "--output-len",
        str(ns.output_len),
        "--ignore-eos",
        "--no-calibrate",
        "--seed",
        str(seed),
        "--save-detailed",
        "--no-progress",
        "--out",
        str(out),
        "--slo-ttft-p95-ms",
        "off",
        "--slo-tpot-p95-ms",
        "off",
        "--client-processes",
        str(processes),
    ]
    if rate is not None:
        cmd += ["--request-rate", f"{rate:g}"]
    if ns.api_key:
        cmd += ["--api-key", ns.api_key]
    return cmd


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def run_side(
    urls: list[str], ns: argparse.Namespace, seed: int, tmp: Path, tag: str, processes: int = 1
) -> list[dict[str, Any]]:
    """One bench per URL, all at once (each over `processes` client processes); returns the successful
    per-request records."""
    procs = []
    for i, (url, c, n) in enumerate(zip(urls, split(ns.concurrency, len(urls)), split(ns.num_prompts, len(urls)))):
        if c == 0 or n == 0:
            continue
        out = tmp / f"{tag}-{seed}-{i}.json"
        # Open loop: the same total arrival rate on both sides, split like the prompts.
        rate = ns.request_rate * n / ns.num_prompts if ns.request_rate else None
        procs.append(
            (
                subprocess.Popen(
                    bench_cmd(url, c, n, seed * 100 + i, out, ns, processes, rate),
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
                out,
            )
        )
    records = []
    for proc, out in procs:
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"pagoda bench failed ({proc.returncode}):\n{stderr[-2000:]}\n{stdout[-2000:]}")
        for point in json.loads(out.read_text())["points"]:
            records += [r for r in point.get("requests", []) if r.get("success")]
    return records


def summarize(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    ttfts = [r["ttft"] for run in runs for r in run if r.get("ttft") is not None]
    rates = [
        (r["completion_tokens"] - 1) / (r["e2el"] - r["ttft"])
        for run in runs
        for r in run
        if (r.get("completion_tokens") or 0) > 1 and r["e2el"] > r["ttft"]
    ]
    throughputs = []
    for run in runs:  # perf_counter is CLOCK_MONOTONIC: comparable across the parallel bench processes
        wall = max(r["end"] for r in run) - min(r["start"] for r in run)
        throughputs.append(sum(r.get("completion_tokens") or 0 for r in run) / wall)
    return {
        "requests": sum(len(run) for run in runs),
        "p50_ttft_ms": statistics.median(ttfts) * 1000,
        "output_tok_s": statistics.mean(throughputs),
        "median_stream_tok_s": statistics.median(rates),
    }


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--serve-fake":
        serve_fake(int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", action="append", default=[], help="backend root URL (repeat)")
    p.add_argument("--fake-backends", type=int, default=0, help="start N fake streaming backends instead")
    p.add_argument("--fake-ttft-ms", type=float, default=20.0)
    p.add_argument("--fake-tpot-ms", type=float, default=20.0)
    p.add_argument("--api-key", default=None, help="the backends' key (sent directly, and by the router)")
    p.add_argument("--policy", default="least-loaded")
    p.add_argument(
        "--concurrency",
        type=int,
        default=256,
        help="streams at once (closed loop); with --request-rate the cap on streams in flight",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="open loop: Poisson arrivals at this many requests/s in all (e.g. 100 with the fake "
        "backends' defaults keeps ~256 streams open) instead of waves of --concurrency",
    )
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=32, help="warm-up requests per bench process (at most its c)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="around+through pairs, alternating order")
    p.add_argument("--out", default=None, help="write the summary JSON here")
    p.add_argument(
        "--cpu-per-event",
        action="store_true",
        help="measure the router's CPU per relayed stream event instead (in-process client; "
        "use a moderate --concurrency so the machine is not saturated)",
    )
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `pagoda router` (repeat; e.g. --router-arg=--max-attempts --router-arg=1)",
    )
    p.add_argument(
        "--router-cpu",
        type=int,
        default=None,
        help="pin the router to this CPU (Linux), so client and backends do not share its core; with "
        "--router-workers N, to the N cores from this one",
    )
    p.add_argument(
        "--router-workers", type=int, default=1, help="router processes (`pagoda router --workers N`, default 1)"
    )
    ns = p.parse_args()

    children: list[subprocess.Popen] = []
    try:
        backends = list(ns.backend)
        for _ in range(ns.fake_backends):
            port = free_port()
            children.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--serve-fake", str(port), str(ns.fake_ttft_ms), str(ns.fake_tpot_ms)]
                )
            )
            backends.append(f"http://127.0.0.1:{port}")
        if not backends:
            p.error("give --backend URL (repeatable) or --fake-backends N")
        for url in backends:
            wait_ok(url + "/health", 120)
        port = free_port()
        router_cmd = [
            sys.executable,
            "-m",
            "pagoda",
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            ns.policy,
            *[arg for u in backends for arg in ("--backend", u)],
        ]
        if ns.api_key:
            router_cmd += ["--backend-api-key", ns.api_key]
        if ns.router_workers > 1:
            router_cmd += ["--workers", str(ns.router_workers)]
        router_cmd += ns.router_arg
        t0 = time.monotonic()
        cores = None if ns.router_cpu is None else set(range(ns.router_cpu, ns.router_cpu + ns.router_workers))
        pin = None if cores is None else (lambda: os.sched_setaffinity(0, cores))  # the workers inherit it
        router_proc = subprocess.Popen(router_cmd, cwd=REPO, preexec_fn=pin)  # noqa: PLW1509 - no threads yet
        children.append(router_proc)
        router = f"http://127.0.0.1:{port}"
        wait_ok(router + "/health", 30, lambda r: all(b["healthy"] for b in r.json()["backends"]))
        print(f"router ready in {time.monotonic() - t0:.2f} s (healthy backends: {len(backends)})", file=sys.stderr)
        config = {
            "backends": backends,
            "fake": bool(ns.fake_backends),
            "policy": ns.policy,
            "concurrency": ns.concurrency,
            "request_rate": ns.request_rate,
            "num_prompts": ns.num_prompts,
            "input_len": ns.input_len,
            "output_len": ns.output_len,
            "rounds": ns.rounds,
            "router_args": ns.router_arg,
            "router_workers": ns.router_workers,
            "router_cpus": sorted(cores) if cores is not None else None,
        }
        if ns.cpu_per_event:
            result = {"config": config, **cpu_per_event(router, router_proc.pid, ns)}
            print(
                f"router CPU per relayed event: {result['us_per_event_min']:.1f} us (best of {ns.rounds}), "
                f"median {result['us_per_event_median']:.1f} us; one core relays "
                f"~{result['events_per_core_s']:.0f} events/s"
            )
        else:
            result = compare_around_through(backends, router, config, ns)
        if ns.out:
            Path(ns.out).write_text(json.dumps(result, indent=2))
        return 0
    finally:
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(15)
            except subprocess.TimeoutExpired:
                child.kill()


def compare_around_through(
    backends: list[str], router: str, config: dict[str, Any], ns: argparse.Namespace
) -> dict[str, Any]:
    """Alternating rounds straight at the backends and through the router; prints the comparison."""
    around: list[list[dict[str, Any]]] = []
    through: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(ns.rounds):
            order = [("around", backends), ("through", [router])]
            for tag, urls in order if rnd % 2 == 0 else order[::-1]:
                seed = 1 + rnd * 2 + (tag == "through")
                # the same number of client processes on both sides: the client must not be what differs
                records = run_side(urls, ns, seed, Path(tmp), tag, 1 if tag == "around" else len(backends))
                (around if tag == "around" else through).append(records)
                print(f"round {rnd + 1} {tag}: {len(records)} ok", file=sys.stderr)
    a, t = summarize(around), summarize(through)
    result = {
        "config": config,
        "around": a,
        "through": t,
        "ttft_p50_added_ms": t["p50_ttft_ms"] - a["p50_ttft_ms"],
        "output_tok_s_ratio": t["output_tok_s"] / a["output_tok_s"],
        "stream_tok_s_ratio": t["median_stream_tok_s"] / a["median_stream_tok_s"],
    }
    print(f"{'':10}{'requests':>10}{'P50 TTFT ms':>14}{'out tok/s':>12}{'stream tok/s':>14}")
    for name, s in (("around", a), ("through", t)):
        print(
            f"{name:10}{s['requests']:>10}{s['p50_ttft_ms']:>14.2f}{s['output_tok_s']:>12.1f}"
            f"{s['median_stream_tok_s']:>14.2f}"
        )
    print(
        f"router adds {result['ttft_p50_added_ms']:+.2f} ms P50 TTFT (target <= 1 ms); output tok/s "
        f"x{result['output_tok_s_ratio']:.3f}, per-stream tok/s x{result['stream_tok_s_ratio']:.3f} "
        f"(target >= 0.95)"
    )
    return result


if __name__ == "__main__":
    sys.exit(main())
