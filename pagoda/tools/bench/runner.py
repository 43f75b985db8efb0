"""Run one load point (closed loop with a concurrency cap, or open loop at a request rate) on asyncio + httpx,
while sampling the server's /metrics; and calibrate random prompts against the server's token counts.

Closed loop: all requests are due at once and a semaphore of size c lets c of them be in flight; a request's
clock starts when it takes a slot, so TTFT/E2EL exclude client-side waiting but include any queueing inside
the server. Open loop: requests are due at gamma/Poisson arrival times; with a cap, the time a due request
waits for a slot is reported separately as `*_client_queue_ms`.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from pagoda.tools.bench.client import RequestResult, stream_request
from pagoda.tools.bench.metrics import SLO, aggregate, parse_prometheus, server_metrics_summary
from pagoda.tools.bench.workload import RequestSpec, Workload, arrival_intervals, random_words

SAMPLE_INTERVAL_S = 0.5


@dataclass
class PointConfig:
    concurrency: int | None  # cap on requests in flight (None: unbounded, open loop only)
    num_prompts: int
    warmup: int
    request_rate: float = math.inf  # inf: closed loop / all at t = 0
    burstiness: float = 1.0
    open_loop: bool = False  # --request-rate given (even inf): reported as mode "open"


@dataclass
class Target:
    root: str  # server root, e.g. http://127.0.0.1:8000 (no /v1)
    headers: dict[str, str]
    timeout: float
    endpoint: str  # "chat" | "completions"

    @property
    def url(self) -> str:
        return self.root + ("/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions")


class MetricsSampler:
    """Scrapes `/metrics` before, every SAMPLE_INTERVAL_S during, and after a point; tolerates its absence."""

    def __init__(self, target: Target):
        self.target = target
        self.client = httpx.AsyncClient(base_url=target.root, headers=target.headers, timeout=5.0)
        self.samples: list[dict] = []
        self.disabled = False
        self._task: asyncio.Task | None = None
        self.before: dict | None = None

    async def scrape(self) -> dict | None:
        if self.disabled:
            return None
        try:
            response = await self.client.get("/metrics")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            self.disabled = response.status_code in (401, 403, 404)
            return None
        return parse_prometheus(response.text)

    async def _loop(self) -> None:
        while True:
            sample = await self.scrape()
            if sample is not None:
                self.samples.append(sample)
            elif self.disabled:
                return
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    async def start(self) -> None:
        self.before = await self.scrape()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> dict[str, Any]:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        after = await self.scrape()
        if after is not None:
            self.samples.append(after)
        await self.client.aclose()
        return server_metrics_summary(self.before, after, self.samples)


async def _run_requests(
    client: httpx.AsyncClient,
    target: Target,
    bodies: list[dict],
    cap: int | None,
    request_rate: float,
    burstiness: float,
    seed: int,
    progress: Any,
) -> list[RequestResult]:
    chat = target.endpoint == "chat"
    sem = asyncio.Semaphore(cap) if cap else None
    open_loop = not math.isinf(request_rate)

    async def one(body: dict, due: float | None) -> RequestResult:
        if sem is None:
            result = await stream_request(client, target.url, body, target.headers, chat, due, target.timeout)
        else:
            async with sem:
                result = await stream_request(client, target.url, body, target.headers, chat, due, target.timeout)
        if progress is not None:
            progress.update(1)
        return result

    if not open_loop:
        return list(await asyncio.gather(*(one(b, None) for b in bodies)))
    gaps = arrival_intervals(len(bodies), request_rate, burstiness, np.random.default_rng(seed))
    tasks = []
    due = time.perf_counter()
    for body, gap in zip(bodies, gaps):
        due += float(gap)
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(body, due)))
    return list(await asyncio.gather(*tasks))


def _client_share(total: int | None, processes: int, index: int) -> int | None:
    """Process `index`'s part of a count split as evenly as possible (None stays None)."""
    if total is None:
        return None
    return total // processes + (1 if index < total % processes else 0)


