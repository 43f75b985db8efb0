"""The startup log: per-shard progress and the total load time of the weights, and the one line that
says `--gpu-memory-utilization` does nothing on the CPU (only when the user set it).

Offline `LLM(...)` is checked through caplog; `pagoda serve` in a subprocess, because there the model
loads in the spawned engine-core process and its lines must still reach the server's output.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from pagoda import LLM
from tests.conftest import build_tiny_model

LOADED = re.compile(r"Loaded weights: \d+\.\d (KiB|MiB|GiB) in \d+\.\d s \(5 file\(s\)")
CPU_UTILIZATION = "--gpu-memory-utilization 0.5 does not apply on the CPU: --cpu-kv-cache-space-gib sets"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> str:
    return build_tiny_model("qwen2", str(tmp_path_factory.mktemp("startup-log")), max_shard_size="100KB")


def load(folder: str, **kwargs) -> LLM:
    return LLM(model=folder, skip_tokenizer_init=True, max_model_len=64, device="cpu",
               cpu_kv_cache_space_gib=0.05, **kwargs)


def test_offline_load_logs_each_shard_and_the_total(sharded, caplog):
    with caplog.at_level(logging.INFO):
        load(sharded, gpu_memory_utilization=0.5)
    messages = [r.getMessage() for r in caplog.records]
    shards = [m for m in messages if m.startswith("loading shard ")]
    assert len(shards) == 5, messages
    assert re.fullmatch(r"loading shard 1/5 \(model-00001-of-00005\.safetensors, \d+\.\d KiB\)\.\.\.", shards[0])
    assert shards[-1].startswith("loading shard 5/5 (model-00005-of-00005.safetensors, ")
    loaded = [m for m in messages if LOADED.match(m)]
    assert len(loaded) == 1 and messages.index(loaded[0]) > messages.index(shards[-1]), messages
    assert sum(CPU_UTILIZATION in m for m in messages) == 1, messages


def test_default_gpu_memory_utilization_is_not_mentioned_on_the_cpu(sharded, caplog):
    with caplog.at_level(logging.INFO):
        load(sharded)
    messages = [r.getMessage() for r in caplog.records]
    assert any(LOADED.match(m) for m in messages)
    assert not any("gpu-memory-utilization" in m for m in messages), messages


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_output_has_the_engine_core_load_lines(sharded, tmp_path):
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "pagoda", "serve", sharded, "--skip-tokenizer-init", "--max-model-len", "64",
           "--cpu-kv-cache-space-gib", "0.05", "--device", "cpu", "--host", "127.0.0.1", "--port",
           str(_free_port()), "--gpu-memory-utilization", "0.5"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 90
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
            os.killpg(proc.pid, signal.SIGKILL)        # the engine core, if it outlived the server
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(10)
    out = log_path.read_text()
    assert "Serving on" in out, out
    assert "loading shard 5/5 (model-00005-of-00005.safetensors" in out, out
    assert LOADED.search(out) and out.count(CPU_UTILIZATION) == 1, out
