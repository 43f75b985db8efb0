"""A window of the served engine core's steps under torch.profiler (`PAGODA_CORE_TRACE`), for diagnostics.

`PAGODA_CORE_TRACE=PATH[,SKIP[,STEPS]]` records STEPS (default 200) passes of the core's loop that ran an engine
step, after skipping the first SKIP (default 300) such passes, with CPU and (where there is one) CUDA activity,
and writes a Chrome trace to PATH (gzip when PATH ends in .gz) as the window closes. Each pass is one
`ProfilerStep#N` range on the core's thread, so a GPU idle gap can be read against what the host was doing:
`benchmarks/profile/core_trace_summary.py PATH` summarises a trace. Outside the window the profiler costs
nothing; inside it every launch is slower, so read the window's shape, not its speed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pagoda.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_SKIP = 300
DEFAULT_STEPS = 200


@dataclass(frozen=True)
class TraceWindow:
    path: str
    skip: int = DEFAULT_SKIP
    steps: int = DEFAULT_STEPS

    @classmethod
    def parse(cls, spec: str) -> TraceWindow:
        path, *counts = spec.split(",")
        if not path or len(counts) > 2:
            raise ConfigError(f"PAGODA_CORE_TRACE={spec!r}: expected PATH[,SKIP[,STEPS]]")
        try:
            numbers = [int(c) for c in counts]
        except ValueError:
            raise ConfigError(f"PAGODA_CORE_TRACE={spec!r}: SKIP and STEPS are whole numbers") from None
        window = cls(path, *numbers)
        if window.skip < 0 or window.steps < 1:
            raise ConfigError(f"PAGODA_CORE_TRACE={spec!r}: SKIP must be >= 0 and STEPS >= 1")
        return window


@contextlib.contextmanager
def traced(spec: str | None) -> Iterator[Callable[[], None] | None]:
    """Yields the callable the loop calls after each engine step (None when `spec` is unset); the profiler
    records the window `spec` names and writes it when the window closes or the block ends, whichever is first."""
    if not spec:
        yield None
        return
    import torch

    window = TraceWindow.parse(spec)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    written = False

    def write(prof: torch.profiler.profile) -> None:
        nonlocal written
        try:
            prof.export_chrome_trace(window.path)
            logger.info("engine core trace (%d steps) written to %s", window.steps, window.path)
        except OSError as exc:
            logger.warning("PAGODA_CORE_TRACE: could not write %s: %s", window.path, exc)
        written = True

    # A one-step warm-up window: the profiler's first step carries its own start-up cost.
    schedule = torch.profiler.schedule(wait=max(0, window.skip - 1), warmup=1, active=window.steps, repeat=1)
    prof = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=write)
    prof.start()
    try:
        yield prof.step
    finally:
        if not written:  # the server stopped inside the window: keep what it recorded
            prof.stop()
