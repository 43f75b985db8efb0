"""`pagoda serve`'s launcher supervises from a fresh image once its checks pass (`pagoda/launch/supervise.py`):
the process the user started keeps its PID and shows its arguments, and the checks' libraries (the tokenizer,
transformers) are left behind in the image it replaced, while the API process that serves still has them."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
import pytest
from e2e_server import BASE_FLAGS

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps")


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_the_launcher_keeps_its_pid_and_arguments_and_leaves_the_checks_libraries_behind(server):
    launcher = psutil.Process(server.proc.pid)  # the PID the test started: the exec keeps it
    cmd = launcher.cmdline()
    assert cmd[1:3] == ["-m", "pagoda.launch.supervise"], cmd
    # the command as typed follows "--", so `pkill -f "pagoda serve"` still finds the launcher
    assert cmd[cmd.index("--") + 1 :] == ["pagoda", "serve", *BASE_FLAGS, "--port", str(server.port)]
    assert "tokenizers" not in _maps(launcher.pid)  # the Rust tokenizer library the checks loaded
    (api,) = server.api_pids()
    assert "tokenizers" in _maps(api)  # ... which the API process, that tokenizes, does map
    assert server.engine_pid() in [c.pid for c in launcher.children()]
