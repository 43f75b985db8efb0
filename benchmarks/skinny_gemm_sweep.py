"""Few-row GEMMs on the GPU: cuBLAS (`F.linear`) vs `pagoda.kernels.skinny_gemm`, per model matmul.

    python benchmarks/skinny_gemm_sweep.py [--shapes yuan2-2b,...] [--rows 1,4,16,64] [--sweep-rows 1,16,64]
                                           [--out sweep.json]

For every weight matrix of a decoder layer (and the lm_head) of the benchmark shapes and every row
count M, times one matmul the way a decode step runs it: inside a CUDA graph (no launch overhead
from Python), cycling through enough copies of the weight that none of them is still in L2 (a
decode step reads each layer's weights once, from HBM). Prints microseconds and the weight-stream
bandwidth (weight bytes / time) for cuBLAS, the kernel's rule config (`skinny_config`) and, for the
`--sweep-rows`, the best of a grid of configs. `skinny_config` and `SKINNY_MAX_ROWS` take their rule
from these numbers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

# name → [(matmul, N, K, bias)] per decoder layer, and the lm_head.
MATMULS = {
    "yuan2-2b": [("lf_conv1", 1024, 4096, True), ("lf_conv2", 2048, 2048, True), ("qk", 4096, 2048, False),
                 ("v", 2048, 2048, False), ("o", 2048, 2048, False), ("up_gate", 16384, 2048, False),
                 ("down", 2048, 8192, False), ("lm_head", 135040, 2048, False)],
    "qwen2-vl-2b": [("qkv", 2048, 1536, True), ("o", 1536, 1536, False), ("gate_up", 17920, 1536, False),
                    ("down", 1536, 8960, False), ("lm_head", 151936, 1536, False)],
    "llama-3-8b": [("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 28672, 4096, False),
                   ("down", 4096, 14336, False), ("lm_head", 128256, 4096, False)],
}
L2_DEFEAT_BYTES = 384 * 2**20      # the H200's L2 is 50 MB; cycle through at least this many bytes


def time_graph(fn, copies: int, repeats: int = 5) -> float:
    """Microseconds per call of fn(i) for i cycling over copies, captured in one CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):          # compile / warm up outside the capture
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    calls = max(copies, 24)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="yuan2-2b,qwen2-vl-2b,llama-3-8b")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--sweep-rows", default="1,16,64", help="row counts that also try the config grid")
    ap.add_argument("--sweep-shapes", default="yuan2-2b")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping configs after this long")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from pagoda.kernels import skinny_gemm as sg

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = [sg.SkinnyConfig(bn, bk, sk, w, st) for bn, bk, sk, w, st in itertools.product(
        (16, 32, 64), (128, 256, 512), (1, 2, 4, 8), (4, 8), (3, 5))]
    rows_list = [int(r) for r in args.rows.split(",")]
    sweep_rows = {int(r) for r in args.sweep_rows.split(",") if r}
    sweep_shapes = set(args.sweep_shapes.split(","))
    results = []
    started = time.perf_counter()
    print(f"{'shape':12} {'matmul':9} {'M':>4} {'N':>6} {'K':>6} | {'cuBLAS us':>9} {'TB/s':>5} | "
          f"{'rule us':>8} {'TB/s':>5} {'x':>5} | {'best us':>8} config")
    for shape in args.shapes.split(","):
        for name, n, k, has_bias in MATMULS[shape]:
            nbytes = n * k * 2
            copies = max(1, -(-L2_DEFEAT_BYTES // nbytes))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
            biases = [torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
                      for _ in range(copies)]
            for m in rows_list:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x, weights[0], biases[0])
                cublas = time_graph(lambda i: F.linear(x, weights[i], biases[i]), copies)
                rule_cfg = sg.skinny_config(m, n, k, sms)
                got = sg.skinny_linear(x, weights[0], biases[0], rule_cfg)
                err = float((got.float() - ref.float()).abs().max())
                rule = time_graph(lambda i: sg.skinny_linear(x, weights[i], biases[i], rule_cfg), copies)
                best, best_cfg = rule, rule_cfg
                if m in sweep_rows and shape in sweep_shapes and time.perf_counter() - started < args.budget_s:
                    for cfg in grid:
                        try:
                            t = time_graph(lambda i, cfg=cfg: sg.skinny_linear(x, weights[i], biases[i], cfg),
                                           copies, repeats=3)
                        except Exception:         # noqa: BLE001 - out of shared memory etc.: not a candidate
                            torch.cuda.synchronize()
                            continue
                        if t < best:
                            best, best_cfg = t, cfg
                row = dict(shape=shape, matmul=name, m=m, n=n, k=k, bias=has_bias, weight_bytes=nbytes,
                           cublas_us=cublas, rule_us=rule, rule_config=rule_cfg.__dict__, best_us=best,
                           best_config=best_cfg.__dict__, max_abs_diff_vs_cublas=err)
                results.append(row)
                bw = lambda us: nbytes / us / 1e6           # noqa: E731 - TB/s
                c = best_cfg
                print(f"{shape:12} {name:9} {m:4} {n:6} {k:6} | {cublas:9.2f} {bw(cublas):5.2f} | "
                      f"{rule:8.2f} {bw(rule):5.2f} {cublas / rule:5.2f} | {best:8.2f} "
                      f"n{c.block_n} k{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}", flush=True)
            del weights, biases
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
