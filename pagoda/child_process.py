"""What every child process Pagoda starts does first: die with its parent.

Used by the launcher's supervisor (engine core, API processes, router workers) and by the engine core
for its tensor-parallel rank processes, so no process outlives the one that started it.
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
