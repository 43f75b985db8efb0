"""What /metrics reads from the machine: GPU utilisation through NVML (a fake pynvml module here: no GPU in
CI), absent on the CPU or without NVML; the `process_*` of several API processes, one series per pid."""

from __future__ import annotations

import os
import types
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pagoda.server.host_metrics import ApiProcesses, gpu_collector
from pagoda.server.metrics import ServerMetrics


class NVMLError(Exception):
    pass


def fake_nvml(busy: dict[int, int], uuids: dict[str, int] | None = None, broken: set[int] = frozenset()):
    """A pynvml stand-in: GPUs by NVML index with a utilisation in %, optional UUIDs, GPUs whose read fails."""
    nvml = types.SimpleNamespace(initialized=False)

    def init() -> None:
        nvml.initialized = True

    def rates(handle: int):
        if handle in broken:
            raise NVMLError("Not Supported")
        return types.SimpleNamespace(gpu=busy[handle], memory=0)

    nvml.nvmlInit = init
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: (uuids or {})[uuid]
    nvml.nvmlDeviceGetIndex = lambda handle: handle
    nvml.nvmlDeviceGetUtilizationRates = rates
    return nvml


def gpu_samples(collector) -> dict[tuple[str, str], float]:
    text = ServerMetrics("m", collectors=(collector,)).render().decode()
    return {
        (s.labels["gpu"], s.labels["tp_rank"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:gpu_utilization_perc"
    }


def test_each_ranks_gpu_by_visible_device(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    nvml = fake_nvml({1: 40, 3: 95})
    collector = gpu_collector("cuda", 2, "mp", ("m", "0"), nvml=nvml)
    assert nvml.initialized and collector is not None
    # rank 0 on the first visible device (NVML's GPU 3), rank 1 on GPU 1; a fraction, as kv_cache_usage_perc
    assert gpu_samples(collector) == {("3", "0"): 0.95, ("1", "1"): 0.40}


def test_uuids_ray_and_unreadable_gpus(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa,GPU-bbb")
    nvml = fake_nvml({5: 10, 6: 20}, uuids={"GPU-aaa": 5, "GPU-bbb": 6}, broken={6})
    # Ray: only rank 0 runs on this machine.
    assert gpu_samples(gpu_collector("cuda", 2, "ray", ("m", "0"), nvml=nvml)) == {("5", "0"): 0.10}
    # A GPU NVML cannot read (a MIG slice) has no series, not 0.
    assert gpu_samples(gpu_collector("cuda", 2, "mp", ("m", "0"), nvml=nvml)) == {("5", "0"): 0.10}


def test_absent_on_the_cpu_and_without_nvml(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_collector("cpu", 1, "mp", ("m", "0"), nvml=fake_nvml({0: 50})) is None
    failing = fake_nvml({0: 50})

    def no_driver() -> None:
        raise NVMLError("Driver Not Loaded")

    failing.nvmlInit = no_driver
    assert gpu_collector("cuda", 1, "mp", ("m", "0"), nvml=failing) is None
    page = ServerMetrics("m").render().decode()
    assert "gpu_utilization" not in page


def test_process_metrics_of_every_live_api_process(tmp_path: Path) -> None:
    """A multiprocess directory with files of this process, of its parent (both alive) and of a pid no process
    has: a series per live pid, each its own process's numbers."""
    gone = next(pid for pid in range(4_000_000, 3_000_000, -1) if not os.path.exists(f"/proc/{pid}"))
    for pid in (os.getpid(), os.getppid(), gone):
        (tmp_path / f"counter_{pid}.db").write_bytes(b"")
    (tmp_path / f"gauge_mostrecent_{os.getpid()}.db").write_bytes(b"")
    text = ServerMetrics("m", process_collector=ApiProcesses(str(tmp_path))).render().decode()
    start = {
        s.labels["pid"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "process_start_time_seconds"
    }
    assert set(start) == {str(os.getpid()), str(os.getppid())}
    assert start[str(os.getppid())] <= start[str(os.getpid())]  # the parent started first
