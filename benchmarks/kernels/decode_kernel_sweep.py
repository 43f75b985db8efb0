"""Sweep the paged decode kernel's launch configuration on the GPU, per attention shape.

    python benchmarks/kernels/decode_kernel_sweep.py [--shapes yuan2-2b,qwen2-vl-2b] [--cases 64x168,512x640]
        [--layouts token,head] [--block-n 16,32,64,128] [--warps 1,2,4] [--stages 1,2,3] [--splits 2,4,8]
        [--max-model-len 2048] [--out sweep.json]

For each (heads, kv heads, head dim) of the benchmark shapes, batch and context length, times
`paged_decode_attention` (`triton.testing.do_bench`, scattered cache blocks, block size 16) under
every BLOCK_N x num_warps x num_stages (x split count: 1 and the one a CUDA-graph step picks), next to the memory floor
(K and V bytes read / measured copy bandwidth) and the current default. Prints the best per case;
the JSON holds every timing. `decode_config` in `pagoda/kernels/attention/decode.py` takes its rule
from these results.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: h200_shapes
from h200_shapes import copy_bandwidth  # noqa: E402

ATTENTION_SHAPES = {
    "yuan2-2b": (32, 32, 64),
    "qwen2-vl-2b": (12, 2, 128),
    "qwen2-vl-7b": (28, 4, 128),
    "llama-3-8b": (32, 8, 128),
}
CASES = "1x168,64x168,256x168,256x512,512x640"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="yuan2-2b,qwen2-vl-2b")
    ap.add_argument("--cases", default=CASES, help="BATCHxCONTEXT,...")
    ap.add_argument(
        "--layouts",
        default="token",
        help="token: cache [blocks, block_size, Hkv, D] (Pagoda's); head: [blocks, Hkv, block_size, D] "
        "storage seen through a permuted view (the kernels take strides)",
    )
    ap.add_argument("--block-n", default="16,32,64,128")
    ap.add_argument("--warps", default="1,2,4")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--splits", default="", help="split counts to try beside 1 and the graph's (e.g. 2,4,8)")
    ap.add_argument("--max-model-len", type=int, default=2048, help="what a CUDA-graph step sizes its splits by")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]

    def ints(text: str) -> list[int]:
        return [int(v) for v in text.split(",")]

    import torch
    import triton.testing

    from pagoda.kernels.attention import decode as pa

    bandwidth = copy_bandwidth()
    default = pa.decode_config
    results = []
    block = 16
    for shape in args.shapes.split(","):
        heads, kv_heads, dim = ATTENTION_SHAPES[shape]
        for (batch, context), layout in itertools.product(cases, args.layouts.split(",")):
            blocks_per = -(-(context + 1) // block)
            num_blocks = batch * blocks_per + 1
            if layout == "head":
                k_cache = torch.randn(num_blocks, kv_heads, block, dim, device="cuda", dtype=torch.bfloat16)
                v_cache = torch.randn_like(k_cache)
                k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
            else:
                k_cache = torch.randn(num_blocks, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
                v_cache = torch.randn_like(k_cache)
            perm = torch.randperm(num_blocks - 1, device="cuda")[: batch * blocks_per] + 1
            tables = perm.view(batch, blocks_per).int()
            seq_lens = torch.full((batch,), context + 1, device="cuda", dtype=torch.int32)
            q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
            floor_us = 2 * batch * (context + 1) * kv_heads * dim * 2 / bandwidth * 1e6
            # The split count a CUDA-graph decode step uses (max_seq_len = the max_model_len).
            graph_splits = pa.choose_num_splits(batch, kv_heads, args.max_model_len, pa.device_sm_count("cuda"))
            splits_options = sorted({1, graph_splits, *(ints(args.splits) if args.splits else [])})

            def run(cfg, splits, args=(q, k_cache, v_cache, tables, seq_lens, dim**-0.5)):
                pa.decode_config = lambda head_dim, num_splits=1, cfg=cfg: cfg
                try:
                    # In a CUDA graph, as decode steps run it: a per-call timing of a ~50 us kernel
                    # measures the host's launch path instead.
                    return 1e3 * triton.testing.do_bench_cudagraph(
                        lambda: pa.paged_decode_attention(*args, splits), rep=30
                    )
                finally:
                    pa.decode_config = default

            base = {s: run(default(dim, s), s) for s in splits_options}
            case = {
                "shape": shape,
                "batch": batch,
                "context": context,
                "layout": layout,
                "floor_us": floor_us,
                "graph_splits": graph_splits,
                "default": {str(s): us for s, us in base.items()},
                "configs": [],
            }
            for block_n, warps, stages, splits in itertools.product(
                ints(args.block_n), ints(args.warps), ints(args.stages), splits_options
            ):
                cfg = pa.DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages)
                try:
                    us = run(cfg, splits)
                except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is just skipped
                    print(f"  skip {cfg} splits={splits}: {type(exc).__name__}", flush=True)
                    continue
                case["configs"].append(
                    {"block_n": block_n, "num_warps": warps, "num_stages": stages, "splits": splits, "us": us}
                )
            best = min(case["configs"], key=lambda c: c["us"])
            case["best"] = best
            results.append(case)
            print(
                f"{shape:12s} B={batch:4d} ctx={context:4d} {layout:5s}: default {base[graph_splits]:7.1f} us "
                f"(graph splits {graph_splits}) | best {best['us']:7.1f} us BLOCK_N={best['block_n']} "
                f"warps={best['num_warps']} stages={best['num_stages']} splits={best['splits']} | "
                f"floor {floor_us:6.1f} us",
                flush=True,
            )
            del k_cache, v_cache
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bandwidth": bandwidth, "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
