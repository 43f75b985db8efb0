"""The tensor-parallel group this process belongs to, and the few collectives that cross it.

One group per process, set once before the model is built (`init_tensor_parallel`) and read by the
layers while they are constructed (`tp_rank`, `tp_world_size`): a model built without a group is the
single-device model, and every collective here is then the identity, so TP = 1 runs no communication.

Two process groups over the same ranks:
- `device_group` (NCCL on CUDA, gloo on the CPU): the model's all-reduces and all-gathers, and the
  broadcast of each step's sampled tokens. On CUDA these are NCCL calls on the current stream, which a
  CUDA graph captures like any kernel.
- `cpu_group` (always gloo): pickled Python objects — each step's `SchedulerOutput` and the driver's
  control calls — sent once per step from rank 0 (the driver) to the others.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DRIVER_RANK = 0
# torch 2.13 renamed all_gather_into_tensor (same arguments); the device's torch has only the old name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    device_group: Any = None  # dist.ProcessGroup, None at world size 1
    cpu_group: Any = None


_GROUP = TensorParallelGroup(0, 1)


def tp_group() -> TensorParallelGroup:
    return _GROUP


def tp_rank() -> int:
    return _GROUP.rank


def tp_world_size() -> int:
    return _GROUP.world_size


def is_driver() -> bool:
    return _GROUP.rank == DRIVER_RANK


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, device: str, timeout_s: float
) -> TensorParallelGroup:
    """Join the group: blocks until all `world_size` ranks have called it; raises (RuntimeError, or
    torch's DistStoreError) when they have not met within `timeout_s`.

    init_method: "tcp://host:port" of rank 0. device: "cuda" (NCCL; the rank's GPU must already be the
    current device) or "cpu" (gloo)."""
    global _GROUP
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if device == "cuda":
        # Binds the communicator to this rank's GPU up front (NCCL otherwise guesses it lazily).
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    # The world group's timeout bounds the meeting above. The groups used while serving get no timeout of
    # their own that could fire: the ranks wait for the driver's next step for as long as the server is
    # idle, and a hung collective is found by the driver's watch of its ranks (worker/rank_watch.py).
    forever = datetime.timedelta(days=365)
    device_group = dist.new_group(backend=backend, timeout=forever)
    cpu_group = dist.new_group(backend="gloo", timeout=forever)
    dist.barrier(group=cpu_group)
    _GROUP = TensorParallelGroup(rank, world_size, device_group, cpu_group)
    return _GROUP


def destroy_tensor_parallel() -> None:
    global _GROUP
    if _GROUP.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = TensorParallelGroup(0, 1)


def shard(size: int, what: str = "dimension") -> tuple[int, int]:
    """(start, length) of this rank's contiguous share of `size` (which must divide by the world size)."""
    world, rank = _GROUP.world_size, _GROUP.rank
    if size % world:
        raise ValueError(f"{what} {size} does not divide by tensor_parallel_size {world}")
    length = size // world
    return rank * length, length


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks, in place (the identity at world size 1)."""
    if _GROUP.world_size > 1:
        dist.all_reduce(x, group=_GROUP.device_group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' `x` concatenated along `dim`, in rank order, on every rank."""
    world = _GROUP.world_size
    if world == 1:
        return x
    dim = dim % x.dim()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_flat(out, x.contiguous(), group=_GROUP.device_group)
    if dim == 0:
        return out
    # [world * d0, ...] → [world, d0, ..., d_dim, ...] → concatenated along dim
    return torch.cat(out.chunk(world, dim=0), dim=dim)


def broadcast_tensor(x: torch.Tensor) -> torch.Tensor:
    """The driver's `x` on every rank, in place (same shape and dtype everywhere)."""
    if _GROUP.world_size > 1:
        dist.broadcast(x, src=DRIVER_RANK, group=_GROUP.device_group)
    return x


def broadcast_object(obj: Any = None) -> Any:
    """The driver's `obj` on every rank: one pickle, a length and a byte buffer over the gloo group (two
    broadcasts; `dist.broadcast_object_list` would add a size exchange per object)."""
    if _GROUP.world_size == 1:
        return obj
    group = _GROUP.cpu_group
    if is_driver():
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        dist.broadcast(length, src=DRIVER_RANK, group=group)
        dist.broadcast(payload, src=DRIVER_RANK, group=group)
        return obj
    length = torch.empty(1, dtype=torch.int64)
    dist.broadcast(length, src=DRIVER_RANK, group=group)
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=DRIVER_RANK, group=group)
    return pickle.loads(payload.numpy().tobytes())


def all_reduce_max(value: float) -> float:
    """The largest of the ranks' `value` (a host scalar), on every rank."""
    if _GROUP.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_GROUP.cpu_group)
    return float(t.item())


def assume_rank(rank: int, world_size: int) -> None:
    """Pretend to be `rank` of `world_size` without communication: builds one rank's shard of a model
    (for shape checks and `pagoda doctor`'s dry run). Collectives must not run under it."""
    global _GROUP
    _GROUP = TensorParallelGroup(rank, world_size)
