"""The tensor-parallel group and pipeline stage this process belongs to, and the few collectives that cross them.

One group per process, set once before the model is built (`init_tensor_parallel`) and read by the
layers while they are constructed (`tp_rank`, `tp_world_size`): a model built without a group is the
single-device model, and every collective here is then the identity, so TP = 1 runs no communication.

Two process groups over the same ranks:
- `device_group` (NCCL on CUDA, gloo on the CPU): the model's all-reduces and all-gathers, and the
  broadcast of each step's sampled tokens. On CUDA these are NCCL calls on the current stream, which a
  CUDA graph captures like any kernel.
- `cpu_group` (always gloo): pickled Python objects — each step's `SchedulerOutput` and the driver's
  control calls — posted once per step from rank 0 (the driver) to each other rank (`post_to_ranks`).

Point-to-point sends are posted (`isend`) and the sending host never waits on them: the receiver's
blocking `recv` is the only wait (on CUDA the sender's stream waits for its NCCL send, as with `send`).
A sender that blocked until its receiver arrived could close a cycle once several micro-batches are in
flight through the stages (a stage sending step N's logits while the driver sends step N+1's
activations); posted sends cannot. `_Outbox` keeps each posted tensor alive until its send has completed.

Pipeline parallelism (`pp_size` > 1) lays `tp_size x pp_size` ranks out stage by stage: global rank
r is tensor-parallel rank r % tp of stage r // tp. `device_group` is then the stage's own tensor-parallel
group; `world_device_group` spans every rank (the sampled tokens' broadcast, and the point-to-point
sends between stages: a stage's TP rank t hands its activations to TP rank t of the next stage, and the
last stage's TP rank 0 hands the sampling rows' logits to the driver). `cpu_group` spans every rank.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagoda.distributed.stages import stage_layer_range

DRIVER_RANK = 0
# Tags keep the kinds of message between one pair of ranks apart (each kind is received in posting order).
_TAG_CALL, _TAG_ACTIVATIONS, _TAG_LOGITS, _TAG_TOKENS = 1, 2, 3, 4
# torch 2.13 renamed all_gather_into_tensor (same arguments); the device's torch has only the old name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int  # within the stage's tensor-parallel group
    world_size: int  # tensor-parallel size
    device_group: Any = None  # dist.ProcessGroup of the stage's TP ranks, None at TP size 1
    cpu_group: Any = None  # every rank (gloo)
    pp_rank: int = 0  # this rank's pipeline stage
    pp_size: int = 1
    world_device_group: Any = None  # every rank (NCCL / gloo), None when there is only one

    @property
    def global_rank(self) -> int:
        return self.pp_rank * self.world_size + self.rank

    @property
    def num_ranks(self) -> int:
        return self.pp_size * self.world_size


_GROUP = TensorParallelGroup(0, 1)


def tp_group() -> TensorParallelGroup:
    return _GROUP


def tp_rank() -> int:
    return _GROUP.rank


def tp_world_size() -> int:
    return _GROUP.world_size


def is_driver() -> bool:
    return _GROUP.global_rank == DRIVER_RANK


def num_ranks() -> int:
    """Every rank of the model, all stages: 1 when nothing is distributed."""
    return _GROUP.num_ranks


def pp_rank() -> int:
    return _GROUP.pp_rank


def pp_size() -> int:
    return _GROUP.pp_size


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, device: str, timeout_s: float, pipeline_size: int = 1
) -> TensorParallelGroup:
    """Join the group: blocks until all `world_size * pipeline_size` ranks have called it; raises
    (RuntimeError, or torch's DistStoreError) when they have not met within `timeout_s`.

    rank: the global rank (stage-major, see above); world_size: the tensor-parallel size.
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
        world_size=world_size * pipeline_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    # The world group's timeout bounds the meeting above. The groups used while serving get no timeout of
    # their own that could fire: the ranks wait for the driver's next step for as long as the server is
    # idle, and a hung collective is found by the driver's watch of its ranks (worker/rank_watch.py).
    forever = datetime.timedelta(days=365)
    world_device_group = dist.new_group(backend=backend, timeout=forever)
    cpu_group = dist.new_group(backend="gloo", timeout=forever)
    stage = rank // world_size
    device_group = world_device_group
    if pipeline_size > 1:  # every rank creates every stage's group, in one order (torch requires it)
        for s in range(pipeline_size):
            group = dist.new_group(range(s * world_size, (s + 1) * world_size), backend=backend, timeout=forever)
            if s == stage:
                device_group = group
    dist.barrier(group=cpu_group)
    _GROUP = TensorParallelGroup(
        rank % world_size,
        world_size,
        device_group if world_size > 1 else None,
        cpu_group,
        stage,
        pipeline_size,
        world_device_group,
    )
    return _GROUP


class _Outbox:
    """Posted sends not yet known to be complete, with the tensors they read (alive until then)."""

    def __init__(self) -> None:
        self.posted: list[tuple[Any, torch.Tensor]] = []

    def post(self, tensor: torch.Tensor, peer: int, group: Any, tag: int) -> None:
        # gloo reads the tensor when the receiver is ready, which may be after the caller reuses it (a
        # graph runner's static buffers): it sends a copy.
        tensor = tensor.contiguous() if tensor.is_cuda else tensor.clone(memory_format=torch.contiguous_format)
        work = dist.isend(tensor, peer, group=group, tag=tag)
        assert work is not None  # None only for a rank outside the group; every sender is in its group
        if tensor.is_cuda:
            # NCCL: the current stream waits for the send (the host does not), so a kernel queued after it
            # cannot overwrite the tensor (a graph's static buffers) before the send has read it.
            work.wait()
        self.posted.append((work, tensor))
        if len(self.posted) > 64:  # a few steps' worth: drop what has gone
            self.posted = [(w, t) for w, t in self.posted if not w.is_completed()]


_OUTBOX = _Outbox()


def destroy_tensor_parallel() -> None:
    global _GROUP
    _OUTBOX.posted.clear()
    if _GROUP.num_ranks > 1 and dist.is_initialized():
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
    """The driver's `x` on every rank of every stage, in place (same shape and dtype everywhere)."""
    if _GROUP.num_ranks > 1:
        dist.broadcast(x, src=DRIVER_RANK, group=_GROUP.world_device_group)
    return x


def send_to_next_stage(tensors: list[torch.Tensor]) -> None:
    """This stage's activations to the same tensor-parallel rank of the next stage (posted)."""
    peer = _GROUP.global_rank + _GROUP.world_size
    for t in tensors:
        _OUTBOX.post(t, peer, _GROUP.world_device_group, _TAG_ACTIVATIONS)


def recv_from_previous_stage(out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The previous stage's activations (what `send_to_next_stage` sent there), into `out`, in order."""
    peer = _GROUP.global_rank - _GROUP.world_size
    for t in out:
        dist.recv(t, peer, group=_GROUP.world_device_group, tag=_TAG_ACTIVATIONS)
    return out


LOGITS_RANK_OFFSET = 0  # the last stage's tensor-parallel rank that hands the logits to the driver


def send_logits_to_driver(logits: torch.Tensor) -> None:
    if _GROUP.rank == LOGITS_RANK_OFFSET:
        _OUTBOX.post(logits, DRIVER_RANK, _GROUP.world_device_group, _TAG_LOGITS)


def recv_logits_on_driver(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    logits = torch.empty(shape, dtype=dtype, device=device)
    last = (_GROUP.pp_size - 1) * _GROUP.world_size + LOGITS_RANK_OFFSET
    dist.recv(logits, last, group=_GROUP.world_device_group, tag=_TAG_LOGITS)
    return logits


def send_tokens_to_ranks(tokens: torch.Tensor) -> None:
    """The driver's sampled tokens to every other rank, posted (the micro-batch path; see `recv_tokens`)."""
    for peer in range(1, _GROUP.num_ranks):
        _OUTBOX.post(tokens, peer, _GROUP.world_device_group, _TAG_TOKENS)


def recv_tokens(out: torch.Tensor) -> torch.Tensor:
    """On a rank other than the driver: the tokens `send_tokens_to_ranks` posted, into `out`."""
    dist.recv(out, DRIVER_RANK, group=_GROUP.world_device_group, tag=_TAG_TOKENS)
    return out


def post_to_ranks(obj: Any) -> None:
    """The driver's `obj` to every other rank, in posting order: one pickle, its length and its bytes over the
    gloo group, posted (the driver runs on while the ranks catch up; they take calls in order)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    for peer in range(1, _GROUP.num_ranks):
        _OUTBOX.post(length, peer, _GROUP.cpu_group, _TAG_CALL)
        _OUTBOX.post(payload, peer, _GROUP.cpu_group, _TAG_CALL)


def receive_from_driver() -> Any:
    """On a rank other than the driver: the next object `post_to_ranks` posted (blocks until it comes)."""
    length = torch.empty(1, dtype=torch.int64)
    dist.recv(length, DRIVER_RANK, group=_GROUP.cpu_group, tag=_TAG_CALL)
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.recv(payload, DRIVER_RANK, group=_GROUP.cpu_group, tag=_TAG_CALL)
    return pickle.loads(payload.numpy().tobytes())


def all_reduce_max(value: float) -> float:
    """The largest of the ranks' `value` (a host scalar), on every rank."""
    if _GROUP.num_ranks == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_GROUP.cpu_group)
    return float(t.item())


def assume_rank(rank: int, world_size: int, stage: int = 0, pipeline_size: int = 1) -> None:
    """Pretend to be TP `rank` of `world_size` in pipeline `stage` without communication: builds one rank's
    shard of a model (for shape checks and `pagoda doctor`'s dry run). Collectives must not run under it."""
    global _GROUP
    _GROUP = TensorParallelGroup(rank, world_size, pp_rank=stage, pp_size=pipeline_size)


def stage_layers(num_layers: int, stage: int | None = None, pipeline_size: int | None = None) -> range:
    """The decoder layers pipeline `stage` holds (this rank's by default): `config.parallel.stage_layer_range`."""
    stage = _GROUP.pp_rank if stage is None else stage
    n = _GROUP.pp_size if pipeline_size is None else pipeline_size
    return stage_layer_range(num_layers, stage, n)
