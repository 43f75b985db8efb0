"""The paged decode kernel over a bf16 cache against an fp8 (e4m3) cache, on the GPU.

    python benchmarks/kernels/kv_fp8_decode_bench.py [--shapes mha-16x128,yuan2-2b,llama-3-8b]
        [--cases 256x296] [--block-size 16] [--max-model-len 2048] [--out kv_fp8.json]

Why: `--kv-cache-dtype fp8` halves the bytes a decode step reads from the cache; the decode kernel is
bound by those bytes at large batches, so it should approach half the time, less the cost of
widening e4m3 to bf16 in registers. For each attention shape (heads, KV heads, head dim) and
BATCHxCONTEXT case it times one `paged_decode_attention` launch per cache dtype (a CUDA graph of the
launch replayed, so launch overhead is out; cache blocks scattered; the split count a CUDA-graph
step of that batch picks at --max-model-len), and one `store_kv` of the batch's new tokens. Next to
each: the memory floor (K and V bytes read / measured copy bandwidth) and, for fp8, the output's
relative error against the bf16 cache's (the cost of e4m3 on random data). Prints a table; --out
writes every row as JSON.

Shapes: mha-16x128 = hidden 2048 as 16 heads of 128, multi-head (16 KV heads); yuan2-2b = Yuan2-2B's
attention as Pagoda's other benchmarks give it (32 heads of 64, MHA); llama-3-8b = 32 query heads
over 8 KV heads of 128 (GQA).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

SHAPES = {"mha-16x128": (16, 16, 128), "yuan2-2b": (32, 32, 64), "llama-3-8b": (32, 8, 128)}
CASES = "256x296"


def time_case(shape: str, batch: int, context: int, args: argparse.Namespace, bandwidth: float | None) -> list[dict]:
    """Both cache dtypes for one shape and BATCHxCONTEXT: the decode launch and the store, µs each."""
    import torch

    from benchmarks.kernels.gemv_sweep import graph_us
    from pagoda.kernels.attention import decode as pa
    from pagoda.kernels.attention import store_kv as store

    heads, kv_heads, dim = SHAPES[shape]
    seq_len = context + 1  # the step's new token is stored first, then attended
    blocks_per = -(-seq_len // args.block_size)
    num_blocks = batch * blocks_per + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    cache_shape = (num_blocks, args.block_size, kv_heads, dim)
    k_bf16 = torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16, generator=g)
    v_bf16 = torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(num_blocks - 1, device="cuda", generator=g)[: batch * blocks_per] + 1
    tables = perm.view(batch, blocks_per).int()
    seq_lens = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    new_k = torch.randn(batch, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    new_v = torch.randn_like(new_k)
    slots = (tables[:, -1].long() * args.block_size + (seq_len - 1) % args.block_size).contiguous()
    splits = pa.choose_num_splits(batch, kv_heads, args.max_model_len, pa.device_sm_count("cuda"))
    counters = pa.SplitCounters().get(batch, kv_heads, "cuda")
    caches = {
        "bf16": (k_bf16, v_bf16, 1.0, 1.0),
        "fp8": (
            (k_bf16.float() / args.k_scale).clamp(-448, 448).to(store.FP8),
            (v_bf16.float() / args.v_scale).clamp(-448, 448).to(store.FP8),
            args.k_scale,
            args.v_scale,
        ),
    }
    rows, outputs = [], {}
    for name, (k_cache, v_cache, ks, vs) in caches.items():
        out = torch.empty_like(q)
        decode_args = (q, k_cache, v_cache, tables, seq_lens, dim**-0.5, splits)
        decode_kwargs = dict(k_scale=ks, v_scale=vs, out=out, split_counters=counters)
        store_args = (new_k, new_v, k_cache, v_cache, slots, ks, vs)
        decode_us = graph_us(lambda a=decode_args, kw=decode_kwargs: pa.paged_decode_attention(*a, **kw), 1)
        store_us = graph_us(lambda a=store_args: store.store_kv(*a), 1)
        pa.paged_decode_attention(*decode_args, **decode_kwargs)
        torch.cuda.synchronize()
        outputs[name] = out.float()
        read = 2 * batch * seq_len * kv_heads * dim * k_cache.element_size()
        err = None
        if name != "bf16":
            err = ((outputs[name] - outputs["bf16"]).norm() / outputs["bf16"].norm()).item()
        rows.append(
            {
                "shape": shape,
                "heads": heads,
                "kv_heads": kv_heads,
                "head_dim": dim,
                "batch": batch,
                "context": context,
                "block_size": args.block_size,
                "splits": splits,
                "cache_dtype": name,
                "decode_us": decode_us,
                "store_kv_us": store_us,
                "kv_bytes_read": read,
                "floor_us": read / bandwidth * 1e6 if bandwidth else None,
                "speedup_vs_bf16": rows[0]["decode_us"] / decode_us if rows else 1.0,
                "rel_err_vs_bf16": err,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--cases", default=CASES, help="BATCHxCONTEXT,... (context = cached tokens before this step)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048, help="fixes the split count, as a graph step's")
    ap.add_argument("--k-scale", type=float, default=0.02, help="the fp8 cache's k_scale (random data: ~N(0, 1))")
    ap.add_argument("--v-scale", type=float, default=0.02)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("kv_fp8_decode_bench: needs a CUDA GPU")
        return

    from benchmarks.h200_shapes import copy_bandwidth

    bandwidth = copy_bandwidth()
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    rows = []
    print(
        f"{'shape':11s} {'batch':>5s} {'ctx':>5s} {'cache':6s} {'splits':>6s} {'decode us':>10s} {'floor us':>9s} "
        f"{'vs bf16':>8s} {'store us':>9s} {'rel err':>8s}"
    )
    for shape in args.shapes.split(","):
        for batch, context in cases:
            for row in time_case(shape, batch, context, args, bandwidth):
                rows.append(row)
                floor = f"{row['floor_us']:9.1f}" if row["floor_us"] is not None else f"{'-':>9s}"
                err = "" if row["rel_err_vs_bf16"] is None else f"{row['rel_err_vs_bf16']:8.4f}"
                print(
                    f"{shape:11s} {batch:5d} {context:5d} {row['cache_dtype']:6s} {row['splits']:6d} "
                    f"{row['decode_us']:10.1f} {floor} {row['speedup_vs_bf16']:7.2f}x {row['store_kv_us']:9.1f} {err}",
                    flush=True,
                )
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
