"""Sweep analysis over the concurrency ladder: knee, SLO, `--max-num-seqs` recommendation and its evidence.

Knee rule (a simple one, simpler than Kneedle's curve fit): walking up the ladder, the knee is the first c
where going to the next rung adds less than 10 % output throughput *per doubling of c*. Rungs need not be
powers of two: the gain between c0 and c1 is normalised as (T1/T0) ** (1 / log2(c1/c0)) - 1, so 32 -> 128
must add < 21 % (two doublings) to count. No such c: no knee observed (throughput still scaling).

Recommendation: min(knee, largest c meeting the SLO), rounded up to a multiple of 8; with no knee the
largest passing c alone; with no passing c, none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from pagoda.tools.bench.metrics import SLO

KNEE_MIN_GAIN = 0.10
TPOT_FLAT = 0.15  # relative change in median TPOT under which TPOT counts as flat
CLIENT_CPU_BUSY = 80.0  # % of one core used by the (single-process) client during a point


def gain_per_doubling(c0: float, t0: float, c1: float, t1: float) -> float | None:
    """Relative throughput gain per doubling of concurrency between two rungs (None when undefined)."""
    if c1 <= c0 or c0 <= 0 or t0 <= 0:
        return None
    if t1 <= 0:
        return -1.0
    return (t1 / t0) ** (1.0 / math.log2(c1 / c0)) - 1.0


def find_knee(
    concurrencies: Sequence[int], throughputs: Sequence[float], min_gain: float = KNEE_MIN_GAIN
) -> int | None:
    """The first c whose next rung adds < `min_gain` throughput per doubling; None if it never flattens."""
    pts = sorted(zip(concurrencies, throughputs))
    for (c0, t0), (c1, t1) in pairwise(pts):
        gain = gain_per_doubling(c0, t0, c1, t1)
        if gain is not None and gain < min_gain:
            return int(c0)
    return None


def max_passing(points: Sequence[dict[str, Any]]) -> int | None:
    passing = [p["concurrency"] for p in points if p.get("slo_pass") and p.get("concurrency")]
    return max(passing) if passing else None


def round_up8(value: int) -> int:
    return max(8, math.ceil(value / 8.0) * 8)


def recommend(knee: int | None, largest_passing: int | None) -> int | None:
    if largest_passing is None:
        return None
    return round_up8(min(knee, largest_passing) if knee is not None else largest_passing)


def _where(p: dict[str, Any]) -> str:
    return f"c={p.get('concurrency')}" if p.get("mode") != "open" else f"rate {p.get('request_rate')}/s"


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "n/a"
    return f"{v:.0f}{unit}" if float(v).is_integer() else f"{v:.1f}{unit}"


def analyze(points: Sequence[dict[str, Any]], slo: SLO) -> dict[str, Any]:
    """knee_concurrency, max_concurrency_meeting_slo, recommended_max_num_seqs and the evidence lines."""
    ladder = sorted(
        (p for p in points if p.get("concurrency") and p.get("mode") != "open"), key=lambda p: p["concurrency"]
    )
    evidence: list[str] = []
    for p in points:
        cpu = p.get("client_cpu_percent")
        if cpu is not None and cpu >= CLIENT_CPU_BUSY:
            evidence.append(
                f"client CPU {cpu:.0f}% of one core at {_where(p)}: the load generator itself may be the "
                f"bottleneck there (its latencies include client delay)"
            )
    if not ladder:
        for p in points:
            evidence.append(
                f"open-loop point (rate {p.get('request_rate')}/s, cap {p.get('concurrency')}): SLO "
                f"{'pass' if p.get('slo_pass') else 'FAIL'}"
            )
        evidence.append(
            "knee, largest passing concurrency and the max-num-seqs recommendation need a closed-loop "
            "--concurrency ladder"
        )
        return {
            "knee_concurrency": None,
            "max_concurrency_meeting_slo": None,
            "recommended_max_num_seqs": None,
            "evidence": evidence,
        }
    cs = [p["concurrency"] for p in ladder]
    ts = [p["output_throughput"] for p in ladder]
    knee = find_knee(cs, ts) if len(ladder) >= 2 else None

    # Throughput curve.
    for a, b in pairwise(ladder):
        gain = gain_per_doubling(a["concurrency"], a["output_throughput"], b["concurrency"], b["output_throughput"])
        if a["concurrency"] == knee and gain is not None:
            evidence.append(
                f"knee at c={knee}: output throughput {a['output_throughput']:.1f} -> "
                f"{b['output_throughput']:.1f} tok/s from c={a['concurrency']} to c={b['concurrency']} "
                f"is {gain * 100:+.1f}% per doubling (< {KNEE_MIN_GAIN * 100:.0f}%)"
            )
    if len(ladder) >= 2 and knee is None:
        a, b = ladder[-2], ladder[-1]
        gain = gain_per_doubling(a["concurrency"], a["output_throughput"], b["concurrency"], b["output_throughput"])
        evidence.append(
            f"no knee: throughput still grows {_fmt(None if gain is None else gain * 100, '%')} per "
            f"doubling at c={b['concurrency']}; extend the ladder to find the plateau"
        )
    elif len(ladder) < 2:
        evidence.append("knee needs at least two concurrency points")

    # SLO.
    limits = [
        f"p95 TTFT <= {slo.ttft_p95_ms:g} ms" if slo.ttft_p95_ms is not None else None,
        f"p95 TPOT <= {slo.tpot_p95_ms:g} ms" if slo.tpot_p95_ms is not None else None,
        f"error rate <= {slo.max_error_rate * 100:g}%",
    ]
    slo_text = ", ".join(x for x in limits if x)
    best = max_passing(ladder)
    failing = [p for p in ladder if not p.get("slo_pass")]
    if best is None:
        evidence.append(f"no point meets the SLO ({slo_text})")
    else:
        evidence.append(f"largest c meeting the SLO ({slo_text}): c={best}")
    for p in failing:
        why = []
        if not p.get("completed"):
            why.append("no request completed")
        if p.get("error_rate", 0) > slo.max_error_rate:
            why.append(f"error rate {p['error_rate'] * 100:.1f}%")
        if slo.ttft_p95_ms is not None and (p.get("p95_ttft_ms") or 0) > slo.ttft_p95_ms:
            why.append(f"p95 TTFT {_fmt(p.get('p95_ttft_ms'), ' ms')}")
        if slo.tpot_p95_ms is not None and (p.get("p95_tpot_ms") or 0) > slo.tpot_p95_ms:
            why.append(f"p95 TPOT {_fmt(p.get('p95_tpot_ms'), ' ms')}")
        evidence.append(f"c={p['concurrency']} fails the SLO: " + ", ".join(why or ["see point"]))

    # Server-side queueing and KV pressure, from /metrics.
    have_server = [p for p in ladder if (p.get("server_metrics") or {}).get("available")]
    if ladder and not have_server:
        evidence.append("server /metrics not available: no queue/KV evidence (only client-side numbers)")
    prev = None
    for p in have_server:
        sm = p["server_metrics"]
        waiting, running = sm.get("waiting_peak") or 0, sm.get("running_peak")
        kv, pre = sm.get("kv_cache_usage_peak"), sm.get("preemptions_delta") or 0
        if pre > 0:
            evidence.append(
                f"c={p['concurrency']}: {pre:.0f} preemptions, KV cache peak {_fmt((kv or 0) * 100, '%')}"
                f": the KV cache, not max-num-seqs, limits the batch here"
            )
        elif waiting > 0 and running is not None and running >= p["concurrency"]:
            # Every request sent ran at once at some point: the waiting ones only waited for the next step
            # (a new request joins the batch between steps), so no cap of the server binds here.
            evidence.append(
                f"c={p['concurrency']}: up to {waiting:.0f} requests waited between steps, but all "
                f"{p['concurrency']} ran at once (running peak {_fmt(running, '')}): no batch cap binds"
            )
        elif waiting > 0:
            tpot_now, tpot_prev = p.get("median_tpot_ms"), (prev or {}).get("median_tpot_ms")
            flat = bool(tpot_now is not None and tpot_prev and abs(tpot_now / tpot_prev - 1) < TPOT_FLAT)
            msg = (
                f"c={p['concurrency']}: up to {waiting:.0f} requests waiting while at most {_fmt(running, '')} ran "
                f"(KV cache peak {_fmt(None if kv is None else kv * 100, '%')})"
            )
            if kv is not None and kv >= 0.9:
                msg += ": the KV cache is nearly full, so the batch is KV-bound"
            else:
                msg += f": the server's batch cap binds (max-num-seqs ~{_fmt(running, '')})"
                if flat:
                    msg += (
                        f"; median TPOT flat ({tpot_prev:.1f} -> {tpot_now:.1f} ms), so the hardware is not "
                        f"saturated and the extra requests only queue"
                    )
            evidence.append(msg)
        prev = p

    rec = recommend(knee, best)
    if rec is not None:
        basis = (
            f"min(knee {knee}, largest passing c {best})"
            if knee is not None
            else f"largest passing c {best} (no knee observed)"
        )
        evidence.append(f"recommended --max-num-seqs {rec} = {basis}, rounded up to a multiple of 8")
    return {
        "knee_concurrency": knee,
        "max_concurrency_meeting_slo": best,
        "recommended_max_num_seqs": rec,
        "evidence": evidence,
    }
