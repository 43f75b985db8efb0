"""KV-cache sizing arithmetic: pure functions, shared by the engine at startup and the planner.

A block holds `block_size` tokens of K and V for every attention layer:
    bytes_per_block = 2 (K, V) * num_layers * num_kv_heads * head_dim * block_size * dtype_bytes
                      + snapshot_bytes_per_block
where dtype_bytes is the cache's element size: the model dtype's, or 1 with `--kv-cache-dtype fp8`
(so the same budget holds about twice the blocks).
Block 0 is reserved as the null block, so `num_blocks` usable blocks need `num_blocks + 1` slots.

Models with per-sequence recurrent state (Yuan2's LF gate: 1.5·hidden values per layer) also need
`state_bytes_per_seq` for each of the max_num_seqs state slots, reserved before blocks are counted,
and, with prefix caching, one state snapshot per block (`snapshot_bytes_per_block`); with speculative
decoding, 1 + k more states per sequence (a verification step's, to roll back to). That state is
not KV cache: it stays in the model dtype whatever the cache dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GiB = 1 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int  # bytes per cached K/V element (1 for an fp8 cache)
    state_bytes_per_seq: int = 0  # per-sequence recurrent state, all layers (0: none)
    snapshot_bytes_per_block: int = 0  # state snapshot stored with each block (prefix caching)
    spec_positions: int = 0  # speculative decoding on a stateful model: 1 + k state entries per sequence

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def state_pool_bytes(self, max_num_seqs: int) -> int:
        return self.state_bytes_per_seq * max_num_seqs + self.spec_state_bytes(max_num_seqs)

    def spec_state_bytes(self, max_num_seqs: int) -> int:
        """The states a verification step keeps per position, to roll back to (`worker/state_slots.py`)."""
        return self.state_bytes_per_seq * max_num_seqs * self.spec_positions


@dataclass(frozen=True)
class KVCacheLayout:
    num_blocks: int  # including the null block 0
    block_size: int
    bytes_per_block: int

    @property
    def num_usable_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def max_concurrency(self, request_len: int) -> float:
        """How many requests of `request_len` tokens fit at once (each rounds up to whole blocks)."""
        blocks_each = -(-request_len // self.block_size)
        return (self.num_blocks - 1) / blocks_each


def kv_cache_spec(
    model: Any,
    dtype_bytes: int,
    enable_prefix_caching: bool,
    cache_dtype_bytes: int | None = None,
    spec_positions: int = 0,
) -> KVCacheSpec:
    """The cache shape a model needs, read from its modules (works on a meta-device model, so the
    planner and the engine share this one function). dtype_bytes: the model dtype's element size
    (the recurrent state's); cache_dtype_bytes: the KV cache's (None: the same); spec_positions: 1 + k
    with speculative decoding (used only by a model with per-sequence state)."""
    layers = model.attention_layers()
    stateful = model.sequence_state_layers()  # `models/base.py`: [] for a model without per-sequence state
    state = sum(layer.state_width for layer in stateful) * dtype_bytes
    return KVCacheSpec(
        len(layers),
        layers[0].num_kv_heads,
        layers[0].head_dim,
        dtype_bytes if cache_dtype_bytes is None else cache_dtype_bytes,
        state_bytes_per_seq=state,
        snapshot_bytes_per_block=state if enable_prefix_caching else 0,
        spec_positions=spec_positions if stateful else 0,
    )


def bytes_per_block(spec: KVCacheSpec, block_size: int) -> int:
    return spec.bytes_per_token() * block_size + spec.snapshot_bytes_per_block


def num_blocks_for_budget(budget_bytes: int, spec: KVCacheSpec, block_size: int) -> int:
    """Blocks (null block included) that fit in a byte budget; 0 if the budget is negative."""
    return max(0, budget_bytes // bytes_per_block(spec, block_size))


def blocks_for_request(request_len: int, block_size: int) -> int:
    """Pool size (null block included) needed to hold one request of `request_len` tokens."""
    return -(-request_len // block_size) + 1


def cpu_num_blocks(budget_gib: float, spec: KVCacheSpec, block_size: int, max_num_seqs: int, max_model_len: int) -> int:
    """CPU pool: the budget (less the state slots), but no more than max_num_seqs full-length
    requests could ever use."""
    useful = max_num_seqs * -(-max_model_len // block_size) + 1
    budget = int(budget_gib * GiB) - spec.state_pool_bytes(max_num_seqs)
    return min(num_blocks_for_budget(budget, spec, block_size), useful)


def gpu_num_blocks(
    total_bytes: int,
    utilization: float,
    peak_torch_bytes: int,
    non_torch_bytes: int,
    spec: KVCacheSpec,
    block_size: int,
) -> int:
    """GPU pool: what is left of utilization * total after the profiled peak of a worst-case step
    (weights + activations + state slots and the speculative states, all allocated while profiling) and
    memory held outside PyTorch (CUDA context, NCCL...)."""
    budget = int(total_bytes * utilization) - peak_torch_bytes - non_torch_bytes
    return num_blocks_for_budget(budget, spec, block_size)