def _client_process(
    target: Target,
    warm: list[dict],
    bodies: list[dict],
    cap: int | None,
    request_rate: float,
    burstiness: float,
    seed: int,
    start_at: Any,
    conn: Any,
) -> None:
    """One client process of a multi-process point: its own event loop and connection pool, released by
    `start_at` (a barrier) together with the others; sends back (results, cpu seconds, t0, t1)."""

    async def go() -> tuple[list[RequestResult], float, float, float]:
        limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
        async with httpx.AsyncClient(timeout=httpx.Timeout(target.timeout), limits=limits) as client:
            if warm:
                await _run_requests(client, target, warm, cap or len(warm), math.inf, 1.0, seed, None)
            await asyncio.get_running_loop().run_in_executor(None, start_at.wait)
            cpu0, t0 = time.process_time(), time.perf_counter()
            results = await _run_requests(client, target, bodies, cap, request_rate, burstiness, seed, None)
            return results, time.process_time() - cpu0, t0, time.perf_counter()

    conn.send(asyncio.run(go()))
    conn.close()


def _run_in_processes(
    target: Target, warm: list[dict], bodies: list[dict], cfg: PointConfig, seed: int, processes: int
) -> tuple[list[RequestResult], float, list[float]]:
    """Split a point over several client processes (a cap of c becomes c/N per process, the request
    rate r becomes r/N each: the sum of N independent Poisson streams is Poisson at r). Returns the
    results, the span from the first process's start to the last one's end, and each one's CPU %."""
    ctx = mp.get_context("spawn")  # no fork from a process with a running event loop and threads
    barrier = ctx.Barrier(processes + 1)
    pipes, procs = [], []
    for i in range(processes):
        mine = bodies[i::processes]
        cap = _client_share(cfg.concurrency, processes, i)
        rate = cfg.request_rate / processes
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_client_process,
            daemon=True,
            args=(target, warm[i::processes], mine, cap, rate, cfg.burstiness, seed + i, barrier, child),
        )
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    barrier.wait()
    outs = [pipe.recv() for pipe in pipes]
    for proc in procs:
        proc.join()
    results = [r for out in outs for r in out[0]]
    t0, t1 = min(o[2] for o in outs), max(o[3] for o in outs)
    return results, t1 - t0, [100.0 * o[1] / max(o[3] - o[2], 1e-9) for o in outs]


async def run_point(
    target: Target,
    workload: Workload,
    cfg: PointConfig,
    slo: SLO,
    seed: int,
    show_progress: bool = True,
    keep_details: bool = False,
    processes: int = 1,
) -> dict[str, Any]:
    """Warm up, then measure one point; returns the vLLM keys plus server_metrics (and per-request details).
    processes > 1 spreads the requests over that many client processes (a client that would
    otherwise be the bottleneck at high concurrency); the point needs concurrency >= processes."""
    warm_bodies = [workload.body(s) for s in workload.next_specs(cfg.warmup)]
    bodies = [workload.body(s) for s in workload.next_specs(cfg.num_prompts)]  # images encoded before timing
    processes = max(1, min(processes, cfg.concurrency or processes, len(bodies)))
    limit = cfg.concurrency or None
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    label = (
        f"c={cfg.concurrency}"
        if not cfg.open_loop
        else f"rate={cfg.request_rate:g}/s" + (f" c<={cfg.concurrency}" if cfg.concurrency else "")
    )
    if processes > 1:
        sampler = MetricsSampler(target)
        await sampler.start()
        results, duration, cpus = await asyncio.get_running_loop().run_in_executor(
            None, _run_in_processes, target, warm_bodies, bodies, cfg, seed, processes
        )
        server = await sampler.stop()
        cpu_percent = max(cpus)
    else:
        async with httpx.AsyncClient(timeout=httpx.Timeout(target.timeout), limits=limits) as client:
            if warm_bodies:
                await _run_requests(
                    client, target, warm_bodies, cfg.concurrency or len(warm_bodies), math.inf, 1.0, seed, None
                )
            sampler = MetricsSampler(target)
            await sampler.start()
            progress = tqdm(
                total=len(bodies),
                desc=label,
                unit="req",
                file=sys.stderr,
                disable=not show_progress,
                leave=True,
                dynamic_ncols=True,
            )
            cpu0, t0 = time.process_time(), time.perf_counter()
            try:
                results = await _run_requests(
                    client, target, bodies, cfg.concurrency, cfg.request_rate, cfg.burstiness, seed, progress
                )
            finally:
                progress.close()
            duration = time.perf_counter() - t0
            cpu_percent = 100.0 * (time.process_time() - cpu0) / max(duration, 1e-9)
            server = await sampler.stop()
    point = aggregate(results, duration, slo)
    point = {
        "mode": "open" if cfg.open_loop else "closed",
        "concurrency": cfg.concurrency,
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,  # as vLLM writes it
        "burstiness": cfg.burstiness,
        "num_prompts": cfg.num_prompts,
        "warmup": cfg.warmup,
        **point,
        "client_processes": processes,
        "client_cpu_percent": cpu_percent,
        "server_metrics": server,
    }
    point["slo_pass"] = slo.point_ok(point)
    if keep_details:
        point["requests"] = [r.detail() for r in results]
    return point


