"""`benchmarks/vs_vllm.py`'s pooling of vLLM-client records and its ratio table, on synthetic per-request records
whose figures are worked out by hand here (no vLLM, no server)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vs_vllm  # noqa: E402  (a benchmark script, imported for its pure functions)


def _records(ttft: float, gap: float, starts: list[float], tokens: int = 5) -> dict:
    """Client records of requests that each wait `ttft`, then stream tokens `gap` seconds apart."""
    n = len(starts)
    return {
        "start_times": starts,
        "ttfts": [ttft] * n,
        "itls": [[gap] * (tokens - 1)] * n,
        "output_lens": [tokens] * n,
        "failed": 0,
        "errors": [],
    }


def test_pool_takes_vllms_definitions_over_every_client_process():
    # Two client processes, two requests each, 5 tokens: TTFT 0.1 s, then 4 gaps of 0.02 s -> E2E 0.18 s.
    row = vs_vllm.pool([_records(0.1, 0.02, [0.0, 0.5]), _records(0.1, 0.02, [0.2, 1.0])])
    assert row["completed"] == 4 and row["failed"] == 0
    assert row["duration_s"] == pytest.approx(1.18)  # first start 0.0, last end 1.0 + 0.18
    assert row["request_throughput"] == pytest.approx(4 / 1.18, abs=1e-3)
    assert row["output_throughput"] == pytest.approx(20 / 1.18, abs=0.1)
    assert row["median_ttft_ms"] == pytest.approx(100.0)
    assert row["median_tpot_ms"] == pytest.approx(20.0) and row["median_itl_ms"] == pytest.approx(20.0)
    assert row["median_e2el_ms"] == pytest.approx(180.0)


def test_pool_keeps_p99_where_rare_stalls_show():
    """Two stalls among 100 gaps lie past the 95th percentile and at the 99th."""
    records = _records(0.1, 0.002, [0.0], tokens=101)
    records["itls"] = [[0.002] * 98 + [0.1, 0.1]]
    row = vs_vllm.pool([records])
    assert row["p95_itl_ms"] == pytest.approx(2.0) and row["p99_itl_ms"] == pytest.approx(100.0)


def test_pool_names_the_slowest_first_tokens_by_arrival_place_across_client_processes():
    # Two processes whose requests interleave in time: arrival order is 0.0, 0.1, 0.2, 0.3, 0.4.
    a, b = _records(0.1, 0.02, [0.0, 0.2, 0.4]), _records(0.1, 0.02, [0.1, 0.3])
    a["ttfts"] = [0.5, 0.1, 0.05]  # the first request sent waited 500 ms
    b["ttfts"] = [0.09, 0.3]  # the fourth 300 ms
    row = vs_vllm.pool([a, b])
    assert row["slowest_ttft"] == [[0, 500.0], [3, 300.0], [2, 100.0]]


def test_the_ratio_table_pairs_each_pagoda_row_with_vllms_and_shows_every_latency():
    base = {"client": "vllm", "concurrency": 16, "point": "c16"}
    pagoda = {"workload": "text", "system": "pagoda", **base, "output_throughput": 300.0}
    vllm = {"workload": "text", "system": "vllm", **base, "output_throughput": 200.0}
    for i, key in enumerate(["median_ttft_ms", "p95_ttft_ms", "median_tpot_ms", "p95_tpot_ms", "median_itl_ms"]):
        pagoda[key], vllm[key] = 10.0 + i, 20.0 + i
    pagoda["p95_itl_ms"], vllm["p95_itl_ms"] = 7.0, 8.0
    pagoda["median_e2el_ms"], vllm["median_e2el_ms"] = 900.0, 1200.0
    ours = {**pagoda, "client": "pagoda", "output_throughput": 1.0}  # `pagoda bench`'s row: not in the table
    table = vs_vllm.ratio_table([pagoda, vllm, ours]).splitlines()
    header, _, line = table
    assert [c.strip() for c in header.strip("|").split("|")][4:] == [
        f"{x} P / V ms" for x in ("TTFT p50", "TTFT p95", "TPOT p50", "TPOT p95", "ITL p50", "ITL p95", "E2E p50")
    ] + ["GPU busy % P / V"]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:4] == ["text", "c16", "300.0 / 200.0", "1.50x"]
    assert cells[4:] == [
        "10.0 / 20.0",
        "11.0 / 21.0",
        "12.0 / 22.0",
        "13.0 / 23.0",
        "14.0 / 24.0",
        "7.0 / 8.0",
        "900.0 / 1200.0",
        "—",  # neither row measured the GPU
    ]


def test_gpu_busy_averages_the_samples_inside_the_points_span():
    """`GpuBusy` reads the utilisation every period (here a fake reader answering 10, 20, 30, ...): the mean over a
    span is the mean of the answers read inside it, and a reader that cannot answer leaves it None."""
    answers = iter(range(10, 10_000, 10))
    with vs_vllm.GpuBusy(period=0.001, read=lambda: float(next(answers))) as busy:
        while len(busy.samples) < 6:
            time.sleep(0.001)
    values = [u for _, u in busy.samples]
    assert values[:6] == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    assert busy.mean(None) == pytest.approx(sum(values) / len(values), abs=0.05)
    inner = (busy.samples[1][0], busy.samples[3][0])  # the 2nd to the 4th sample's times
    assert busy.mean(inner) == 30.0
    assert busy.mean((0.0, 1.0)) is None  # long before any sample

    def absent() -> float:
        raise OSError("no nvidia-smi")

    with vs_vllm.GpuBusy(period=0.001, read=absent) as none:
        pass
    assert none.mean(None) is None and not none.samples


def _page(steps: int, busy: float, wait: float, cpu: float) -> str:
    """A Pagoda /metrics page's engine counters (each family under both prefixes, as the server shows them)."""
    lines = []
    for prefix in ("vllm", "pagoda"):
        for name, value in (
            ("engine_steps_total", steps),
            ("engine_core_busy_seconds_total", busy),
            ("engine_core_device_wait_seconds_total", wait),
            ("engine_core_cpu_seconds_total", cpu),
        ):
            lines.append(f'{prefix}:{name}{{model_name="m",engine="0"}} {value}')
    return "\n".join(lines) + "\n"


