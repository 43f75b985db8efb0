"""Sweep the paged decode kernel's launch configuration on the GPU, per attention shape.

    python benchmarks/decode_kernel_sweep.py [--out sweep.json]

For each (heads, kv heads, head dim) of the benchmark shapes, batch and context length, times
`paged_decode_attention` the way a decode step runs it: launched from a CUDA graph, its blocks
scattered over a cache of engine size (--cache-gib), cycling through four disjoint block sets so
the keys are not still in L2 from the last launch. Every kv_per_program x BLOCK_N x num_warps x
num_stages (x split count: 1 and the one a CUDA-graph step picks) is timed, next to the memory floor
(K and V bytes read / measured copy bandwidth) and the current default. Prints the best per case;
the JSON holds every timing. `decode_config` in `pagoda/kernels/paged_attention.py` takes its rule
from these results.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h200_shapes import copy_bandwidth  # noqa: E402

ATTENTION_SHAPES = {"yuan2-2b": (32, 32, 64), "qwen2-vl-2b": (12, 2, 128), "llama-3-8b": (32, 8, 128)}
CASES = [(1, 168), (64, 168), (128, 168), (256, 168), (256, 512), (64, 1024)]


def time_in_graph(fn, variants: int, calls: int = 24, repeats: int = 5) -> float:
    """Microseconds per fn(i) (i cycling over variants), launched from one CUDA graph as a decode step
    launches it: no Python launch cost in the time, which otherwise dominates small batches."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(variants):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % variants)
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
    ap.add_argument("--shapes", default="yuan2-2b,qwen2-vl-2b")
    ap.add_argument("--cache-gib", type=float, default=24.0,
                    help="size of the K (and of the V) cache the used blocks are scattered over, like the engine's")
    ap.add_argument("--quick", action="store_true", help="a smaller grid (warps 4/8, stages 2/3)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from pagoda.kernels import paged_attention as pa

    bandwidth = copy_bandwidth()
    sms = pa.device_sm_count("cuda")
    results = []
    block = 16
    variants = 4      # disjoint block sets cycled through, so a case's K/V is not still in L2
    for shape in args.shapes.split(","):
        heads, kv_heads, dim = ATTENTION_SHAPES[shape]
        block_bytes = block * kv_heads * dim * 2
        num_blocks = int(args.cache_gib * 2**30 // block_bytes)
        k_cache = torch.empty(num_blocks, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.empty_like(k_cache)
        for batch, context in CASES:
            blocks_per = -(-(context + 1) // block)
            used = variants * batch * blocks_per
            perm = torch.randperm(num_blocks - 1, device="cuda")[:used] + 1
            k_cache[perm] = torch.randn(used, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
            v_cache[perm] = torch.randn(used, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
            tables = perm.view(variants, batch, blocks_per).int()
            seq_lens = torch.full((batch,), context + 1, device="cuda", dtype=torch.int32)
            q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            floor_us = 2 * batch * (context + 1) * kv_heads * dim * 2 / bandwidth * 1e6
            # The split count a CUDA-graph decode step uses (max_seq_len = a 2048 max_model_len).
            graph_splits = pa.choose_num_splits(batch, kv_heads, 2048, sms)
            splits_options = sorted({1, graph_splits})

            def run(cfg, splits):
                return time_in_graph(lambda i: pa.paged_decode_attention(
                    q, k_cache, v_cache, tables[i], seq_lens, dim ** -0.5, splits, out=out, config=cfg), variants)

            default_cfg = pa.decode_config(dim, heads // kv_heads, kv_heads)
            base = {s: run(default_cfg, s) for s in splits_options}
            case = {"shape": shape, "batch": batch, "context": context, "floor_us": floor_us,
                    "graph_splits": graph_splits, "default": {str(s): us for s, us in base.items()}, "configs": []}
            kvps = [p for p in (1, 2, 4, 8) if kv_heads % p == 0]
            grid = itertools.product(kvps, (16, 32, 64), (4, 8) if args.quick else (2, 4, 8),
                                     (2, 3) if args.quick else (1, 2, 3), splits_options)
            for kvp, block_n, warps, stages, splits in grid:
                cfg = pa.DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages, kv_per_program=kvp)
                try:
                    us = run(cfg, splits)
                except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is just skipped
                    print(f"  skip {cfg} splits={splits}: {type(exc).__name__}", flush=True)
                    torch.cuda.synchronize()
                    continue
                case["configs"].append({"kv_per_program": kvp, "block_n": block_n, "num_warps": warps,
                                        "num_stages": stages, "splits": splits, "us": us})
            best = min(case["configs"], key=lambda c: c["us"])
            case["best"] = best
            by_kvp = {p: min(c["us"] for c in case["configs"] if c["kv_per_program"] == p and c["splits"] == graph_splits)
                      for p in kvps}
            case["best_by_kv_per_program"] = by_kvp
            results.append(case)
            print(f"{shape:12s} B={batch:4d} ctx={context:4d}: default {base[graph_splits]:7.1f} us "
                  f"(graph splits {graph_splits}) | best {best['us']:7.1f} us kvp={best['kv_per_program']} "
                  f"BLOCK_N={best['block_n']} warps={best['num_warps']} stages={best['num_stages']} "
                  f"splits={best['splits']} | by kvp " + " ".join(f"{p}:{us:.1f}" for p, us in by_kvp.items())
                  + f" | floor {floor_us:6.1f} us", flush=True)
        del k_cache, v_cache
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bandwidth": bandwidth, "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
