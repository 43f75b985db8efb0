"""Host → device copies that never wait for the GPU.

A plain `tensor.to("cuda")` from pageable memory ends in a stream synchronize: the host waits
until every kernel already queued has finished. With async scheduling the engine launches step
N+1 while step N still runs, so any such copy on the launch path would stall the host for the rest
of step N and undo the overlap. `to_device` stages the data in pinned memory (PyTorch's caching
host allocator keeps the block alive until the copy has run) and copies without a sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    data: np.ndarray | Sequence, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`data` (a numpy array or a list of numbers) as a tensor on `device`, with no host-device sync."""
    if isinstance(data, np.ndarray):
        host = torch.from_numpy(np.ascontiguousarray(data))
        if dtype is not None:
            host = host.to(dtype)
    else:
        host = torch.tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
