"""Yuan2's localized filter (LF) gate on decode steps, where every row is one token: the gate's state
shifts fused into the norms around its two GEMMs, two launches per layer fewer. The kernels of
`pagoda/layers/localized_filter.py`, named after it; only Yuan2 uses them.

References: the layer's unfused path — the layernorms (`pagoda.layers.norm.rms_norm_reference`) plus
`LocalizedFilter`'s PyTorch gather / concatenate / scatter of the state rows (pure copies). The norms
round as `pagoda/kernels/rms_norm.py` does.

Launchers check shapes/dtypes/strides and launch; they never read device values on the host. Kernels
may not import layers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.pdl import wait_for_inputs
from pagoda.kernels.rms_norm import MAX_NORM_SIZE, rms_weighted
from pagoda.kernels.triton_utils import DTYPES, interpreting, round_to


@triton.jit
def _lf_decode_in_kernel(
    h_ptr,
    residual_ptr,
    weight_ptr,
    summed_ptr,
    bias_ptr,
    state_ptr,
    slots_ptr,
    snap_ptr,
    snapshots_ptr,
    in1_ptr,
    in2_ptr,
    stride_h,
    stride_r,
    stride_s,
    stride_state,
    stride_snap,
    stride_in1,
    stride_in2,
    eps,
    H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_SNAPSHOT: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row b (sequence in state slot s):
    x = input_layernorm(h [+ residual]) (the sum stored to summed), then
    in1[b] = [state[s, :H] | x], in2[b] = [state[s, H:] | conv1 bias], state[s, :H] = x
    (and the snapshot's). in2's right half is where conv1's GEMM accumulates o1."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + r.to(tl.float32), h_ptr, EMULATE_BF16)
        tl.store(summed_ptr + row * stride_s + offs, x, mask=mask)
    x = rms_weighted(x, weight_ptr, offs, mask, eps, H, in1_ptr, EMULATE_BF16)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    offs_half = tl.arange(0, BLOCK_HALF)
    mask_half = offs_half < HALF
    saved = state_ptr + slot * stride_state
    x_prev = tl.load(saved + offs, mask=mask, other=0.0)
    o1_prev = tl.load(saved + H + offs_half, mask=mask_half, other=0.0)
    tl.store(in1_ptr + row * stride_in1 + offs, x_prev, mask=mask)
    tl.store(in1_ptr + row * stride_in1 + H + offs, x, mask=mask)
    tl.store(in2_ptr + row * stride_in2 + offs_half, o1_prev, mask=mask_half)
    tl.store(
        in2_ptr + row * stride_in2 + HALF + offs_half, tl.load(bias_ptr + offs_half, mask=mask_half), mask=mask_half
    )
    tl.debug_barrier()  # every lane has read the old state before any lane overwrites it
    tl.store(saved + offs, x, mask=mask)
    if HAS_SNAPSHOT:
        snap = tl.load(snap_ptr + row).to(tl.int64)
        tl.store(snapshots_ptr + snap * stride_snap + offs, x, mask=mask)


@triton.jit
def _lf_decode_out_kernel(
    o2_ptr,
    x_ptr,
    weight_ptr,
    out_ptr,
    o1_ptr,
    state_ptr,
    slots_ptr,
    snap_ptr,
    snapshots_ptr,
    stride_o2,
    stride_x,
    stride_out,
    stride_o1,
    stride_state,
    stride_snap,
    eps,
    H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_SNAPSHOT: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row b: out[b] = output_layernorm(o2[b] + x[b]); state[s, H:] = o1[b]
    (and the snapshot's)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    o2 = tl.load(o2_ptr + row * stride_o2 + offs, mask=mask, other=0.0)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    summed = round_to(o2.to(tl.float32) + x.to(tl.float32), o2_ptr, EMULATE_BF16)
    tl.store(
        out_ptr + row * stride_out + offs,
        rms_weighted(summed, weight_ptr, offs, mask, eps, H, out_ptr, EMULATE_BF16),
        mask=mask,
    )
    offs_half = tl.arange(0, BLOCK_HALF)
    mask_half = offs_half < HALF
    o1 = tl.load(o1_ptr + row * stride_o1 + offs_half, mask=mask_half, other=0.0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    tl.store(state_ptr + slot * stride_state + H + offs_half, o1, mask=mask_half)
    if HAS_SNAPSHOT:
        snap = tl.load(snap_ptr + row).to(tl.int64)
        tl.store(snapshots_ptr + snap * stride_snap + H + offs_half, o1, mask=mask_half)


def supports_lf_decode(h: torch.Tensor, norm_weight: torch.Tensor, state: torch.Tensor) -> bool:
    """h [B, H] one token per row; state [S, 1.5·H] = [x_prev | o1_prev] per slot."""
    hidden = h.shape[-1] if h.dim() == 2 else 0
    return (
        h.dim() == 2
        and h.dtype in DTYPES
        and h.stride(1) == 1
        and hidden % 2 == 0
        and 0 < hidden <= MAX_NORM_SIZE
        and norm_weight.dtype == h.dtype
        and norm_weight.shape == (hidden,)
        and state.dim() == 2
        and state.dtype == h.dtype
        and state.stride(1) == 1
        and state.shape[1] == hidden + hidden // 2
        and state.device == h.device == norm_weight.device
    )


def _snapshot_args(
    snapshot_index: torch.Tensor | None, snapshots: torch.Tensor | None, state: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    if snapshot_index is None:
        return slots, state, 0  # placeholders, never read (HAS_SNAPSHOT false)
    assert snapshots is not None and snapshots.stride(1) == 1 and snapshots.shape[1] == state.shape[1]
    return snapshot_index, snapshots, snapshots.stride(0)


def lf_decode_input(
    h: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    conv1_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    snapshot_index: torch.Tensor | None = None,
    snapshots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoder layer's input norm and the LF gate's input shifts in one launch, for one-token rows.

    h [B, H] (+ residual [B, H]: the norm sees round(h + residual), which is returned as the new
    residual stream; without it h is the stream). Returns (in1 [B, 2H], in2 [B, H], residual) with
    x = input_layernorm(...) = in1[:, H:]:
      in1 = [x_prev | x]            conv1's input (x_prev = state[slots, :H])
      in2 = [o1_prev | conv1 bias]  conv2's input once conv1 has accumulated into in2[:, H/2:]
    and writes state[slots, :H] = x (and snapshots[snapshot_index, :H]). The reference is the layer's
    unfused path: `input_layernorm`, then `index_select` / `cat` / `index_copy_` on the state."""
    assert supports_lf_decode(h, norm_weight, state), "unsupported lf_decode_input arguments"
    rows, hidden = h.shape
    half = hidden // 2
    assert conv1_bias.shape == (half,) and conv1_bias.dtype == h.dtype and conv1_bias.is_contiguous()
    if residual is not None:
        assert residual.shape == h.shape and residual.dtype == h.dtype and residual.stride(1) == 1
    in1 = torch.empty(rows, 2 * hidden, dtype=h.dtype, device=h.device)
    in2 = torch.empty(rows, hidden, dtype=h.dtype, device=h.device)
    summed = torch.empty_like(h) if residual is not None else h
    if rows:
        snap_index, snaps, stride_snap = _snapshot_args(snapshot_index, snapshots, state, slots)
        block = triton.next_power_of_2(hidden)
        r = residual if residual is not None else h
        _lf_decode_in_kernel[(rows,)](
            h,
            r,
            norm_weight,
            summed,
            conv1_bias,
            state,
            slots,
            snap_index,
            snaps,
            in1,
            in2,
            h.stride(0),
            r.stride(0),
            summed.stride(0),
            state.stride(0),
            stride_snap,
            in1.stride(0),
            in2.stride(0),
            float(eps),
            H=hidden,
            HALF=half,
            BLOCK=block,
            BLOCK_HALF=triton.next_power_of_2(half),
            HAS_RESIDUAL=residual is not None,
            HAS_SNAPSHOT=snapshot_index is not None,
            EMULATE_BF16=interpreting(),
            num_warps=min(max(block // 512, 1), 16),
            enable_fp_fusion=False,
            **pdl.launch_args(h),
        )
    return in1, in2, summed


def lf_decode_output(
    o2: torch.Tensor,
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    o1: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    snapshot_index: torch.Tensor | None = None,
    snapshots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The LF gate's output norm, output_layernorm(o2 + x) [B, H], with the state update
    state[slots, H:] = o1 [B, H/2] (and snapshots[snapshot_index, H:]) in the same launch.
    x and o1 may be strided row views (unit stride along features)."""
    assert supports_lf_decode(o2, norm_weight, state), "unsupported lf_decode_output arguments"
    rows, hidden = o2.shape
    half = hidden // 2
    assert x.shape == o2.shape and x.stride(1) == 1 and o1.shape == (rows, half) and o1.stride(1) == 1
    out = torch.empty_like(o2)
    if rows:
        snap_index, snaps, stride_snap = _snapshot_args(snapshot_index, snapshots, state, slots)
        block = triton.next_power_of_2(hidden)
        _lf_decode_out_kernel[(rows,)](
            o2,
            x,
            norm_weight,
            out,
            o1,
            state,
            slots,
            snap_index,
            snaps,
            o2.stride(0),
            x.stride(0),
            out.stride(0),
            o1.stride(0),
            state.stride(0),
            stride_snap,
            float(eps),
            H=hidden,
            HALF=half,
            BLOCK=block,
            BLOCK_HALF=triton.next_power_of_2(half),
            HAS_SNAPSHOT=snapshot_index is not None,
            EMULATE_BF16=interpreting(),
            num_warps=min(max(block // 512, 1), 16),
            enable_fp_fusion=False,
            **pdl.launch_args(o2),
        )
    return out
