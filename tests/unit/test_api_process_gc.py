"""`serving_gc.prepare_gc_for_serving`: the startup heap is frozen and the young generation's threshold raised
(checked in a fresh interpreter: both are process-wide)."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import gc
from pagoda.serving_gc import GEN0_THRESHOLD, prepare_gc_for_serving
before = gc.get_threshold()
prepare_gc_for_serving()
after = gc.get_threshold()
assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()
assert after == (GEN0_THRESHOLD, *before[1:]), (before, after)
assert GEN0_THRESHOLD > before[0]
"""


def test_prepare_gc_for_serving_freezes_and_raises_gen0_threshold() -> None:
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