def test_engine_split_gives_the_cores_host_and_wait_time_per_step_over_the_point():
    """Counters read before and after a point of 10 s: 400 steps, 9 s busy of which 6 s waiting for the GPU, 1 s of
    the loop thread's CPU -> 7.5 ms host, 15 ms wait and 2.5 ms CPU per step, busy 90 % of the span; vLLM's page (no
    engine counters) adds nothing."""
    before = vs_vllm.parse_prometheus(_page(100, 2.0, 1.0, 0.5))
    after = vs_vllm.parse_prometheus(_page(500, 11.0, 7.0, 1.5))
    split = vs_vllm.engine_split(before, after, (50.0, 60.0))
    assert split == {
        "engine_host_ms_per_step": 7.5,
        "engine_wait_ms_per_step": 15.0,
        "engine_cpu_ms_per_step": 2.5,
        "engine_steps": 400,
        "engine_busy_pct": 90.0,
    }
    vllm_page = 'vllm:num_requests_running{model_name="m"} 3\n'
    assert vs_vllm.engine_split(vs_vllm.parse_prometheus(vllm_page), vs_vllm.parse_prometheus(vllm_page), None) == {}
    assert vs_vllm.engine_split(None, None, (0.0, 1.0)) == {}


def test_a_terminated_run_unwinds_through_its_finally_blocks():
    # `timeout` ends a run with SIGTERM; the default action would skip the `finally` that stops the server.
    import os
    import signal

    previous = signal.getsignal(signal.SIGTERM)
    stopped = []
    try:
        vs_vllm.exit_on_sigterm()
        with pytest.raises(SystemExit) as exit_info:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler runs at the next bytecode; never reached
            finally:
                stopped.append(True)
        assert exit_info.value.code == 128 + signal.SIGTERM
        assert stopped == [True]
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Proc:
    """What `server_gone` reads of a server's Popen: `poll()` (None while it runs) and `returncode`."""

    def __init__(self, returncode: int | None):
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


def test_a_server_that_exited_is_named_with_its_last_error(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO pagoda: Serving\nRuntimeError: Offset increment outside graph capture\nshutting down\n")
    assert vs_vllm.server_gone(_Proc(None), log) is None
    assert vs_vllm.server_gone(_Proc(3), log) == "exit code 3: RuntimeError: Offset increment outside graph capture"
    assert vs_vllm.server_gone(_Proc(1), tmp_path / "missing.log") == "exit code 1: "
