"""On one GPU: what tensor parallelism relies on from NCCL, checked with a process group of one.

`pagoda.distributed.parallel_state.init_tensor_parallel` with NCCL (world size 1, the device group a real
NCCL communicator), then: an all-reduce, an all-gather and a broadcast captured in a CUDA graph and
replayed (the decode graphs capture the row-parallel all-reduces exactly so), and the gloo object
broadcast. Prints one line per check. (What an all-reduce costs needs two GPUs: at world size 1 NCCL's is a
no-op.)
    python .ci/device/nccl_graph_check.py
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from pagoda.distributed import parallel_state as ps


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    group = ps.init_tensor_parallel(0, 1, f"tcp://127.0.0.1:{port}", "cuda", 60)
    print("backend", dist.get_backend(group.device_group), "world", dist.get_world_size(group.device_group))
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside the graph (NCCL sets up its buffers lazily)
            dist.all_reduce(x, group=group.device_group)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
        dist.all_reduce(y, group=group.device_group)
        gathered = torch.empty(1 * 64, 2048, device="cuda", dtype=torch.bfloat16)
        ps._all_gather_flat(gathered, y, group=group.device_group)
        dist.broadcast(gathered, src=0, group=group.device_group)
        out.copy_(gathered)
    x.fill_(1.5)
    graph.replay()
    torch.cuda.synchronize()
    print("graph replay all_reduce/all_gather/broadcast ok:", bool((out == 3.0).all()))
    print("object broadcast over gloo ok:", ps.broadcast_object({"step": 1}) == {"step": 1})
    ps.destroy_tensor_parallel()


if __name__ == "__main__":
    main()
