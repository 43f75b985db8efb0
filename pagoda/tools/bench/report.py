"""Outputs: the per-point table, the JSON and CSV files, and the sweep plot (matplotlib, optional)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from typing import Any

COLUMNS = [  # (header, key in the point or server_metrics, format)
    ("c", "concurrency", "{}"),
    ("rate/s", "request_rate", "{:g}"),
    ("ok", "completed", "{}"),
    ("fail", "failed", "{}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("in tok", "mean_input_tokens", "{:.0f}"),
    ("p50 TTFT", "median_ttft_ms", "{:.0f}"),
    ("p95 TTFT", "p95_ttft_ms", "{:.0f}"),
    ("srv TTFT", "sm:server_mean_ttft_ms", "{:.0f}"),
    ("p50 TPOT", "median_tpot_ms", "{:.1f}"),
    ("p95 TPOT", "p95_tpot_ms", "{:.1f}"),
    ("p95 ITL", "p95_itl_ms", "{:.1f}"),
    ("p95 E2EL", "p95_e2el_ms", "{:.0f}"),
    ("max conc", "max_concurrent_requests", "{}"),
    ("run pk", "sm:running_peak", "{:.0f}"),
    ("wait pk", "sm:waiting_peak", "{:.0f}"),
    ("KV pk", "sm:kv_cache_usage_peak", "{:.0%}"),
    ("GPU util", "sm:gpu_utilization_mean", "{:.0%}"),
    ("preempt", "sm:preemptions_delta", "{:.0f}"),
    ("host ms/step", "sm:engine_host_ms_per_step", "{:.2f}"),
    ("GPU wait ms/step", "sm:engine_wait_ms_per_step", "{:.2f}"),
    ("core CPU ms/step", "sm:engine_cpu_ms_per_step", "{:.2f}"),
    ("accept len", "sm:spec_acceptance_length", "{:.2f}"),
    ("accept %", "sm:spec_acceptance_rate", "{:.0%}"),
    ("SLO", "slo_pass", "{}"),
]
CSV_SERVER_KEYS = (
    "running_peak",
    "running_mean",
    "waiting_peak",
    "waiting_mean",
    "kv_cache_usage_peak",
    "gpu_utilization_mean",
    "preemptions_delta",
    "generation_tokens_delta",
    "server_mean_ttft_ms",
    "server_mean_queue_ms",
    "engine_host_ms_per_step",
    "engine_wait_ms_per_step",
    "engine_cpu_ms_per_step",
    "spec_acceptance_length",
    "spec_acceptance_rate",
)


def _value(point: dict[str, Any], key: str) -> Any:
    if key == "request_rate" and point.get("mode") != "open":
        return None
    if key.startswith("sm:"):
        return (point.get("server_metrics") or {}).get(key[3:])
    return point.get(key)


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "pass" if value else "FAIL"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def format_table(points: Sequence[dict[str, Any]]) -> str:
    """Latencies in ms; columns with no value in any row are left out."""
    cols = [c for c in COLUMNS if any(_value(p, c[1]) is not None for p in points)]
    rows = [[h for h, _, _ in cols]] + [[_cell(_value(p, k), f) for _, k, f in cols] for p in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_json(path: str, result: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_json_safe(result), f, indent=2)
        f.write("\n")


def write_csv(path: str, points: Sequence[dict[str, Any]]) -> None:
    """One row per point: every scalar vLLM key, plus the main server-metric peaks/deltas."""
    keys: list[str] = []
    for p in points:
        for k, v in p.items():
            if k not in keys and not isinstance(v, (dict, list)):
                keys.append(k)
    header = keys + [f"server_{k}" for k in CSV_SERVER_KEYS]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for p in points:
            sm = p.get("server_metrics") or {}
            writer.writerow([p.get(k) for k in keys] + [sm.get(k) for k in CSV_SERVER_KEYS])


def plot(path: str, points: Sequence[dict[str, Any]], summary: dict[str, Any]) -> str | None:
    """Output throughput, p95 TTFT and p95 TPOT vs concurrency (log2 axis). Returns a message when skipped."""
    try:
        import matplotlib  # lazy: matplotlib, only for --plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: matplotlib, only for --plot
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    pts = sorted(
        (p for p in points if p.get("concurrency") and p.get("mode") != "open"), key=lambda p: p["concurrency"]
    )
    if not pts:
        return "the plot needs closed-loop --concurrency points"
    cs = [p["concurrency"] for p in pts]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series = [
        ("output_throughput", "output throughput (tok/s)"),
        ("p95_ttft_ms", "p95 TTFT (ms)"),
        ("p95_tpot_ms", "p95 TPOT (ms)"),
    ]
    for ax, (key, label) in zip(axes, series):
        ys = [p.get(key) if p.get(key) is not None else float("nan") for p in pts]
        ax.plot(cs, ys, marker="o")
        for c, y, p in zip(cs, ys, pts):
            if not p.get("slo_pass"):
                ax.plot([c], [y], marker="x", color="red", markersize=10)
        if len(set(cs)) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrency")
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
        if summary.get("knee_concurrency"):
            ax.axvline(summary["knee_concurrency"], color="gray", linestyle="--", label="knee")
        if summary.get("recommended_max_num_seqs"):
            ax.axvline(
                summary["recommended_max_num_seqs"], color="green", linestyle=":", label="recommended max-num-seqs"
            )
    slo = summary.get("config", {}).get("slo", {})
    if slo.get("ttft_p95_ms") is not None:
        axes[1].axhline(slo["ttft_p95_ms"], color="red", alpha=0.4, label="SLO")
    if slo.get("tpot_p95_ms") is not None:
        axes[2].axhline(slo["tpot_p95_ms"], color="red", alpha=0.4, label="SLO")
    if axes[1].get_legend_handles_labels()[0]:
        axes[1].legend(fontsize=8)
    fig.suptitle(f"pagoda bench: {summary.get('config', {}).get('model', '')} (red x = fails SLO)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
