"""A served Qwen2-VL image point under switch variants, Pagoda alone: where the engine core's time goes.

    # on the GPU machine, with a model folder from `benchmarks/vs_vllm.py models DIR`:
    python benchmarks/profile/served_image_variants.py --model DIR/qwen2-vl-2b \
        --variant cudnn1=PAGODA_VISION_CUDNN_AFTER=1 --variant default= \
        --images 1000x750 --images 1000x750,640x480,1280x960 --concurrency 64 --prompts 384 [--py-spy default] \
        [--out FILE.json]

For each variant (NAME=ENV=VALUE[,ENV=VALUE...][,--flag=value...]; empty: the defaults) it starts `pagoda serve` on
the folder (random weights, `--api-server-count 4`, as `vs_vllm.py` does), warms it with 32 one-image requests at c=16
(`--warm-requests`), then runs one `pagoda bench` point per `--images` list (each request one random JPEG, the sizes
in turn) and stops it. Per point it records the client's rates and latencies, the engine core's split (its own
counters: busy share, host and device-wait ms per step, the loop thread's CPU ms per step), the GPU's busy share
(nvidia-smi) and how many of the machine's cores were busy (all processes, /proc). `--py-spy NAME` records the engine
core of that variant with native frames (`py-spy record --native --idle`, 10 s from 3 s into each point: the core is
the server's child holding the most memory) into FILE.spy-POINT.txt beside --out; `--summarize FILE.spy-POINT.txt`
prints the main thread's frames by their share of its samples.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import vs_vllm  # noqa: E402  (the server launcher, the engine split and the GPU sampler)


def busy_cores() -> float:
    """CPU seconds used so far by every process on the machine (/proc/*/stat utime + stime)."""
    total, tick = 0, os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])
    return total / tick


def engine_core_pid(server_pid: int) -> int:
    import psutil

    children = psutil.Process(server_pid).children(recursive=True)
    return max(children, key=lambda c: c.memory_info().rss).pid


def record_core(server_pid: int, out: Path) -> None:
    time.sleep(3)
    cmd = ["py-spy", "record", "--pid", str(engine_core_pid(server_pid)), "--native", "--idle", "--threads"]
    cmd += ["--rate", "100", "--duration", "10", "--format", "raw", "-o", str(out)]
    subprocess.run(cmd, capture_output=True, check=False)


def summarize(raw: Path, top: int = 60) -> None:
    """The engine core's main thread in a py-spy raw record: each frame's share of the samples it is on the stack."""
    samples, frames = 0, collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        parts = stack.split(";")
        if "MainThread" not in parts[0]:
            continue
        samples += int(count)
        for frame in set(parts[1:]):
            frames[re.sub(r" \(/[^)]*/([^/)]+)\)", r" (\1)", frame)] += int(count)
    print(f"{samples} samples of the main thread")
    for frame, n in frames.most_common(top):
        print(f"{100 * n / samples:5.1f}%  {frame[:160]}")


def one_image_point(name: str, images: str, concurrency: int, prompts: int, temperature: float = 0.0) -> vs_vllm.Point:
    """`vs_vllm`'s one-image point for `pagoda bench` (4 client processes), its sizes in turn; `temperature` > 0
    samples (vLLM's client sends none, so the server's default, 1.0, samples there)."""
    args = [images if a == "1000x750" else a for a in vs_vllm.PB_ONE_IMAGE] + ["--temperature", f"{temperature:g}"]
    return vs_vllm.Point(name, [], prompts, 4, concurrency=concurrency, pagoda_args=args)


