"""End-to-end fixtures: the real `python -m pagoda serve` in a subprocess, spoken to over HTTP.

One server (`server`) is shared by the whole session; a test that must end a server (SIGTERM) starts
its own with `launch_server`. The one test that kills the shared server's engine process is marked
`kills_engine` and always runs last. Each start costs ~20 s on a 2-core CPU, so keep it to these.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # e2e_helpers, whatever pytest's import mode

from e2e_helpers import API_KEY, MODEL  # noqa: E402

STARTUP_TIMEOUT_S = 120.0
BASE_FLAGS = ["--served-model-name", MODEL, "--max-model-len", "2048", "--cpu-kv-cache-space-gib", "0.25",
              "--host", "127.0.0.1", "--api-key", API_KEY, "--max-waiting-requests", "64",
              "--disable-log-requests", "--enable-chunked-prefill", "--swap-space", "4"]  # vLLM-era flags too


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A `pagoda serve` subprocess in its own session (so the engine child can be cleaned up with it)."""

    def __init__(self, log_path: Path, extra_flags: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "pagoda", "serve", *BASE_FLAGS, "--port", str(self.port), *extra_flags]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagoda serve exited with {self.proc.returncode} during startup:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"pagoda serve not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def engine_pid(self) -> int:
        """The engine core: the server's child process that is not multiprocessing's resource tracker."""
        try:
            import psutil

            children = [(c.pid, " ".join(c.cmdline())) for c in psutil.Process(self.proc.pid).children()]
        except ImportError:
            out = subprocess.run(["pgrep", "-a", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
            children = [(int(line.split(" ", 1)[0]), line) for line in out.splitlines() if line.strip()]
        engines = [pid for pid, cmd in children if "resource_tracker" not in cmd]
        assert len(engines) == 1, f"expected one engine child of {self.proc.pid}, found {children}"
        return engines[0]

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left of the session (the engine child if the server died hard): kill it.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._log.close()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kills_engine: kills the shared server's engine; runs after all other tests")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("kills_engine") is not None)  # stable: others keep order


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("server") / "serve.log", [])
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def base_url(server: ServerProcess) -> str:
    return server.url


@pytest.fixture
def launch_server(tmp_path: Path) -> Iterator:
    """Start an extra, short-lived server with more flags; it is stopped at the end of the test."""
    started: list[ServerProcess] = []

    def launch(*extra_flags: str) -> ServerProcess:
        proc = ServerProcess(tmp_path / f"serve-{len(started)}.log", list(extra_flags))
        started.append(proc)
        proc.wait_healthy()
        return proc

    yield launch
    for proc in started:
        proc.stop()


@pytest.fixture(scope="session")
def http(base_url: str) -> Iterator[httpx.Client]:
    """Raw HTTP client with the API key."""
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def anon(base_url: str) -> Iterator[httpx.Client]:
    """Raw HTTP client without any key."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client
