"""The vision tower's attention when steps bring new shapes: what each shape's first call costs the host.

    python benchmarks/profile/vision_attention_first_calls.py [--counts 1 2 3 4 5 6 7 8 9 10 11 12]
        [--sizes 1000x750 640x480 1280x960] [--out FILE.json]

A served image step batches its n images of one size into one SDPA call of [n, 16 heads, L patch rows, 80]
(`models/qwen2_vl_vision._segment_attention`), once per layer. n changes from step to step with the arrivals,
and L with the image sizes, so a long-running server keeps meeting shapes it has not run yet. On Hopper
PyTorch's SDPA picks cuDNN, which builds and caches an execution plan per shape; the first call of a shape
pays that build on the engine's host thread while the GPU may idle. This times, for every (size, n) in order:

  * `sdpa`: PyTorch's own choice (cuDNN on sm90);
  * `sdpa-flash`: SDPA restricted to its FlashAttention backend (one kernel, no per-shape plan);
  * `varlen`: `torch.nn.attention.varlen.varlen_attn` over the n images packed as [n·L, 16, 80] with their
    cumulative lengths (FlashAttention's varlen kernel: mixed sizes in one call).

Per shape: the first call's host time (to the call's return; then a sync) and its wall time to completion,
then the steady call by CUDA events (`vision_tower_profile.time_ms`: median of 5 after warm-up). Totals at the
end: the host ms that new shapes cost each path over the whole sequence, and the steady ms of the same calls.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from vision_tower_profile import time_ms  # this folder's CUDA-event timer (median after warm-up)

HEADS, HEAD_DIM, PATCH, MERGE = 16, 80, 14, 2


def patch_rows(size: str) -> int:
    """Patch rows of one image of `size` (WxH) after Qwen2-VL's resize (multiples of 28 px)."""
    from pagoda.frontend.multimodal.image_processor import smart_resize

    width, height = (int(x) for x in size.split("x"))
    h, w = smart_resize(height, width, factor=PATCH * MERGE)
    return (h // PATCH) * (w // PATCH)


def call_for(path: str, n: int, length: int):
    """The attention of n images of `length` patch rows each through `path`, as a no-argument call."""
    q, k, v = (torch.randn(n * length, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if path == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        cu = torch.arange(0, (n + 1) * length, length, device="cuda", dtype=torch.int32)
        return lambda: varlen_attn(q, k, v, cu, cu, length, length)

    def batched(t: torch.Tensor) -> torch.Tensor:  # [n·L, heads, d] -> [n, heads, L, d], as the model reshapes
        return t.reshape(n, length, HEADS, HEAD_DIM).transpose(1, 2)

    qb, kb, vb = batched(q), batched(k), batched(v)
    if path == "sdpa":
        return lambda: F.scaled_dot_product_attention(qb, kb, vb)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flash():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(qb, kb, vb)

    return flash


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=list(range(1, 13)))
    parser.add_argument("--sizes", nargs="+", default=["1000x750", "640x480", "1280x960"])
    parser.add_argument("--paths", nargs="+", default=["varlen", "sdpa-flash", "sdpa"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    shapes = [(size, patch_rows(size), n) for size in args.sizes for n in args.counts]
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    totals = {path: [0.0, 0.0] for path in args.paths}  # first-call host ms, steady ms
    header = ("path", "size", "n", "rows", "first host ms", "first wall ms", "steady ms")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (10, 9, 3, 6, 14, 14, 10))))
    for path in args.paths:
        try:  # the path's libraries loaded and its handles made, on a shape the sequence never uses
            call_for(path, 1, 256)()
        except Exception as exc:  # noqa: BLE001 - a path this torch or GPU does not run
            print(f"{path:>10}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        for size, length, n in shapes:
            try:
                fn = call_for(path, n, length)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                steady = time_ms(fn, repeats=5)
            except Exception as exc:  # noqa: BLE001 - a path this torch or GPU does not run
                print(f"{path:>10} {size:>9} {n:>3}: {type(exc).__name__}: {str(exc)[:120]}")
                break
            row = {"path": path, "size": size, "images": n, "patch_rows": length}
            row |= {"first_host_ms": 1e3 * (t1 - t0), "first_wall_ms": 1e3 * (t2 - t0), "steady_ms": steady}
            report["rows"].append(row)
            totals[path][0] += row["first_host_ms"]
            totals[path][1] += steady
            print(
                f"{path:>10} {size:>9} {n:>3} {length:>6} {row['first_host_ms']:14.2f} {row['first_wall_ms']:14.2f}"
                f" {steady:10.3f}"
            )
    print("\n| path | new shapes | first calls' host ms | steady ms of the same calls | per layer-call, steady |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for path, (host, steady) in totals.items():
        print(f"| {path} | {len(shapes)} | {host:,.1f} | {steady:,.1f} | {steady / len(shapes):.3f} |")
    report["totals"] = {p: {"first_host_ms": h, "steady_ms": s} for p, (h, s) in totals.items()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
