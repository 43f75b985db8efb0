"""What a served engine core's GPU waited for: a summary of a `PAGODA_CORE_TRACE` Chrome trace.

    PAGODA_CORE_TRACE=/tmp/core.json.gz,300,200 pagoda serve ...   # then load it, stop the server
    python benchmarks/profile/core_trace_summary.py /tmp/core.json.gz [--gap-ms 0.2] [--top 12] [--json OUT]

Over the traced window (first to last `ProfilerStep#N` range on the core's thread) it prints:
  * the GPU's busy share (union of kernels, copies and memsets) and its idle gaps by length;
  * for the idle gaps of at least --gap-ms, what the core's thread was inside while the GPU waited: the time of
    each CUDA runtime call (a synchronising copy, a launch) and each outermost operator overlapping the gaps, and
    the share covered by neither (Python: scheduling, output processing, sockets);
  * the five longest gaps: where each starts, the step it starts in, the host call overlapping it most;
  * the steps by kind (`image` when the step launched the vision tower's attention or QuickGELU kernels, else
    `decode/prefill`): count, mean CPU ms per step and mean GPU busy ms inside each step's span.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re
import statistics

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
STEP = re.compile(r"ProfilerStep#\d+")
IMAGE_KERNELS = re.compile(r"sdpa|fmha|flash|_quick_gelu")  # the vision tower's attention and activation


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def in_spans(spans: list[tuple[float, float]], window: tuple[float, float]) -> float:
    """Time of `window` inside the sorted, disjoint `spans`."""
    i = max(0, bisect.bisect_right(spans, (window[0], float("inf"))) - 1)
    total = 0.0
    while i < len(spans) and spans[i][0] < window[1]:
        total += overlap(spans[i], window)
        i += 1
    return total


def step_kind(kernel_names: list[str]) -> str:
    if any(IMAGE_KERNELS.search(n) for n in kernel_names):
        return "image"
    return "decode/prefill" if kernel_names else "no GPU work"


def summarize(events: list[dict], gap_ms: float = 0.2, top: int = 12) -> dict:
    steps = [e for e in events if STEP.fullmatch(e.get("name", ""))]
    if not steps:
        raise SystemExit("no ProfilerStep ranges: was the trace written by PAGODA_CORE_TRACE?")
    thread = (steps[0]["pid"], steps[0]["tid"])
    window = (min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps))
    span = window[1] - window[0]
    gpu = merge([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS])
    gpu = [(max(s, window[0]), min(e, window[1])) for s, e in gpu if e > window[0] and s < window[1]]
    busy = sum(e - s for s, e in gpu)
    edges = [window[0], *[x for iv in gpu for x in iv], window[1]]
    gaps = [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2) if edges[i + 1] > edges[i]]
    buckets = collections.OrderedDict((f">= {b} ms", [0, 0.0]) for b in (0.05, 0.2, 1.0, 5.0))
    for s, e in gaps:
        for label, bound in zip(buckets, (0.05, 0.2, 1.0, 5.0)):
            if (e - s) / 1e3 >= bound:
                buckets[label][0] += 1
                buckets[label][1] += (e - s) / 1e3
    long_gaps = [g for g in gaps if (g[1] - g[0]) / 1e3 >= gap_ms]
    on_thread = [e for e in events if (e["pid"], e["tid"]) == thread and not STEP.fullmatch(e.get("name", ""))]
    runtime = [e for e in on_thread if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    ops = [e for e in on_thread if e.get("cat") == "cpu_op"]
    outer = _outermost(ops)
    by_name: dict[str, float] = collections.defaultdict(float)
    for label, group in (("runtime", runtime), ("op", outer)):
        for e in group:
            t = in_spans(long_gaps, (e["ts"], e["ts"] + e["dur"]))
            if t > 0:
                by_name[f"{label}: {e['name']}"] += t / 1e3
    gap_total = sum(e - s for s, e in long_gaps) / 1e3
    host_calls = merge([(e["ts"], e["ts"] + e["dur"]) for e in outer + runtime])
    in_ops = sum(in_spans(host_calls, g) for g in long_gaps) / 1e3
    steps.sort(key=lambda e: e["ts"])
    starts = [st["ts"] for st in steps]
    launched: list[list[str]] = [[] for _ in steps]  # kernel names by the step whose thread launched them
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in runtime if "correlation" in e.get("args", {})}
    for k in events:
        ts = launch_ts.get(k.get("args", {}).get("correlation")) if k.get("cat") == "kernel" else None
        i = bisect.bisect_right(starts, ts) - 1 if ts is not None else -1
        if i >= 0 and ts < steps[i]["ts"] + steps[i]["dur"]:
            launched[i].append(k["name"])
    kinds: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for st, names in zip(steps, launched):
        iv = (st["ts"], st["ts"] + st["dur"])
        kinds[step_kind(names)].append((st["dur"] / 1e3, in_spans(gpu, iv) / 1e3))
    return {
        "window_ms": span / 1e3,
        "steps": len(steps),
        "gpu_busy_pct": 100 * busy / span if span else 0.0,
        "gaps": {label: {"count": c, "ms": round(t, 3)} for label, (c, t) in buckets.items()},
        "long_gaps": {"min_ms": gap_ms, "count": len(long_gaps), "ms": round(gap_total, 3)},
        "longest_gaps": [
            _describe(g, window[0], steps, outer + runtime) for g in sorted(gaps, key=lambda g: g[0] - g[1])[:5]
        ],
        "host_in_long_gaps": {
            **{k: round(v, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]},
            "outside any operator or runtime call": round(gap_total - in_ops, 3),
        },
        "step_kinds": {
            kind: {
                "steps": len(rows),
                "cpu_ms_mean": round(statistics.fmean(r[0] for r in rows), 3),
                "gpu_busy_ms_mean": round(statistics.fmean(r[1] for r in rows), 3),
            }
            for kind, rows in sorted(kinds.items())
        },
    }


def _describe(gap: tuple[float, float], origin: float, steps: list[dict], calls: list[dict]) -> dict:
    """One idle gap: where it starts in the window, how long it is, the step it starts in, and the host call
    that overlaps it most (None: the thread was in plain Python, or idle, all along)."""
    step = next((st["name"] for st in steps if st["ts"] <= gap[0] < st["ts"] + st["dur"]), None)
    best = max(calls, key=lambda e: overlap((e["ts"], e["ts"] + e["dur"]), gap), default=None)
    if best is not None and overlap((best["ts"], best["ts"] + best["dur"]), gap) == 0:
        best = None
    return {
        "at_ms": round((gap[0] - origin) / 1e3, 3),
        "ms": round((gap[1] - gap[0]) / 1e3, 3),
        "step": step,
        "host_call": None if best is None else best["name"],
    }


def _outermost(ops: list[dict]) -> list[dict]:
    """The operators not inside another one (same thread): what the thread called, not what they called."""
    out: list[dict] = []
    end = -1.0
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--gap-ms", type=float, default=0.2, help="idle gaps at least this long are attributed")
    ap.add_argument("--top", type=int, default=12, help="names listed for the long gaps")
    ap.add_argument("--json", help="also write the summary here")
    args = ap.parse_args()
    summary = summarize(load(args.trace), args.gap_ms, args.top)
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
