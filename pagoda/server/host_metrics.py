"""What /metrics reads from the machine at scrape time: the API processes' `process_*` and each GPU's utilisation.

`process_*` are prometheus_client's own (`ProcessCollector`: CPU seconds, resident and virtual memory, start
time, open and maximum file descriptors, from /proc). With one API process they are that process's, unlabelled,
as vLLM shows them. With several (`--api-server-count N`), the process that answers a scrape reads every API
process's /proc entry and labels each series with its `pid`: a counter like `process_cpu_seconds_total` must
not jump between processes from one scrape to the next, and a sum over processes is what a dashboard can do
itself. Which processes those are: prometheus_client's multiprocess directory holds one `<kind>_<pid>.db`
file per writing process (the naming its own `mark_process_dead` relies on); the ones still alive count. The
engine core and the tensor-parallel ranks are not API processes and are not shown.

`pagoda:gpu_utilization_perc{gpu, tp_rank}` (0..1, as vLLM's `kv_cache_usage_perc`): the fraction of the last
sample period during which a kernel ran on the GPU, as NVML (`nvidia-ml-py`, `pynvml`) reports it, for each
GPU of this machine that a rank of the engine uses. `gpu` is NVML's (and nvidia-smi's) index, `tp_rank` the
tensor-parallel rank on it. Ranks run on the visible devices in rank order (`CUDA_VISIBLE_DEVICES`, indexes
or UUIDs), so rank r is the r-th visible device; with the Ray backend only rank 0 is on this machine. There is
no series at all on the CPU, without NVML, or for a GPU NVML cannot read (a MIG slice): absent, never 0.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric

logger = logging.getLogger("pagoda.server")

GPU_UTILIZATION = "pagoda:gpu_utilization_perc"


class ApiProcesses:
    """`process_*` of every live API process, each labelled `pid` (several API processes)."""

    def __init__(self, multiprocess_dir: str, proc: str = "/proc"):
        self.dir, self.proc = Path(multiprocess_dir), proc

    def pids(self) -> list[int]:
        found = set()
        for path in self.dir.glob("*_*.db"):
            pid = path.stem.rsplit("_", 1)[1]
            if pid.isdigit() and os.path.exists(f"{self.proc}/{pid}"):
                found.add(int(pid))
        return sorted(found)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for pid in self.pids():
            collector = ProcessCollector(pid=functools.partial(int, pid), proc=self.proc, registry=None)
            for family in collector.collect():
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                into.samples += [s._replace(labels={**s.labels, "pid": str(pid)}) for s in family.samples]
        yield from merged.values()


def process_collector(multiprocess_dir: str | None, api_server_count: int) -> Any:
    """The `process_*` collector for /metrics (see the module's docstring)."""
    if api_server_count > 1 and multiprocess_dir:
        return ApiProcesses(multiprocess_dir)
    return ProcessCollector(registry=None)


class GpuUtilization:
    """`pagoda:gpu_utilization_perc` of the given GPUs, read from NVML at each scrape."""

    def __init__(self, nvml: Any, gpus: list[tuple[int, Any, int]], labels: tuple[str, str]):
        """`gpus`: (tp rank, NVML handle, NVML index); `labels`: the values of `model_name` and `engine`."""
        self.nvml, self.gpus, self.labels = nvml, gpus, labels

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            GPU_UTILIZATION,
            "Fraction of the last sample period a kernel ran on the GPU (NVML), per GPU the engine uses (0..1)",
            labels=["model_name", "engine", "gpu", "tp_rank"],
        )
        for rank, handle, index in self.gpus:
            try:
                busy = self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            except Exception:  # noqa: BLE001 - an unreadable GPU (NVML error, driver gone) has no series
                continue
            family.add_metric([*self.labels, str(index), str(rank)], busy / 100.0)
        yield family


def gpu_collector(
    device: str, tensor_parallel_size: int, backend: str, labels: tuple[str, str], nvml: Any = None
) -> GpuUtilization | None:
    """A `GpuUtilization` for the GPUs of this machine the engine's ranks use; None on the CPU or when
    NVML is not there (nvidia-ml-py not installed, no driver). `nvml`: the module (tests pass a fake)."""
    if device != "cuda":
        return None
    try:
        if nvml is None:
            nvml = importlib.import_module("pynvml")  # lazy: only on CUDA; nvidia-ml-py
        nvml.nvmlInit()
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        local_ranks = 1 if backend == "ray" else tensor_parallel_size
        gpus = []
        for rank in range(local_ranks):
            name = visible[rank] if rank < len(visible) else str(rank)
            if name.isdigit():
                handle = nvml.nvmlDeviceGetHandleByIndex(int(name))
            else:
                handle = nvml.nvmlDeviceGetHandleByUUID(name)
            gpus.append((rank, handle, int(nvml.nvmlDeviceGetIndex(handle))))
    except Exception as exc:  # noqa: BLE001 - no NVML: the gauge is left out, the server runs
        logger.info("GPU utilisation not in /metrics: NVML unavailable (%s: %s)", type(exc).__name__, exc)
        return None
    return GpuUtilization(nvml, gpus, labels)