def run_point(
    url: str, model: str, point: vs_vllm.Point, work: Path, spy: tuple[int, Path] | None, seed: int = 3
) -> dict:
    """`vs_vllm.run_point_pagoda_bench`'s row, plus the machine's busy cores over the point; `spy`: (server pid,
    record file) to record the engine core meanwhile."""
    spy_thread = threading.Thread(target=record_core, args=spy) if spy else None
    if spy_thread is not None:
        spy_thread.start()
    cpu0, t0 = busy_cores(), time.perf_counter()
    row = vs_vllm.run_point_pagoda_bench(url, model, point, None, seed, work)
    row["machine_cores_busy"] = round((busy_cores() - cpu0) / (time.perf_counter() - t0), 2)
    if spy_thread is not None:
        spy_thread.join()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--variant", action="append", help="NAME=ENV=VALUE[,ENV=VALUE...][,--flag=value...]")
    parser.add_argument("--images", action="append", default=None, help="WxH[,WxH...]: one point each")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=384)
    parser.add_argument("--temperature", type=float, default=0.0, help="sent with every request (0: greedy)")
    parser.add_argument(
        "--warm-requests",
        type=int,
        default=32,
        help="one-image requests at c=16 before the points (0: none, the points meet the fresh server)",
    )
    parser.add_argument("--py-spy", default=None, help="the variant whose engine core py-spy records")
    parser.add_argument("--work", type=Path, default=Path("/tmp/served_image_variants"))
    parser.add_argument("--out", type=Path, default=Path("served_image_variants.json"))
    parser.add_argument("--summarize", type=Path, default=None, help="a py-spy raw record to summarize, and stop")
    args = parser.parse_args()
    if args.summarize is not None:
        summarize(args.summarize)
        return
    if not args.model or not args.variant:
        parser.error("--model and at least one --variant are needed")
    args.work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for spec in args.variant:
        name, _, assignments = spec.partition("=")
        # A comma starts a new item only before NAME= or --, so a value may hold commas
        # (PAGODA_CORE_TRACE=PATH,SKIP,STEPS); items starting with -- are server flags (--flag=value).
        items = [a for a in re.split(r",(?=[A-Z_][A-Z0-9_]*=|--)", assignments) if a]
        env = dict(a.split("=", 1) for a in items if not a.startswith("--"))
        flags = [part for a in items if a.startswith("--") for part in a.split("=", 1)]
        port = vs_vllm.free_port()
        cmd = vs_vllm.server_command("pagoda", args.model, port, flags)
        proc = vs_vllm.start_server(cmd, port, args.work / f"server_{name}.log", env=env)
        print(f"[{name}] {env or 'defaults'} {flags}: ready={proc is not None}", flush=True)
        if proc is None:
            continue
        url = f"http://127.0.0.1:{port}"
        try:
            # Its own seed: the point's images must not be the warm-up's, which the encoder and prefix caches hold.
            if args.warm_requests:
                warm = one_image_point("warm", "1000x750", 16, args.warm_requests, args.temperature)
                run_point(url, args.model, warm, args.work, None, seed=1)
            for i, images in enumerate(args.images or ["1000x750"]):
                spy = (proc.pid, args.out.with_suffix(f".spy-{i}.txt")) if args.py_spy == name else None
                point = one_image_point(
                    f"c{args.concurrency}", images, args.concurrency, args.prompts, args.temperature
                )
                row = run_point(url, args.model, point, args.work, spy)
                if "client_error" in row:
                    print(f"  pagoda bench failed: {row['client_error']}", flush=True)
                    continue
                row = {
                    "variant": name,
                    "env": env,
                    "flags": flags,
                    "concurrency": args.concurrency,
                    "images": images,
                    **row,
                }
                rows.append(row)
                print(
                    "  "
                    + json.dumps(
                        {k: row.get(k) for k in ("images", "request_throughput", "p95_ttft_ms", "slowest_ttft")}
                    )
                )
                args.out.write_text(json.dumps({"gpu": vs_vllm.gpu_name(), "rows": rows}, indent=1) + "\n")
        finally:
            vs_vllm.stop_server(proc)
    keys = ("request_throughput", "median_ttft_ms", "p95_ttft_ms", "p99_ttft_ms", "p95_tpot_ms", "engine_busy_pct")
    keys += ("engine_host_ms_per_step", "engine_wait_ms_per_step", "gpu_util_mean_pct", "machine_cores_busy")
    keys += tuple(vs_vllm.MEANS_MS)
    print("| variant | sizes | " + " | ".join(keys) + " |")
    for r in sorted(rows, key=lambda r: (r["images"], r["variant"])):
        cells = [f"{r[k]:.2f}" if isinstance(r.get(k), float) else str(r.get(k)) for k in keys]
        print(f"| {r['variant']} | {len(r['images'].split(','))} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
