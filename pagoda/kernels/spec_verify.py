"""Greedy verification of speculative proposals in one Triton launch.

Reference: `pagoda.spec_decode.rejection.verify_greedy` (PyTorch, a dozen launches: compare, mask, cumulative
product, sum, where, then the gather of each row's last token). A speculating step is read before the next one is
scheduled, so every launch's host time on its sampling path adds to the step; here one program per row does it all.

Shapes: target [R, K + 1] int64, the model's greedy token at each of a row's K + 1 positions; drafts [R, K] int64,
the row's proposals padded with -1 (a token id is never negative, so padding never matches and the count of real
proposals needs no tensor of its own). Outputs: tokens [R, K + 1] (the model's tokens up to and including the
first position whose proposal it does not share, -1 after), num [R] (that many tokens), last [R] (the row's last
token). Launchers never read device values on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["K"])  # one variant for every K (1 and multiples of 16 included)
def _verify_greedy_kernel(target_ptr, drafts_ptr, tokens_ptr, num_ptr, last_ptr, K, BLOCK: tl.constexpr):
    """Grid (R,): row r's first position where its proposal and the model's token differ (K: every proposal held,
    the last position is the model's bonus token)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    target = tl.load(target_ptr + row * (K + 1) + cols, mask=cols <= K, other=0)
    drafts = tl.load(drafts_ptr + row * K + cols, mask=cols < K, other=-1)  # position K: no proposal, a miss
    first = tl.min(tl.where(drafts != target, cols, BLOCK), axis=0)
    tl.store(tokens_ptr + row * (K + 1) + cols, tl.where(cols <= first, target, -1), mask=cols <= K)
    tl.store(num_ptr + row, (first + 1).to(tl.int64))
    tl.store(last_ptr + row, tl.sum(tl.where(cols == first, target, 0), axis=0))


def verify_greedy(target: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [R, K + 1], num [R], last [R]) for target [R, K + 1] and drafts [R, K] (-1 padded), both int64."""
    rows, k = drafts.shape
    if target.shape != (rows, k + 1) or target.dtype != torch.int64 or drafts.dtype != torch.int64:
        raise ValueError(f"verify_greedy: target {tuple(target.shape)} {target.dtype}, drafts {tuple(drafts.shape)}")
    target, drafts = target.contiguous(), drafts.contiguous()
    tokens = torch.empty_like(target)
    num = torch.empty(rows, dtype=torch.int64, device=target.device)
    last = torch.empty(rows, dtype=torch.int64, device=target.device)
    if rows:
        # K at run time, BLOCK at least 16: one compiled variant serves every step up to 15 proposals a row.
        block = max(16, triton.next_power_of_2(k + 1))
        _verify_greedy_kernel[(rows,)](target, drafts, tokens, num, last, k, BLOCK=block)
    return tokens, num, last