async def calibrate(target: Target, workload: Workload) -> dict[str, Any]:
    """Two probe prompts (max_tokens 1) of W1 and W2 random words give tokens per word and the fixed overhead
    (chat template, BOS) from usage.prompt_tokens; then set the word count that lands on --input-len (with
    images: the text alone is --input-len tokens, as in vLLM's random-mm dataset). The probes carry no image
    and draw their words from their own generator, so the measured requests do not depend on calibration."""
    chat = target.endpoint == "chat"
    w1 = max(32, workload.input_len // 2)
    w2 = max(64, workload.input_len)
    measured = []
    probe_rng = np.random.default_rng([workload.seed, 0xCA11])
    async with httpx.AsyncClient(timeout=httpx.Timeout(target.timeout)) as client:
        for words in (w1, w2):
            body = workload.body(RequestSpec(prompt=random_words(probe_rng, words)), max_tokens=1)
            body.pop("ignore_eos", None)
            r = await stream_request(client, target.url, body, target.headers, chat)
            if r.status != 200 or not r.usage_reported or r.prompt_tokens is None:
                return {
                    "calibrated": False,
                    "words_per_prompt": workload.words_per_prompt,
                    "reason": r.error or "the server reported no usage.prompt_tokens",
                }
            measured.append(r.prompt_tokens)
    per_word = (measured[1] - measured[0]) / (w2 - w1)
    if per_word <= 0:
        return {
            "calibrated": False,
            "words_per_prompt": workload.words_per_prompt,
            "reason": f"prompt tokens did not grow with words ({measured})",
        }
    overhead = measured[0] - per_word * w1
    if workload.image_sizes:  # random-mm: --input-len counts the text prompt alone (vLLM's --random-input-len)
        words = max(1, round(workload.input_len / per_word))
    else:
        words = max(1, round((workload.input_len - overhead) / per_word))
    workload.words_per_prompt = words
    info: dict[str, Any] = {
        "calibrated": True,
        "tokens_per_word": per_word,
        "overhead_tokens": overhead,
        "words_per_prompt": words,
        "expected_prompt_tokens": overhead + per_word * words,
    }
    if workload.image_sizes:
        info["expected_text_tokens"] = per_word * words
        info["expected_prompt_tokens"] = None  # template + text + the image's tokens: the server's count decides
    elif workload.input_len < overhead + per_word:
        info["note"] = (
            f"--input-len {workload.input_len} is below the fixed prompt overhead "
            f"(~{overhead:.0f} tokens of template/BOS); prompts use 1 word"
        )
    return info
