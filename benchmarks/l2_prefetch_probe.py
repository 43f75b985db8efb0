"""Does prefetching weights into L2 on a side stream shorten a batch-1 decode chain on the GPU?

    python benchmarks/l2_prefetch_probe.py [--layers 24] [--rows 1] [--out probe.json]

A decode step at batch 1 is a serial chain of small kernels; each small matmul (8 MB of weight)
takes ~6 µs where its weight stream alone would take ~2 µs: the chain pays HBM latency and ramp-up
once per kernel. Weights do not depend on activations, so a side stream can start reading them
into L2 early, while the main chain runs latency-bound kernels; the matmul then reads L2.

The chain mimics a Yuan2-2B decoder layer (the matmul shapes; a norm-like elementwise kernel where
the layer has one), over --layers distinct weight sets (3.4 GB: nothing stays in L2 between
steps), captured in one CUDA graph. Variants differ only in what the side stream prefetches and
when, and how (`bulk`: cp.async.bulk.prefetch.L2 from a few threads; `load`: a streaming kernel
that loads with evict_last and discards). Prints µs per step for each.

Result on the H200 (2026-11-30, 24 layers, M=1): no prefetch 2127 µs; this layer's small weights
prefetched at its start (bulk) 2107; the next layer's during this MLP 2215 (bulk) / 2262 (load):
at best 1 %. A one-off measurement explained why: a cuBLAS 2048x2048 GEMV takes 4.9 µs with its
weight L2-resident against 6.0 µs from HBM, so the kernel, not the memory, is the fixed cost. What
did help is a different GEMV kernel (`pagoda/kernels/gemv.py`, `benchmarks/gemv_sweep.py`).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gemv_sweep import graph_us

H, I = 2048, 8192
# (name, out, in) per layer, in chain order; v is independent of the LF gate (on the side in the engine).
MATS = [("conv1", H // 2, 2 * H), ("conv2", H, H), ("qk", 2 * H, H), ("v", H, H), ("o", H, H),
        ("up_gate", 2 * I, H), ("down", H, I)]


@triton.jit
def _bulk_prefetch(base, nbytes, SUB: tl.constexpr, THREADS: tl.constexpr):
    # Each of THREADS lanes asks the TMA unit to pull SUB bytes into L2; nothing is loaded into the SM.
    offs = (tl.program_id(0) * THREADS + tl.arange(0, THREADS)).to(tl.int64) * SUB
    ptrs = base + offs
    size = tl.minimum(nbytes - offs, SUB).to(tl.int32)
    size = tl.where(size > 0, size, 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_prefetch(base, sink, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # Streams ITERS blocks per program through the SM with evict_last; keeps the sum only so the
    # loads are not dead code (sink is written only if the sum is exactly -1e30: never).
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    start = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(base + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    total = tl.sum(acc)
    if total == -1e30:
        tl.store(sink, total)


def prefetch(t: torch.Tensor, how: str, sink: torch.Tensor) -> None:
    if how == "bulk":
        sub, threads = 16384, 128
        nbytes = t.numel() * t.element_size()
        grid = (triton.cdiv(nbytes, sub * threads),)
        _bulk_prefetch[grid](t.view(torch.uint8), nbytes, SUB=sub, THREADS=threads, num_warps=4)
    else:
        block, iters = 2048, 16
        grid = (triton.cdiv(t.numel(), block * iters),)
        _load_prefetch[grid](t, sink, t.numel(), BLOCK=block, ITERS=iters, num_warps=8)


def build(layers: int, dev: str):
    return [{name: torch.randn(o, i, device=dev, dtype=torch.bfloat16) * 0.02 for name, o, i in MATS}
            for _ in range(layers)]


def step(ws, x, plan: str, how: str, side: torch.cuda.Stream, sink: torch.Tensor):
    """One decode step. plan: which weights the side stream prefetches, and where it is forked."""
    main = torch.cuda.current_stream()
    forked = []

    def fork(tensors):
        if not tensors or plan == "none":
            return
        forked.append(True)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for t in tensors:
                prefetch(t, how, sink)

    small = ["conv1", "conv2", "qk", "o"]
    if plan in ("next_small", "next_small_mlp"):
        fork([ws[0][n] for n in small])
    h = x
    for li, w in enumerate(ws):
        nxt = ws[li + 1] if li + 1 < len(ws) else None
        if plan == "this_small":
            fork([w[n] for n in small])
        xn = F.rms_norm(h, (H,))
        vb = xn @ w["v"].t()
        o1 = torch.cat([xn, xn], -1) @ w["conv1"].t()
        o2 = torch.cat([o1, o1], -1) @ w["conv2"].t()
        y = F.rms_norm(o2 + xn, (H,))
        qk = y @ w["qk"].t()
        if plan == "next_small_mlp":
            fork([w["up_gate"][: w["up_gate"].shape[0] // 4]])
        a = qk[:, :H] * 0.5 + qk[:, H:] * 0.5 + vb           # stands in for rope + attention
        h2 = a @ w["o"].t()
        hn = F.rms_norm(h2 + h, (H,))
        if plan in ("next_small", "next_small_mlp") and nxt is not None:
            fork([nxt[n] for n in small])
        ug = hn @ w["up_gate"].t()
        m = F.silu(ug[:, :I]) * ug[:, I:]
        h = m @ w["down"].t() + h2
    if forked:
        main.wait_stream(side)
    return h


def time_plan(ws, rows, plan, how):
    """(µs per step in a CUDA graph, whether the step's output equals the no-prefetch step's)."""
    side = torch.cuda.Stream()
    sink = torch.zeros(1, device="cuda")
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    us = graph_us(lambda: step(ws, x, plan, how, side, sink), calls=1, replays=30)
    same = torch.equal(step(ws, x, plan, how, side, sink), step(ws, x, "none", how, side, sink))
    return us, same


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rows", default="1")
    ap.add_argument("--out")
    args = ap.parse_args()
    ws = build(args.layers, "cuda")
    per_layer = sum(o * i * 2 for _, o, i in MATS)
    # copy bandwidth for the floor
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / (triton.testing.do_bench(lambda: dst.copy_(src)) * 1e-3)
    del src, dst
    floor_us = args.layers * per_layer / bw * 1e6
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; weight floor {floor_us:.0f} us/step", flush=True)
    rows_out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        for plan, how in [("none", "-"), ("this_small", "bulk"), ("next_small", "bulk"), ("next_small_mlp", "bulk"),
                          ("this_small", "load"), ("next_small", "load"), ("none", "-")]:
            try:
                best, same = time_plan(ws, rows, plan, how)
            except Exception as exc:     # noqa: BLE001 — a probe: report and go on
                print(f"rows={rows} {plan:15s} {how:5s} FAILED: {type(exc).__name__}: {exc}"[:400], flush=True)
                continue
            rows_out.append({"rows": rows, "plan": plan, "how": how, "best_us": best, "same_output": same})
            print(f"rows={rows:3d} {plan:15s} {how:5s} {best:8.1f} us  x{best / floor_us:.2f} floor  same={same}",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bandwidth": bw, "floor_us": floor_us, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
