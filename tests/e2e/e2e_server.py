"""The real `python -m pagoda serve` as a subprocess, for end-to-end tests (importable by test modules
as `from e2e_server import ServerProcess`; `conftest` is not a unique module name across test folders)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from e2e_helpers import API_KEY, MODEL  # noqa: F401

STARTUP_TIMEOUT_S = 300.0  # a limit for a hung start, not a speed check: a loaded 2-core machine needs >120 s
BASE_FLAGS = [
    "--served-model-name",
    MODEL,
    "--max-model-len",
    "2048",
    "--cpu-kv-cache-space-gib",
    "0.25",
    "--host",
    "127.0.0.1",
    "--api-key",
    API_KEY,
    "--max-waiting-requests",
    "64",
    "--disable-log-requests",
    "--enable-chunked-prefill",
    "--swap-space",
    "0",
]  # vLLM-era flags too


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_in(ports: range) -> int:
    """The first port of `ports` free now: a module that owns a range of ports hands `ServerProcess` this (through
    `free_port`) so its servers never take another module's."""
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"ports {ports.start}-{ports.stop - 1} are all taken")


class ServerProcess:
    """A `pagoda serve` subprocess in its own session (so the engine child can be cleaned up with it)."""

    def __init__(
        self,
        log_path: Path,
        extra_flags: list[str],
        env: dict[str, str] | None = None,
        base_flags: list[str] | None = None,
    ):
        """`base_flags`: what comes between `serve` and `--port` (default BASE_FLAGS; [] for a bare `pagoda serve`)."""
        self.log_path = log_path
        self._base = BASE_FLAGS if base_flags is None else base_flags
        self._extra, self._env = extra_flags, env
        self._port_retries = 2
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "pagoda", "serve", *self._base, "--port", str(self.port), *self._extra]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(self._env or {})},
        )

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # The free port was taken before the server bound it (another test's server or a rank's
                # rendezvous picked it meanwhile): start again on a new one.
                if self._port_retries and "Address already in use" in self.log_tail():
                    self._port_retries -= 1
                    self._log.close()
                    try:  # whatever the failed start left in its session
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    self._start()
                    continue
                raise RuntimeError(
                    f"pagoda serve exited with {self.proc.returncode} during startup:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"pagoda serve not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def engine_pid(self) -> int:
        """The engine core: the server's child process that is neither multiprocessing's resource tracker nor an
        API process (those listen on the port)."""
        try:
            import psutil

            children = [
                (c.pid, " ".join(c.cmdline()))
                for c in psutil.Process(self.proc.pid).children()
                if c.pid not in self.api_pids()
            ]
        except ImportError:
            out = subprocess.run(["pgrep", "-a", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
            children = [(int(line.split(" ", 1)[0]), line) for line in out.splitlines() if line.strip()]
        engines = [pid for pid, cmd in children if "resource_tracker" not in cmd]
        assert len(engines) == 1, f"expected one engine child of {self.proc.pid}, found {children}"
        return engines[0]

    def api_pids(self) -> list[int]:
        """The API processes: the server's children listening on its port."""
        import psutil

        return sorted(
            c.pid
            for c in psutil.Process(self.proc.pid).children()
            if any(k.status == psutil.CONN_LISTEN and k.laddr.port == self.port for k in c.net_connections("tcp"))
        )

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


@contextmanager
def running_server(log_path: Path, extra_flags: list[str]) -> Iterator[ServerProcess]:
    """A healthy `pagoda serve` for the duration of the block (for module- and session-scoped fixtures)."""
    proc = ServerProcess(log_path, extra_flags)
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()
