"""FP8-weight matmuls on the GPU against bf16, per model matmul and row count.

    python benchmarks/kernels/fp8_linear_sweep.py [--shapes yuan2-2b,qwen2-vl-2b] [--rows 1,2,4,8,16,64,256]
                                                  [--gemv-rows 1,2,4,8] [--out sweep.json]

Timed as `gemv_sweep.py` times (a CUDA graph per matmul, weights cycled out of L2): bf16 through
Pagoda's bf16 path (`layers.linear.linear`: the GEMV at one row, cuBLAS above), the fp8 GEMV
(weight-only, W8A16) at the rows in --gemv-rows, and W8A8 at every row count two ways: per-token
quantization + `torch._scaled_mm` with scale vectors (`w8a8_rowwise`), and the same with unit
scales + Pagoda's scale epilogue (`w8a8`); plus `fp8_linear`, the dispatch the layers use. Each
fp8 result's relative error against its float32 reference (`fp8_linear_reference`) is printed: the
choice of `policy.FP8_GEMV_MAX_ROWS` (`pagoda/kernels/policy.py`) comes from this table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from benchmarks.kernels.gemv_sweep import L2_DEFEAT_BYTES, MATMULS, graph_us  # noqa: E402


def main() -> None:
    import torch

    from pagoda.kernels.fp8_quant import per_token_quant, scale_epilogue
    from pagoda.kernels.gemv import gemv
    from pagoda.layers.linear import linear
    from pagoda.layers.quantization.fp8 import fp8_linear, fp8_linear_reference, quantize_per_channel

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="yuan2-2b,qwen2-vl-2b")
    ap.add_argument("--rows", default="1,2,4,8,16,64,256")
    ap.add_argument("--gemv-rows", default="1,2,4,8")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("fp8_linear_sweep: needs a CUDA GPU")
        return
    gemv_rows = {int(r) for r in args.gemv_rows.split(",") if r}
    results = []
    for shape in args.shapes.split(","):
        for name, n, k, _ in MATMULS[shape]:
            if name.startswith("lf_") or name == "lm_head":
                continue  # stay bf16
            copies = max(2, -(-L2_DEFEAT_BYTES // (n * k)))
            bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
            quantized = [quantize_per_channel(w) for w in bf16]
            for m in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                wq, ws = quantized[0]
                ref_a16 = fp8_linear_reference(x, wq, ws, None, quantize_input=False).float()
                ref_a8 = fp8_linear_reference(x, wq, ws, None, quantize_input=True).float()
                row = {"shape": shape, "matmul": name, "n": n, "k": k, "rows": m}

                def rel(y, ref):
                    return ((y.float() - ref).norm() / ref.norm()).item()

                row["bf16_us"] = graph_us(lambda x=x, ws=bf16: [linear(x, w) for w in ws], copies)

                def scaled_mm(x=x, qs=quantized):
                    for wq_, ws_ in qs:
                        xq, xs = per_token_quant(x)
                        torch._scaled_mm(xq, wq_.t(), scale_a=xs, scale_b=ws_[None, :], out_dtype=x.dtype)

                row["w8a8_rowwise_us"] = graph_us(scaled_mm, copies)
                one = torch.ones((), device="cuda")

                def unit_scaled_mm(x=x, qs=quantized, one=one):
                    for wq_, ws_ in qs:
                        xq, xs = per_token_quant(x)
                        y = torch._scaled_mm(xq, wq_.t(), scale_a=one, scale_b=one, out_dtype=x.dtype)
                        scale_epilogue(y, xs, ws_, None)

                row["w8a8_us"] = graph_us(unit_scaled_mm, copies)
                xq, xs = per_token_quant(x)
                y8 = torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=x.dtype)
                scale_epilogue(y8, xs, ws, None)
                row["w8a8_rel_err"] = rel(y8, ref_a8)
                if m in gemv_rows:
                    row["w8a16_gemv_us"] = graph_us(
                        lambda x=x, qs=quantized: [gemv(x, wq_, weight_scale=ws_) for wq_, ws_ in qs], copies
                    )
                    row["w8a16_rel_err"] = rel(gemv(x, wq, weight_scale=ws), ref_a16)
                row["dispatch_us"] = graph_us(
                    lambda x=x, qs=quantized: [fp8_linear(x, wq_, ws_, None) for wq_, ws_ in qs], copies
                )
                results.append(row)
                gemv_part = ""
                if "w8a16_gemv_us" in row:
                    gemv_part = f" gemv {row['w8a16_gemv_us']:7.2f} (err {row['w8a16_rel_err']:.1e})"
                print(
                    f"{shape:11s} {name:8s} M={m:3d} bf16 {row['bf16_us']:7.2f} us "
                    f"| rowwise {row['w8a8_rowwise_us']:7.2f} "
                    f"| w8a8 {row['w8a8_us']:7.2f} "
                    f"(err {row['w8a8_rel_err']:.1e}){gemv_part} | dispatch {row['dispatch_us']:7.2f} "
                    f"x{row['bf16_us'] / row['dispatch_us']:.2f}",
                    flush=True,
                )
            bf16 = quantized = None
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
