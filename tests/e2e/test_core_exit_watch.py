"""The API side notices the engine core's exit at once (the pidfd watch), on a real process that dies; the
rest of the API side's handling of a dead core runs without processes in tests/unit/test_overload_and_death.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from pagoda.engine.async_engine import AsyncEngine, CoreClient
from pagoda.engine.core_process import Ready


def test_the_core_exiting_is_noticed_at_once() -> None:
    async def main() -> None:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            engine = AsyncEngine(None, CoreClient(0, "", "", child.pid, Ready(1, 16, 1.0)))  # type: ignore[arg-type]
            watch = asyncio.create_task(engine._watch_core())
            await asyncio.sleep(0.7)  # past one 0.5 s fallback check
            assert not engine.is_dead
            child.kill()  # a zombie until reaped: kill(pid, 0) still works
            started = time.monotonic()
            await asyncio.wait_for(watch, 2.0)
            assert engine.is_dead and time.monotonic() - started < 0.2
        finally:
            child.kill()
            child.wait()

    asyncio.run(main())
