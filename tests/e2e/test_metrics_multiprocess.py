"""/metrics in prometheus multiprocess mode (several API processes): two real processes write their files,
the second renders both, and every sum shows under both prefixes (one process: tests/unit/test_metrics_prefixes.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.unit.test_metrics_prefixes import check_both

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "tests" / "unit"

_MULTIPROCESS = """
import json, sys
from pagoda.server.metrics import ServerMetrics
sys.path.insert(0, {here!r})
from test_metrics_prefixes import feed
metrics = ServerMetrics("m", multiprocess=True, count_engine_totals={first})
feed(metrics)
print(json.dumps(metrics.render().decode()))
"""


def test_multiprocess_mode_shows_the_sums_under_both_prefixes(tmp_path: Path) -> None:
    """Two API processes write their files; the second renders both: sums, the same under either prefix."""
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    pages = []
    for first in (True, False):
        code = _MULTIPROCESS.format(here=str(UNIT), first=first)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        pages.append(json.loads(out.stdout.strip().splitlines()[-1]))
    theirs = check_both(pages[1])
    assert theirs[("generation_tokens_total", (("model_name", "m"),))] == 4  # both processes' tokens
    assert theirs[("time_to_first_token_seconds_count", (("model_name", "m"),))] == 2
    assert theirs[("engine_steps_total", (("model_name", "m"),))] == 7  # counted by the first only
