"""Read the GPU-utilisation gauge the way `pagoda serve`'s /metrics does, without starting a server or a model.

    python benchmarks/profile/nvml_check.py [-tp 2] [--ray] [--samples 5] [--load]

Builds the same collector the API process builds on CUDA (`server/host_metrics.gpu_collector`: NVML through
nvidia-ml-py, rank r on the r-th visible device), renders it as /metrics would (`ServerMetrics` under both
prefixes) and prints the `gpu_utilization_perc` samples `--samples` times, a second apart. `--load` runs a
matmul loop on every device of the ranks meanwhile (torch), so the value should rise toward 1 while it runs;
without it an idle GPU reads ~0. On a machine without NVML it says so and exits 1: the gauge is then absent
from /metrics, as on the CPU.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from prometheus_client.parser import text_string_to_metric_families

from pagoda.server.host_metrics import GPU_UTILIZATION, gpu_collector
from pagoda.server.metrics import ENGINE_INDEX, ServerMetrics


def _load(devices: int, stop: threading.Event) -> list[threading.Thread]:
    import torch  # lazy: only with --load

    def spin(index: int) -> None:
        a = torch.randn(8192, 8192, device=f"cuda:{index}", dtype=torch.bfloat16)
        while not stop.is_set():
            for _ in range(20):
                a @ a
            torch.cuda.synchronize(index)

    threads = [threading.Thread(target=spin, args=(index,), daemon=True) for index in range(devices)]
    for thread in threads:
        thread.start()
    return threads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--ray", action="store_true", help="as with --distributed-executor-backend ray (rank 0 only)")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--load", action="store_true", help="keep the GPUs busy meanwhile (torch matmuls)")
    args = parser.parse_args()
    backend = "ray" if args.ray else "mp"
    collector = gpu_collector("cuda", args.tensor_parallel_size, backend, ("check", ENGINE_INDEX))
    if collector is None:
        print("NVML unavailable: no gpu_utilization_perc in /metrics (see the log line above)")
        return 1
    print("GPUs read:", [(f"tp_rank {rank}", f"NVML index {index}") for rank, _, index in collector.gpus])
    metrics = ServerMetrics("check", collectors=(collector,))
    stop = threading.Event()
    loaders = _load(len(collector.gpus), stop) if args.load else []
    try:
        for _ in range(args.samples):
            time.sleep(1.0)
            for family in text_string_to_metric_families(metrics.render().decode()):
                for s in family.samples:
                    if s.name in (GPU_UTILIZATION, GPU_UTILIZATION.replace("pagoda:", "vllm:")):
                        print(f"{s.name}{s.labels} {s.value}")
    finally:
        stop.set()
        for thread in loaders:  # a CUDA thread still running at interpreter exit aborts the process
            thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
