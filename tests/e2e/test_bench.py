"""`python -m pagoda bench` against the live session server: JSON shape, metric consistency, failures, open loop.

Workloads are tiny (the default model on a 2-core CPU): 3 requests per point, 16-token prompts, 4 tokens out.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from e2e_helpers import API_KEY, MODEL

TINY = ["--num-prompts", "3", "--input-len", "16", "--output-len", "4", "--ignore-eos", "--no-progress"]
LATENCY_KEYS = [
    f"{stat}_{m}_ms"
    for m in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "std", "p50", "p90", "p95", "p99")
]
THROUGHPUT_KEYS = [
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "completed",
    "failed",
    "max_concurrent_requests",
    "duration",
    "errors",
]


def bench(base_url: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagoda", "bench", "--base-url", base_url, "--api-key", API_KEY, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def ladder(base_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One closed-loop ladder run, shared by the checks below."""
    out = tmp_path_factory.mktemp("bench")
    proc = bench(
        base_url,
        "--concurrency",
        "1,2",
        *TINY,
        "--save-detailed",
        "--out",
        str(out / "r.json"),
        "--csv",
        str(out / "r.csv"),
        "--plot",
        str(out / "sweep.png"),
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return {"proc": proc, "result": json.loads((out / "r.json").read_text()), "dir": out}


def test_ladder_result_keys(ladder: dict) -> None:
    result = ladder["result"]
    assert {
        "config",
        "points",
        "knee_concurrency",
        "max_concurrency_meeting_slo",
        "recommended_max_num_seqs",
        "evidence",
    } <= set(result)
    assert result["config"]["model"] == MODEL  # the first id of GET /v1/models
    assert "api_key" not in json.dumps(result["config"])
    assert [p["concurrency"] for p in result["points"]] == [1, 2]
    for p in result["points"]:
        missing = [k for k in LATENCY_KEYS + THROUGHPUT_KEYS + ["slo_pass", "server_metrics"] if k not in p]
        assert not missing, missing
        assert p["completed"] == 3 and p["failed"] == 0 and p["errors"] == []
        assert p["total_output_tokens"] == 3 * 4  # usage.completion_tokens with ignore_eos
        assert p["output_throughput"] == pytest.approx(p["completed"] * 4 / p["duration"], rel=1e-6)
        assert p["request_throughput"] == pytest.approx(3 / p["duration"], rel=1e-6)
        assert 1 <= p["max_concurrent_requests"] <= p["concurrency"]
        assert p["mean_input_tokens"] >= 16  # measured from usage.prompt_tokens (chat template included)
    text = ladder["proc"].stdout
    assert "p95 TTFT" in text and "recommended --max-num-seqs" in text
    assert (ladder["dir"] / "r.csv").read_text().splitlines()[0].startswith("mode,concurrency")


def test_ladder_timings_follow_the_definitions(ladder: dict) -> None:
    for p in ladder["result"]["points"]:
        reqs = p["requests"]
        assert len(reqs) == 3 and all(r["success"] for r in reqs)
        for r in reqs:
            assert 0 < r["ttft"] <= r["e2el"]
            assert r["completion_tokens"] == 4 and len(r["itl"]) == r["chunks"] - 1
        tpots = [(r["e2el"] - r["ttft"]) / (r["completion_tokens"] - 1) * 1000 for r in reqs]
        assert p["mean_tpot_ms"] == pytest.approx(sum(tpots) / 3, rel=1e-9)
        itls = sorted(g * 1000 for r in reqs for g in r["itl"])
        assert p["mean_itl_ms"] == pytest.approx(sum(itls) / len(itls), rel=1e-9)
        assert p["mean_ttft_ms"] <= p["mean_e2el_ms"]
        assert p["p50_ttft_ms"] == p["median_ttft_ms"]


def test_ladder_server_metrics(ladder: dict) -> None:
    for p in ladder["result"]["points"]:
        sm = p["server_metrics"]
        assert sm["available"] and sm["prefix"] == "pagoda" and sm["samples"] >= 1
        assert sm["generation_tokens_delta"] >= 12 and sm["preemptions_delta"] == 0
        # Gauges are sampled every 0.5 s, so a point this short may catch the server idle.
        assert 0 <= sm["running_peak"] <= p["concurrency"] and sm["waiting_peak"] == 0
        assert 0 <= sm["kv_cache_usage_peak"] <= 1


def test_plot_png(ladder: dict) -> None:
    png = ladder["dir"] / "sweep.png"
    if importlib.util.find_spec("matplotlib") is None:
        assert "plot skipped" in ladder["proc"].stdout and not png.exists()
        return
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wrong_model_counts_failures(base_url: str, tmp_path: Path) -> None:
    proc = bench(base_url, "--model", "wrong-name", "--concurrency", "2", *TINY, "--out", str(tmp_path / "r.json"))
    assert proc.returncode == 1, proc.stderr  # every request failed: still a report, no traceback
    assert "Traceback" not in proc.stderr
    point = json.loads((tmp_path / "r.json").read_text())["points"][0]
    assert point["failed"] == 3 and point["completed"] == 0 and not point["slo_pass"]
    assert point["error_counts"] == {"404": 3}
    assert any("wrong-name" in e and "404" in e for e in point["errors"])
    assert point["mean_ttft_ms"] is None


def test_open_loop_completions(base_url: str, tmp_path: Path) -> None:
    proc = bench(
        base_url,
        "--endpoint",
        "completions",
        "--request-rate",
        "20",
        "--burstiness",
        "0.5",
        "--concurrency",
        "2",
        "--warmup",
        "0",
        "--no-calibrate",
        *TINY,
        "--out",
        str(tmp_path / "r.json"),
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    (point,) = result["points"]
    assert point["mode"] == "open" and point["request_rate"] == 20 and point["burstiness"] == 0.5
    assert point["completed"] == 3 and point["total_output_tokens"] == 12
    assert point["max_concurrent_requests"] <= 2
    assert point["p95_client_queue_ms"] >= 0
    assert result["recommended_max_num_seqs"] is None  # needs a closed-loop ladder


def test_several_client_processes(base_url: str, tmp_path: Path) -> None:
    """Two client processes share a point: every request is counted once, the cap is split (1 + 1),
    and the timings are those of the requests (not of process start-up)."""
    proc = bench(
        base_url,
        "--concurrency",
        "2",
        "--client-processes",
        "2",
        "--prompts-per-concurrency",
        "2",
        "--warmup",
        "2",
        *TINY[2:],
        "--save-detailed",
        "--out",
        str(tmp_path / "r.json"),
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    (point,) = json.loads((tmp_path / "r.json").read_text())["points"]
    assert point["client_processes"] == 2 and point["num_prompts"] == 8
    assert point["completed"] == 8 and point["total_output_tokens"] == 32 and point["failed"] == 0
    assert point["max_concurrent_requests"] <= 2
    starts = sorted(r["start"] for r in point["requests"])
    ends = sorted(r["end"] for r in point["requests"])
    assert point["duration"] == pytest.approx(ends[-1] - starts[0], abs=0.05)
    assert 0 < point["median_ttft_ms"] <= point["median_e2el_ms"]


def test_not_ready_is_one_line_error() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = bench(f"http://127.0.0.1:{port}", "--ready-timeout", "1", "--concurrency", "1", *TINY)
    assert proc.returncode == 2 and "not ready" in proc.stderr and "Traceback" not in proc.stderr
