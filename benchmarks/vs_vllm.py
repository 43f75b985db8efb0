"""Pagoda against vLLM, both measured by vLLM's own `bench serve` client on one GPU in one lease: the
rows of the side-by-side runs collected into `benchmarks/results/vs_vllm.json` and one ratio table.

    python benchmarks/vs_vllm.py collect RUN_DIR [RUN_DIR ...] [--out benchmarks/results/vs_vllm.json]
        [--gpu "NVIDIA H200"] [--commit SHA]

A RUN_DIR holds what the side-by-side scripts wrote on the device for each server (benchmarks/README.md,
"Against vLLM"): `sbs_<system>.jsonl` (text, pooled over client processes: one row per step `c1`, `c64`,
`c256`, ...) and `mm_<system>.jsonl` (Qwen2-VL-2B images through the chat API, one row per concurrency).
Both systems must come from the same lease: ratios across leases are not comparable.

The JSON is {"gpu", "commit", "date", "rows": [...]}, one row per workload x system x client x concurrency,
with vLLM's key names (`output_throughput`, `request_throughput`, `median_ttft_ms`, `p95_ttft_ms`,
`median_tpot_ms`, `p95_tpot_ms`, `median_itl_ms`, `p95_itl_ms`; None where the run did not measure one).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

from quantization_sbs import KEYS as POOLED_NAMES  # the pooled client's names -> vLLM's (this folder's script)

KEYS = (
    "output_throughput",
    "request_throughput",
    "median_ttft_ms",
    "p95_ttft_ms",
    "median_tpot_ms",
    "p95_tpot_ms",
    "median_itl_ms",
    "p95_itl_ms",
)


def _value(row: dict, key: str) -> float | None:
    """`key` (vLLM's name) of a row that may spell it as the pooled client does (p50_*: quantization_sbs.KEYS)."""
    for name in (key, *(old for old, new in POOLED_NAMES.items() if new == key)):
        if row.get(name) is not None:
            return float(row[name])
    return None


def text_rows(path: Path, system: str) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        step = r.get("step", "")
        if not step.startswith("c") or "concurrency" not in r:
            continue  # the ready line, warm-up, failed steps
        row = {"workload": "text", "system": system, "client": "vllm", "concurrency": int(r["concurrency"])}
        row.update({k: _value(r, k) for k in KEYS})
        row["output_throughput"] = r.get("steady_throughput") or r.get("span_throughput")
        row["request_throughput"] = None
        rows.append(row)
    return rows


def image_rows(path: Path, system: str) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("c") in (None, "warm") or "request_throughput" not in r:
            continue
        row = {"workload": "image-qwen2-vl-2b", "system": system, "client": "vllm", "concurrency": int(r["c"])}
        row.update({k: _value(r, k) for k in KEYS})
        rows.append(row)
    return rows


def collect(dirs: list[Path]) -> list[dict]:
    rows: list[dict] = []
    for d in dirs:
        for path in sorted(d.glob("sbs_*.jsonl")):
            rows += text_rows(path, path.stem.removeprefix("sbs_"))
        for path in sorted(d.glob("mm_*.jsonl")):
            rows += image_rows(path, path.stem.removeprefix("mm_"))
    return rows


def ratio_table(rows: list[dict]) -> str:
    """Markdown: Pagoda / vLLM per workload and concurrency, where both were measured."""
    by = {(r["workload"], r["system"], r["concurrency"]): r for r in rows}
    lines = [
        "| workload | c | throughput P / V | ratio | TTFT p50 P / V ms | TTFT p95 P / V ms "
        "| TPOT p95 P / V ms | ITL p95 P / V ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def pair(p: dict, v: dict, key: str) -> str:
        a, b = p.get(key), v.get(key)
        return "—" if a is None or b is None else f"{a:.1f} / {b:.1f}"

    for workload, system, c in sorted(by):
        if system != "pagoda" or (workload, "vllm", c) not in by:
            continue
        p, v = by[(workload, "pagoda", c)], by[(workload, "vllm", c)]
        key = "request_throughput" if workload.startswith("image") else "output_throughput"
        ratio = p[key] / v[key] if p.get(key) and v.get(key) else float("nan")
        lines.append(
            f"| {workload} | {c} | {pair(p, v, key)} | {ratio:.2f}x | {pair(p, v, 'median_ttft_ms')} | "
            f"{pair(p, v, 'p95_ttft_ms')} | {pair(p, v, 'p95_tpot_ms')} | {pair(p, v, 'p95_itl_ms')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="side-by-side run folders -> vs_vllm.json and a ratio table")
    c.add_argument("dirs", nargs="+", type=Path)
    c.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "vs_vllm.json")
    c.add_argument("--gpu", default="NVIDIA H200")
    c.add_argument("--commit", default=None, help="the commit measured (default: HEAD)")
    args = parser.parse_args()
    commit = (
        args.commit
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    )
    rows = collect(args.dirs)
    result = {"gpu": args.gpu, "commit": commit, "date": datetime.date.today().isoformat(), "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(ratio_table(rows))
    print(f"\n{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
