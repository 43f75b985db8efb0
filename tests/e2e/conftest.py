"""End-to-end fixtures: the real `python -m pagoda serve` in a subprocess, spoken to over HTTP.

One server (`server`) is shared by every test of a worker (tests/conftest.py keeps each module's tests on
one worker); a test that must end a server (SIGTERM) starts its own with `launch_server`. The one test
that kills the shared server's engine process is marked `kills_engine` and runs after all others. Each
start costs ~20-40 s of CPU (three processes import torch, the default model is dequantized), so keep to
these, and give a new test a server that already runs with the flags it needs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # e2e_helpers / e2e_server, whatever pytest's import mode

from e2e_helpers import API_KEY  # noqa: E402
from e2e_server import BASE_FLAGS, STARTUP_TIMEOUT_S, ServerProcess, free_port, running_server  # noqa: E402,F401


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("server") / "serve.log", []) as proc:
        yield proc


@pytest.fixture(scope="session")
def base_url(server: ServerProcess) -> str:
    return server.url


@pytest.fixture
def launch_server(tmp_path: Path) -> Iterator:
    """Start an extra, short-lived server with more flags; it is stopped at the end of the test."""
    started: list[ServerProcess] = []

    def launch(*extra_flags: str, env: dict[str, str] | None = None) -> ServerProcess:
        proc = ServerProcess(tmp_path / f"serve-{len(started)}.log", list(extra_flags), env)
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
