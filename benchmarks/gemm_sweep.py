"""Decode-batch GEMMs on the GPU: cuBLAS (`F.linear`) vs `pagoda.kernels.tiled_gemm` tile configs.

    python benchmarks/gemm_sweep.py [--shapes yuan2-2b] [--rows 64,128,256,512] [--budget-s 300]
                                    [--out sweep.json]

For every weight matrix of a decoder layer of the shape and every row count M (the decode batch),
times one matmul the way a decode step runs it: inside a CUDA graph, cycling through enough copies
of the weight that none is still in L2. Prints microseconds and TFLOP/s for cuBLAS and for the best
Triton config of a grid, and writes every timing to --out (the data `tiled_gemm`'s dispatch rule is
fitted to).
"""

from __future__ import annotations

import argparse
import json
import time

# shape → [(matmul, N, K, bias)] per decoder layer.
MATMULS = {
    "yuan2-2b": [("qk", 4096, 2048, False), ("v", 2048, 2048, False), ("o", 2048, 2048, False),
                 ("lf_conv1", 1024, 4096, True), ("lf_conv2", 2048, 2048, True),
                 ("up_gate", 16384, 2048, False), ("down", 2048, 8192, False)],
    "llama-3-8b": [("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 28672, 4096, False),
                   ("down", 4096, 14336, False)],
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


def config_grid():
    from pagoda.kernels.tiled_gemm import GemmConfig

    tiles = [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (64, 256, 8), (128, 256, 8)]
    return [GemmConfig(bm, bn, bk, s, w, st) for bm, bn, w in tiles for bk in (64, 128)
            for s in (1, 2, 4) for st in (3, 4) if not (bk == 128 and bm * bn >= 128 * 256)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="yuan2-2b")
    ap.add_argument("--rows", default="64,128,256,512")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop sweeping configs after this long")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from pagoda.kernels import tiled_gemm as tg

    grid = config_grid()
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    started = time.perf_counter()
    print(f"{'shape':10} {'matmul':9} {'M':>4} {'N':>6} {'K':>6} | {'cuBLAS us':>9} {'TF/s':>5} | "
          f"{'best us':>8} {'TF/s':>5} {'x':>5} config", flush=True)
    for shape in args.shapes.split(","):
        for name, n, k, has_bias in MATMULS[shape]:
            nbytes = n * k * 2
            copies = max(1, -(-L2_DEFEAT_BYTES // nbytes))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
            biases = [torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
                      for _ in range(copies)]
            for m in rows_list:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x, weights[0], biases[0]).float()
                cublas = time_graph(lambda i: F.linear(x, weights[i], biases[i]), copies)
                timings = {}
                for cfg in grid:
                    if time.perf_counter() - started > args.budget_s:
                        break
                    try:
                        got = tg.tiled_linear(x, weights[0], biases[0], cfg).float()
                        err = float((got - ref).abs().max() / ref.abs().max())
                        if err > 2e-2:
                            print(f"  {cfg.label()}: wrong (rel err {err:.3g})", flush=True)
                            continue
                        timings[cfg.label()] = time_graph(
                            lambda i, cfg=cfg: tg.tiled_linear(x, weights[i], biases[i], cfg), copies, repeats=3)
                    except Exception as exc:         # noqa: BLE001 - out of shared memory etc.: not a candidate
                        torch.cuda.synchronize()
                        print(f"  {cfg.label()}: {type(exc).__name__}", flush=True)
                best_label, best = min(timings.items(), key=lambda kv: kv[1]) if timings else ("-", float("nan"))
                results.append(dict(shape=shape, matmul=name, m=m, n=n, k=k, bias=has_bias, cublas_us=cublas,
                                    best_us=best, best_config=best_label, timings=timings))
                tf = lambda us: 2 * m * n * k / us / 1e6           # noqa: E731 - TFLOP/s
                print(f"{shape:10} {name:9} {m:4} {n:6} {k:6} | {cublas:9.2f} {tf(cublas):5.0f} | "
                      f"{best:8.2f} {tf(best):5.0f} {cublas / best:5.2f} {best_label}", flush=True)
            del weights, biases
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
