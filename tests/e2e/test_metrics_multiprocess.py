"""/metrics in prometheus multiprocess mode (several API processes): two real processes write their files,
the second renders both, and every sum shows under both prefixes (one process: tests/unit/test_metrics_prefixes.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.unit.test_metrics_prefixes import M, check_both, samples

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "tests" / "unit"

_MULTIPROCESS = """
import json, os, sys
from pagoda.server.host_metrics import process_collector
from pagoda.server.metrics import ServerMetrics
sys.path.insert(0, {here!r})
from test_metrics_prefixes import feed
processes = process_collector(os.environ["PROMETHEUS_MULTIPROC_DIR"], 2)
metrics = ServerMetrics("m", multiprocess=True, count_engine_totals={first}, process_collector=processes)
feed(metrics)
print(json.dumps([os.getpid(), metrics.render().decode()]))
"""


def test_multiprocess_mode_shows_the_sums_under_both_prefixes(tmp_path: Path) -> None:
    """Two API processes write their files; the second renders both: sums, the same under either prefix."""
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    pages, pids = [], []
    for first in (True, False):
        code = _MULTIPROCESS.format(here=str(UNIT), first=first)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        pid, page = json.loads(out.stdout.strip().splitlines()[-1])
        pages.append(page)
        pids.append(pid)
    theirs = check_both(pages[1])
    assert theirs[("generation_tokens_total", M)] == 4  # both processes' tokens
    assert theirs[("time_to_first_token_seconds_count", M)] == 2
    assert theirs[("engine_steps_total", M)] == 7  # counted by the first only
    assert theirs[("iteration_tokens_total_count", M)] == 1  # the core's steps, too
    found = samples(pages[1])
    http = (("handler", "/v1/completions"), ("method", "POST"), ("status", "2xx"))
    assert found[("http_requests_total", http)] == 2  # summed, unprefixed
    # process_*: one series per live API process, labelled with its pid (the first one has exited).
    memory = {dict(labels).get("pid") for name, labels in found if name == "process_resident_memory_bytes"}
    assert memory == {str(pids[1])}


_FRESH = """
import json
from pagoda.server.metrics import ServerMetrics
print(json.dumps(ServerMetrics("m", multiprocess=True).render().decode()))
"""


def test_the_engine_gauges_are_on_the_page_before_the_first_report(tmp_path: Path) -> None:
    """A scrape between the server's start and the core's first report finds the engine's gauges at 0 (a gauge
    in multiprocess mode is written only once set), so a dashboard shows an idle engine rather than no data."""
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    out = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    found = samples(json.loads(out.stdout.strip().splitlines()[-1]))
    for prefix in ("pagoda", "vllm"):
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert found.get((f"{prefix}:{gauge}", M)) == 0, (prefix, gauge)
        for reason in ("capacity", "deferred"):
            assert found.get((f"{prefix}:num_requests_waiting_by_reason", (*M, ("reason", reason)))) == 0, reason
