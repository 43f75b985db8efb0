"""`pagoda serve`'s output has the startup log lines of the spawned engine-core process: per-shard progress,
the total load time, and the one line that says `--gpu-memory-utilization` does nothing on the CPU (the
same lines offline: tests/unit/test_startup_log.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import build_tiny_model
from tests.unit.test_startup_log import CPU_UTILIZATION, LOADED


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> str:
    return build_tiny_model("qwen2", str(tmp_path_factory.mktemp("startup-log")), max_shard_size="100KB")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_output_has_the_engine_core_load_lines(sharded, tmp_path):
    log_path = tmp_path / "serve.log"
    cmd = [
        sys.executable,
        "-m",
        "pagoda",
        "serve",
        sharded,
        "--skip-tokenizer-init",
        "--max-model-len",
        "64",
        "--cpu-kv-cache-space-gib",
        "0.05",
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(_free_port()),
        "--gpu-memory-utilization",
        "0.5",
        "--cpu-threads",
        "1",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        deadline = time.monotonic() + 300  # a hung start, not a speed check
        while time.monotonic() < deadline and proc.poll() is None and "Serving on" not in log_path.read_text():
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the engine core, if it outlived the server
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(10)
    out = log_path.read_text()
    assert "Serving on" in out, out
    assert "loading shard 5/5 (model-00005-of-00005.safetensors" in out, out
    assert LOADED.search(out) and out.count(CPU_UTILIZATION) == 1, out
    assert "CPU threads: 1 per rank" in out and "--cpu-threads" in out, out  # the flag reached the engine core
