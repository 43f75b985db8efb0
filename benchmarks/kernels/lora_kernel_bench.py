"""The LoRA shrink/expand pair against the matmul it rides on, per adapted layer of a model shape.

    python benchmarks/kernels/lora_kernel_bench.py [--shape llama-3-8b] [--tokens 64,256,8192]
        [--adapters 1,16] [--rank 16] [--tile 0,64,16] [--block-n 256,64] [--block-k 0,64,128] [--splits 0,16]
        [--warps 4] [--out FILE]

Each case is one layer's work at a step of T tokens given to A adapters in turn (`max_loras` 16 slots), timed
the way a step runs it: captured in a CUDA graph, cycling through enough copies of the weights (the base
matrix, and A and B) that none is still in L2. Prints µs for the base matmul alone and for `add_lora` alone, and
their ratio; the last line per case sums the layer's matmuls, so `lora / base` there is what the adapters add to
a decoder layer's matmul time (each line also gives the shrink launches alone). `--tile` / `--block-n` /
`--block-k` / `--splits` / `--warps` sweep the kernels' tile sizes (comma lists: every combination is timed; the
defaults are the shipped ones, 0 meaning the shipped rule: the tile by the step's size, the K block by the tile,
the split count by the step's tile count).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gemv_sweep import L2_DEFEAT_BYTES, graph_us  # noqa: E402  (this folder's graph timer)
from h200_shapes import QWEN2VL_7B_TEXT  # noqa: E402  (the benchmarks' shapes)
from h200_shapes import SHAPES as MODEL_SHAPES  # noqa: E402

# The shapes of benchmarks/h200_shapes.py this benchmark knows by name.
SHAPE_CONFIGS = {
    "llama-3-8b": MODEL_SHAPES["llama-3-8b"],
    "qwen2-vl-7b": MODEL_SHAPES["qwen2-vl-2b-text"] | QWEN2VL_7B_TEXT,
}


def layer_matmuls(cfg: dict) -> list[tuple[str, int, list[int]]]:
    """A decoder layer's adapted matmuls: (name, input features, output features of each adapted part)."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = hidden // cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    return [("qkv", hidden, [hidden, kv, kv]), ("o", hidden, [hidden]), ("gate_up", hidden, [inter, inter]),
            ("down", inter, [hidden])]  # fmt: skip


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    import numpy as np
    import torch

    from pagoda.kernels import lora as kernels
    from pagoda.lora.layers import LoRAStep

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPE_CONFIGS))
    ap.add_argument("--tokens", default="64,256,8192")
    ap.add_argument("--adapters", default="1,16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=16)
    ap.add_argument("--tile", default="0", help="tokens per tile (0: the step's rule, by T)")
    ap.add_argument("--block-n", default=str(kernels.BLOCK_N))
    ap.add_argument("--block-k", default="0", help="the shrink's K block (0: the launcher's rule)")
    ap.add_argument("--splits", default="0", help="shrink programs per tile (0: the kernel's rule)")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype, dev = torch.bfloat16, torch.device("cuda")
    rows, base_cache = [], {}
    for t, adapters in itertools.product(ints(args.tokens), ints(args.adapters)):
        configs = itertools.product(
            ints(args.tile), ints(args.block_n), ints(args.block_k), ints(args.splits), ints(args.warps)
        )
        for tile, block_n, block_k, splits, warps in configs:
            step = LoRAStep(args.max_loras, t, dev, **({"tile_sizes": (tile, tile)} if tile else {}))
            step.write(np.arange(t) % adapters)
            meta, order_at, tile = step.tiling(t)
            total_base = total_lora = 0.0
            for name, k, parts in layer_matmuls(SHAPE_CONFIGS[args.shape]):
                out = sum(parts)
                bounds = torch.tensor(np.cumsum([0, *parts]), dtype=torch.int32, device=dev)
                per_copy = out * k * 2 + args.max_loras * args.rank * (len(parts) * k + out) * 2
                copies = max(2, -(-L2_DEFEAT_BYTES // per_copy))
                ws = [torch.randn(out, k, device=dev, dtype=dtype) / k**0.5 for _ in range(copies)]
                a = [
                    torch.randn(len(parts), args.max_loras, args.rank, k, device=dev, dtype=dtype) / k**0.5
                    for _ in range(copies)
                ]
                b = [torch.randn(args.max_loras, out, args.rank, device=dev, dtype=dtype) for _ in range(copies)]
                x = torch.randn(t, k, device=dev, dtype=dtype)
                y = torch.zeros(t, out, device=dev, dtype=dtype)

                def base(ws=ws, x=x, y=y):
                    for w in ws:
                        torch.matmul(x, w.t(), out=y)

                tiles = {"block_n": block_n, "block_k": block_k or None, "splits": splits or None, "num_warps": warps}

                def lora(a=a, b=b, x=x, y=y, bounds=bounds, meta=meta, order_at=order_at, tile=tile, tiles=tiles):
                    for ai, bi in zip(a, b):
                        kernels.add_lora(x, y, ai, bi, bounds, meta, order_at, tile, **tiles)

                hs = [kernels.shrink_buffer(x, ai, tile, splits or None) for ai in a]

                def shrink(a=a, hs=hs, x=x, meta=meta, order_at=order_at, tile=tile, tiles=tiles):
                    for ai, hi in zip(a, hs):
                        kernels.shrink(
                            x, ai, meta, order_at, tile, block_k=tiles["block_k"], num_warps=tiles["num_warps"], h=hi
                        )

                if (t, name) not in base_cache:
                    base_cache[t, name] = graph_us(base, copies)
                base_us, lora_us, shrink_us = base_cache[t, name], graph_us(lora, copies), graph_us(shrink, copies)
                total_base, total_lora = total_base + base_us, total_lora + lora_us
                row = {"tokens": t, "adapters": adapters, "tile": tile, **tiles}
                times = {"base_us": round(base_us, 2), "lora_us": round(lora_us, 2), "shrink_us": round(shrink_us, 2)}
                rows.append(row | {"matmul": name} | times)
                print(
                    f"T={t:5d} A={adapters:2d} tile={tile:3d} bn={block_n:3d} bk={block_k:3d} s={splits:2d} w={warps} "
                    f"{name:8s} "
                    f"base {base_us:8.1f} us  lora {lora_us:8.1f} us (shrink {shrink_us:6.1f})  "
                    f"lora/base {lora_us / base_us:5.2f}",
                    flush=True,
                )
                del ws, a, b, hs
            rows.append(row | {"matmul": "layer", "base_us": round(total_base, 2), "lora_us": round(total_lora, 2)})
            ratio = total_lora / total_base
            print(f"  layer: base {total_base:.1f} us, lora {total_lora:.1f} us, lora/base {ratio:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "shape": args.shape, "rank": args.rank, "rows": rows}, f)


if __name__ == "__main__":
    main()
