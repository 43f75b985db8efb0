"""The startup log: per-shard progress and the total load time of the weights, and the one line that
says `--gpu-memory-utilization` does nothing on the CPU (only when the user set it).

Offline `LLM(...)` is checked here, through caplog; `pagoda serve`, where the model loads in the spawned
engine-core process and its lines must still reach the server's output, in tests/e2e/test_startup_log_serve.py.
"""

from __future__ import annotations

import logging
import re

import pytest

from pagoda import LLM
from tests.conftest import build_tiny_model

LOADED = re.compile(r"Loaded weights: \d+\.\d (KiB|MiB|GiB) in \d+\.\d s \(5 file\(s\)")
CPU_UTILIZATION = "--gpu-memory-utilization 0.5 does not apply on the CPU: --cpu-kv-cache-space-gib sets"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> str:
    return build_tiny_model("qwen2", str(tmp_path_factory.mktemp("startup-log")), max_shard_size="100KB")


def load(folder: str, **kwargs) -> LLM:
    return LLM(
        model=folder, skip_tokenizer_init=True, max_model_len=64, device="cpu", cpu_kv_cache_space_gib=0.05, **kwargs
    )


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
