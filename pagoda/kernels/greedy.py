"""Greedy sampling (argmax over the vocabulary) for few rows, in Triton.

Why: at batch 1 a decode step is GPU-bound, and after the captured graph PyTorch's `argmax` over a
135k vocabulary runs as one reduce kernel in which one block walks the whole row, plus a memset for
its semaphores (`benchmarks/profile/decode_profile.py` shows both outside the captured graph). Here
the row is cut into CHUNK-wide pieces, one program each, so the whole row is read at once; each
program reduces its piece to one 64-bit key and `atomic_max`es it into the row's slot; a second,
one-program kernel turns the keys into token ids and resets the slots for the next call.

The key orders exactly as `torch.argmax` does: by value as a float (NaN above everything, -0.0
equal to +0.0), then by the lower index. High 32 bits: the float32 value's bits made to sort as a
signed integer (negative values have their magnitude bits flipped); NaN: INT32_MAX. Low 32 bits:
INT32_MAX - index, so that on a tie in value the lower index has the larger key. Widening bf16 /
fp16 to float32 is exact and order-preserving, so the result equals torch.argmax on the input.

The reference is `torch.argmax(logits, dim=-1)` (tests/kernels/test_greedy.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import policy
from pagoda.kernels.triton_utils import DTYPES, interpreting

_EMPTY = -(2**63)  # a slot no program has written yet (the kernels spell it -9223372036854775807 - 1)


@triton.jit
def _argmax_keys_kernel(logits_ptr, keys_ptr, V, stride_row, CHUNK: tl.constexpr):
    """Program (row, chunk): the largest key of logits[row, chunk·CHUNK : (chunk+1)·CHUNK]."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=mask, other=0.0).to(tl.float32)
    x = x + 0.0  # -0.0 → +0.0: equal values tie on the index
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # sorts as the float does (arithmetic shift)
    ordered = tl.where(x != x, 0x7FFFFFFF, ordered)  # NaN: above every number, as torch.argmax
    key = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - offs).to(tl.int64)
    key = tl.where(mask, key, -9223372036854775807 - 1)
    tl.atomic_max(keys_ptr + row, tl.max(key, axis=0))


@triton.jit
def _keys_to_ids_kernel(keys_ptr, ids_ptr, rows, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < rows
    key = tl.load(keys_ptr + offs, mask=mask, other=0)
    tl.store(ids_ptr + offs, 0x7FFFFFFF - (key & 0xFFFFFFFF), mask=mask)
    tl.store(keys_ptr + offs, tl.full([BLOCK], -9223372036854775807 - 1, tl.int64), mask=mask)


class GreedyArgmax:
    """`torch.argmax(logits, dim=-1)` for at most `policy.GREEDY_MAX_ROWS` rows. Owns the key slots (int64, one per
    row, at _EMPTY between calls); calls run in stream order on one device, as the sampler's do."""

    def __init__(self) -> None:
        self._keys: torch.Tensor | None = None

    @staticmethod
    def supports(logits: torch.Tensor) -> bool:
        return (
            logits.dim() == 2
            and 0 < logits.shape[0] <= policy.GREEDY_MAX_ROWS
            and logits.dtype in DTYPES
            and logits.shape[1] > 0
            and logits.stride(1) == 1
            and (logits.is_cuda or interpreting())
        )

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        rows, vocab = logits.shape
        if not self.supports(logits):
            raise ValueError(
                f"greedy argmax takes 1..{policy.GREEDY_MAX_ROWS} rows of a float logits matrix with unit "
                f"column stride, got {tuple(logits.shape)} {logits.dtype}"
            )
        if self._keys is None or self._keys.device != logits.device:
            self._keys = torch.full((policy.GREEDY_MAX_ROWS,), _EMPTY, dtype=torch.int64, device=logits.device)
        chunk = 64 if interpreting() else 4096
        _argmax_keys_kernel[(rows, triton.cdiv(vocab, chunk))](
            logits, self._keys, vocab, logits.stride(0), CHUNK=chunk, num_warps=1 if interpreting() else 8
        )
        ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
        _keys_to_ids_kernel[(1,)](self._keys, ids, rows, BLOCK=policy.GREEDY_MAX_ROWS, num_warps=1)
        return ids
