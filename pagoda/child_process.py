"""What every child process Pagoda starts does first: die with its parent.

Used by the launcher's supervisor (engine core, API processes, router workers) and by the engine core
for its tensor-parallel rank processes, so no process outlives the one that started it. Also the environment
of a fresh interpreter Pagoda runs by command line (`package_env`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Linux: `sig` to this process when its parent goes away (even by SIGKILL); exit now if it already has."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent:  # gone before the prctl
        os._exit(1)


def package_env() -> dict[str, str]:
    """This process's environment with the folder that holds the `pagoda` package first on PYTHONPATH: a fresh
    `python -m pagoda...` / `python -c "import pagoda..."` then imports this same Pagoda, even a checkout run in
    place that is not installed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
