"""Grammar masks on a batch of logits: tokens a row's grammar forbids get -inf before sampling.

A mask arrives packed, 32 tokens per int32 word (bit j of word w: token 32*w + j is allowed), the
format the grammar engine fills (`frontend.structured_output.manager`), for the whole batch with the
rows it constrains; unconstrained rows are left untouched. The unpacking runs in xgrammar's kernels
(C++ on the CPU, Triton on CUDA); `apply_token_bitmask_reference` is the plain PyTorch meaning of it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: list[int]) -> Tensor:
    """logits [B, V] (any float dtype) → a float32 [B, V] copy with the masked tokens of `rows` at -inf.
    bitmask: int32 [B, ceil(V/32)] on the host (page-locked for a GPU), all ones in the other rows."""
    import xgrammar as xgr  # lazy: only steps with constrained rows load the grammar engine

    masked = logits.float()
    if masked.data_ptr() == logits.data_ptr():
        masked = masked.clone()  # the caller's logits stay raw (logprobs are of the model's distribution)
    # On a GPU every row is masked (the others' all-ones rows change nothing): a list of row indices
    # would be copied from pageable memory, which blocks the host until the forward pass ends.
    indices = rows if masked.device.type == "cpu" else None
    xgr.apply_token_bitmask_inplace(
        masked, bitmask.to(masked.device, non_blocking=True), vocab_size=masked.shape[1], indices=indices
    )
    return masked


def apply_token_bitmask_reference(logits: Tensor, bitmask: Tensor, rows: list[int]) -> Tensor:
    """The same by unpacking every bit in PyTorch (tests compare the two)."""
    out = logits.float().clone()
    vocab = out.shape[1]
    token = torch.arange(vocab)
    for row in rows:
        words = bitmask[row].to(torch.int64)[token // 32]
        allowed = (words >> (token % 32)) & 1
        out[row, allowed.to(out.device) == 0] = float("-inf")
    return out
