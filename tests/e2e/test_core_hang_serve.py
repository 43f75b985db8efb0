"""A hung engine core is found by its heartbeat, a long step is not a hang. One server, started with a
short heartbeat timeout (PAGODA_CORE_HEARTBEAT_TIMEOUT_S=3) and a first step that keeps the core's loop
busy on the CPU for 20 s (PAGODA_TEST_LONG_STEP_S): that request must complete with /health 200 all along;
then SIGSTOP of the core mid-stream must turn /health 503 within 5 s, end the stream with an SSE error
event, and end the server non-zero with one line naming the core. The second test ends the server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_helpers import API_KEY, MODEL
from e2e_server import ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG_STEP_S = 20.0
ENV = {"PAGODA_CORE_HEARTBEAT_TIMEOUT_S": "3", "PAGODA_TEST_LONG_STEP_S": str(LONG_STEP_S)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(Path(tmp_path_factory.mktemp("hang")) / "serve.log", [], ENV)
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def _health_while(server: ServerProcess, done: threading.Event) -> list[int]:
    """/health's status every 0.2 s until `done` (0: no answer within 5 s)."""
    statuses: list[int] = []
    with httpx.Client(base_url=server.url, timeout=5) as probe:
        while not done.is_set():
            try:
                statuses.append(probe.get("/health").status_code)
            except httpx.HTTPError:
                statuses.append(0)
            time.sleep(0.2)
    return statuses


def test_a_20_s_cpu_step_is_not_a_hang(server: ServerProcess) -> None:
    done = threading.Event()
    statuses: list[int] = []
    probe = threading.Thread(target=lambda: statuses.extend(_health_while(server, done)), daemon=True)
    probe.start()
    started = time.monotonic()
    try:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120)
    finally:
        done.set()
        probe.join(30)
    took = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert took >= LONG_STEP_S, f"the injected long step did not run ({took:.1f} s)"  # else this test proves nothing
    assert len(statuses) > 20 and set(statuses) == {200}, statuses
    assert server.proc.poll() is None and "is hung" not in server.log_tail(20000)


def test_a_stopped_core_gives_503_an_sse_error_and_a_nonzero_exit_naming_it(server: ServerProcess) -> None:
    core = server.engine_pid()
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                for line in lines:
                    if line.startswith("data:"):
                        break
                os.kill(core, signal.SIGSTOP)
                stopped = time.monotonic()
                while (health := client.get("/health")).status_code == 200:
                    assert time.monotonic() - stopped < 5, "/health still 200 5 s after the core stopped"
                    time.sleep(0.1)
                waited = time.monotonic() - stopped
                assert health.status_code == 503 and "is hung" in health.json()["error"]["message"], health.text
                rest = "\n".join(lines)
        assert '"error"' in rest and "engine stopped" in rest.lower(), rest[-500:]
        assert rest.rstrip().endswith("data: [DONE]"), rest[-200:]
        assert server.proc.wait(30) == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(core, signal.SIGCONT)
    errors = [line for line in server.log_tail(20000).splitlines() if line.startswith("pagoda: error:")]
    assert len(errors) == 1, server.log_tail()
    assert f"the engine core process (pid {core}) is hung: no heartbeat for" in errors[0], errors
    print(f"/health 503 {waited:.1f} s after SIGSTOP")
