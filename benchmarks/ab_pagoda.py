"""Pagoda against Pagoda: two or more builds or switches served side by side on one GPU, measured alternately
by vLLM's own `bench serve` client.

    python benchmarks/ab_pagoda.py --models DIR --workload text \\
        --side "before=/path/to/old/src" --side "after=." --rounds 2 --points c1 c64 c256
    python benchmarks/ab_pagoda.py --models DIR --workload image-qwen2-vl-2b --capacity 26 --points rate0.7 \\
        --side "base=." --side "budget=.|--max-encoder-tokens-per-step 2048" --side "async=.|PAGODA_ASYNC_ENCODER=1"

A side is `LABEL=SRC[|ARGS]`: SRC is a folder holding the `pagoda` package (the server runs there, so that
its `pagoda` is imported; `.` is this checkout); ARGS are extra `pagoda serve` flags, where a token
`NAME=VALUE` with an upper-case NAME is an environment variable instead. Every side is started at once and
stays up (each with a fixed KV pool, `--blocks`, since a server that sizes its cache from free memory would
count its neighbours' as used);
then each round runs every point on every side, the side order reversed every other round, so that a drift
of the machine lands on all sides alike. An idle server costs its neighbours no GPU time.

Points are the workload's in vs_vllm.py; Poisson points need `--capacity` (req/s that their fractions
scale). Rows go to WORK/rows.jsonl and `--out` as vs_vllm.json does (`variant` = the side's label, `round`);
the table printed last gives each side's mean over rounds and its ratio to the first side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_vllm import (  # noqa: E402  (this folder's comparison harness)
    _short,
    free_port,
    launch_server,
    read_rows,
    run_point,
    server_command,
    stop_server,
    wait_healthy,
    workloads,
    write_result,
)

SHOWN = ("request_throughput", "output_throughput", "median_ttft_ms", "p95_ttft_ms", "median_tpot_ms", "p95_tpot_ms")


@dataclass(frozen=True)
class Side:
    label: str
    src: Path
    args: list[str]
    env: dict[str, str]

    @classmethod
    def parse(cls, spec: str) -> Side:
        label, sep, rest = spec.partition("=")
        if not sep or not label:
            raise SystemExit(f"--side {spec!r}: expected LABEL=SRC[|ARGS]")
        src, _, tail = rest.partition("|")
        args, env = [], {}
        for token in tail.split():
            name, eq, value = token.partition("=")
            if eq and name.isupper() and not name.startswith("-"):
                env[name] = value
            else:
                args.append(token)
        return cls(label, Path(src or ".").resolve(), args, env)


def summary(rows: list[dict], labels: list[str]) -> str:
    """Markdown: per point and side, the mean over rounds (min-max of throughput) and the ratio to the first side."""
    lines = [
        "| point | side | req/s (min-max) | ratio | out tok/s | TTFT p50 / p95 ms | TPOT p50 / p95 ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    points = list(dict.fromkeys(r["point"] for r in rows))
    for point in points:
        base = None
        for label in labels:
            mine = [r for r in rows if r["point"] == point and r["variant"] == label and r.get("request_throughput")]
            if not mine:
                continue
            mean = {k: statistics.fmean(float(r.get(k) or 0) for r in mine) for k in SHOWN}
            rps = [r["request_throughput"] for r in mine]
            base = base or mean["request_throughput"]
            lines.append(
                f"| {point} | {label} | {mean['request_throughput']:.2f} ({min(rps):.2f}-{max(rps):.2f}) | "
                f"{mean['request_throughput'] / base:.3f}x | {mean['output_throughput']:.0f} | "
                f"{mean['median_ttft_ms']:.0f} / {mean['p95_ttft_ms']:.0f} | "
                f"{mean['median_tpot_ms']:.2f} / {mean['p95_tpot_ms']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=Path, required=True, help="the folder `vs_vllm.py models` wrote")
    parser.add_argument("--workload", choices=list(workloads([])), required=True)
    parser.add_argument("--side", action="append", required=True, help="LABEL=SRC[|ARGS] (two or more)")
    parser.add_argument("--points", nargs="+", default=None, help="only these points of the workload")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--capacity", type=float, default=None, help="req/s that Poisson points' fractions scale")
    parser.add_argument("--blocks", type=int, default=8192, help="KV blocks per server (--num-gpu-blocks-override)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ab_pagoda"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gpu", default="NVIDIA H200")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    sides = [Side.parse(s) for s in args.side]
    if len({s.label for s in sides}) != len(sides) or len(sides) < 2:
        raise SystemExit("--side: two or more, each with its own label")
    wl = workloads([])[args.workload]
    points = [p for p in wl.points if not args.points or p.name in args.points]
    if any(p.rate_fraction is not None for p in points) and not args.capacity:
        raise SystemExit("Poisson points need --capacity REQ_PER_S")
    model = str(args.models / wl.model)
    args.work.mkdir(parents=True, exist_ok=True)

    servers = {}
    t0 = time.monotonic()
    for side in sides:
        port = free_port()
        extra = [*side.args, "--num-gpu-blocks-override", str(args.blocks)]
        env = {**side.env, "PYTHONPATH": os.pathsep.join([str(side.src), os.environ.get("PYTHONPATH", "")])}
        log = args.work / f"server_{side.label}.log"
        cmd = server_command("pagoda", model, port, extra)
        servers[side.label] = (launch_server(cmd, log, env, cwd=side.src), port)
        time.sleep(1)  # free_port() must not hand the same port to the next side before this one binds it
    try:
        for side in sides:
            proc, port = servers[side.label]
            ok = wait_healthy(proc, port)
            print(f"[{side.label}] ready={ok} after {time.monotonic() - t0:.0f} s", flush=True)
            if not ok:
                raise SystemExit(f"side {side.label} did not start: {args.work}/server_{side.label}.log")
        warm = type(points[0])("warm", points[0].args, 16, 1, concurrency=8)
        for side in sides:
            run_point(f"http://127.0.0.1:{servers[side.label][1]}", model, warm, None, seed=9)
        for rnd in range(args.rounds):
            for seed, point in enumerate(points, start=1):
                order = sides if rnd % 2 == 0 else sides[::-1]
                for side in order:
                    rate = round(args.capacity * point.rate_fraction, 3) if point.rate_fraction else None
                    row = {"workload": args.workload, "system": "pagoda", "client": "vllm", "point": point.name}
                    row.update({"concurrency": point.concurrency} if rate is None else {"request_rate": rate})
                    row.update(variant=side.label, round=rnd)
                    row.update(run_point(f"http://127.0.0.1:{servers[side.label][1]}", model, point, rate, seed))
                    with (args.work / "rows.jsonl").open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"  r{rnd} {side.label}: " + _short(row), flush=True)
                    write_result(read_rows(args.work), args.out, args.gpu, args.commit, quiet=True)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    print(summary(read_rows(args.work), [s.label for s in sides]))


if __name__ == "__main__":
    main()
