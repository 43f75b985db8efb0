"""Where the Qwen2-VL vision tower's time goes on a GPU, per image, and which attention path is fastest.

    python benchmarks/profile/vision_tower_profile.py [--images 1 8] [--head-dims 64 80 96 128] [--lora-rank 16]
        [--out FILE.json]

Random bf16 weights of the tower (depth 32, width 1280, 16 heads: the same tower in 2B, 7B and 72B), each
image a 1000x750 picture (54 x 72 patches of 14 px = 3,888 patch rows, 972 placeholder tokens). For each
image count it prints:
  * the tower's forward time per image (CUDA events, median of 10 after warm-up), and the host's time to launch
    one forward (the call's wall time, no sync: when it is near the forward's time, the launches bound it);
  * the top kernels of one forward (torch.profiler), grouped into matmul / attention / elementwise;
  * the attention alone for one layer's shape through each SDPA backend that runs, and through
    nested-jagged SDPA (one call for images of different sizes).
With --head-dims, the attention of the largest image count at each head dim through cuDNN and flash, with the
TFLOP/s of the head dim's own work: whether a head dim of 80 (the tower's) costs what the next tile size costs.
With --lora-rank R, the forward again with one random rank-R adapter on every layer `--enable-tower-connector-lora`
adapts (the patch embedding, the blocks' qkv / proj / fc1 / fc2, the merger's MLP), every row mapped to it, as the
engine runs a call whose images all carry that adapter: its time per image against the base forward's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def build_tower(dtype: torch.dtype) -> torch.nn.Module:
    from pagoda.models.qwen2_vl_vision import Qwen2VisionTransformer, vision_config_with_defaults

    cfg = vision_config_with_defaults({"depth": 32, "embed_dim": 1280, "num_heads": 16}, text_hidden=1536)
    with torch.device("cuda"):
        tower = Qwen2VisionTransformer(cfg).to(dtype)
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return tower.eval()


def time_ms(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_table(fn, top: int = 15) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        cuda_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if cuda_us > 0 and e.key and not e.key.startswith("aten::"):
            rows.append((e.key[:90], cuda_us / 1000, e.count))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def attention_backends(n: int, length: int) -> dict[str, float]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(n, 16, length, 80, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    result = {}
    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ):
        try:
            with sdpa_kernel([backend]):
                result[name] = time_ms(lambda: F.scaled_dot_product_attention(q, k, v))
        except Exception as exc:  # noqa: BLE001 - a backend that does not run this shape
            result[name] = float("nan")
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:120]}")
    return result


def head_dim_sweep(n: int, length: int, dims: list[int]) -> list[dict]:
    """[n, 16, length, d] attention per head dim d: ms through cuDNN and flash, TFLOP/s of 4·n·16·L²·d."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for d in dims:
        q, k, v = (torch.randn(n, 16, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        row: dict = {"head_dim": d}
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel([backend]):
                    row[f"{name}_ms"] = time_ms(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v))
            except Exception:  # noqa: BLE001 - a backend that does not run this head dim
                row[f"{name}_ms"] = float("nan")
        row["cudnn_tflops"] = 4 * n * 16 * length**2 * d / row["cudnn_ms"] / 1e9
        rows.append(row)
        cudnn = f"cuDNN {row['cudnn_ms']:.3f} ms ({row['cudnn_tflops']:.0f} TFLOP/s)"
        print(f"  head dim {d:4d}: {cudnn}, flash {row['flash_ms']:.3f} ms")
    return rows


def host_ms(fn, repeats: int = 5) -> float:
    """Median wall time of the call itself, without waiting for the GPU afterwards."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    torch.cuda.synchronize()
    return statistics.median(times)


def attach_tower_adapter(tower: torch.nn.Module, rank: int) -> dict:
    """One random rank-`rank` adapter in slot 0 of every tower layer the engine adapts (`lora.manager.attach_lora` on
    a holder shaped like Qwen2-VL's model); returns {group: its row mapping (`EncoderLoRAStep`)}, none written."""
    from pagoda.config.lora import resolve_lora
    from pagoda.lora.manager import attach_lora
    from pagoda.models.qwen2_vl import Qwen2VLForConditionalGeneration

    holder = torch.nn.Module()
    holder.visual = tower
    holder.encoder_lora_groups = Qwen2VLForConditionalGeneration.encoder_lora_groups
    holder.packed_modules_mapping = {}
    config = resolve_lora(True, 1, rank, None, "auto", tower_connector=True)
    device, dtype = next(tower.parameters()).device, next(tower.parameters()).dtype
    layers, steps = attach_lora(holder, config, dtype, device, max_tokens=1)
    for slots in layers.values():
        width = slots.input_range[1]
        slots.set(0, {p.name: (torch.randn(rank, width) / width**0.5, torch.randn(p.size, rank)) for p in slots.parts})
    return steps


def map_all_rows(steps: dict, rows: int, merge: int) -> None:
    """Every row of a forward over `rows` patch rows to slot 0 (the merger's group sees one row per merge² ones)."""
    import numpy as np

    for group, step in steps.items():
        step.write(np.zeros(rows // merge**2 if group.endswith("merger.") else rows, dtype=np.int64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--head-dims", type=int, nargs="*", default=[], help="attention per head dim (see above)")
    parser.add_argument("--lora-rank", type=int, default=0, help="also time the forward with a tower adapter")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    tower = build_tower(torch.bfloat16)
    adapter_steps = attach_tower_adapter(tower, args.lora_rank) if args.lora_rank else {}
    grid = (1, 54, 72)
    patch_dim = 3 * 2 * 14 * 14
    report = {"gpu": torch.cuda.get_device_name(), "rows": []}
    for n in args.images:
        pixels = torch.randn(n * 54 * 72, patch_dim, device="cuda", dtype=torch.bfloat16)
        grids = [grid] * n

        def forward(pixels=pixels, grids=grids):
            with torch.inference_mode():
                return tower(pixels, grids)

        ms = time_ms(forward)
        launch = host_ms(forward)
        kernels = kernel_table(forward)
        attn = attention_backends(n, 54 * 72)
        row = {"images": n, "ms_per_image": ms / n, "ms": ms, "host_launch_ms": launch, "sdpa_one_layer_ms": attn}
        if adapter_steps:
            map_all_rows(adapter_steps, pixels.shape[0], merge=2)
            adapted = time_ms(forward)
            for step in adapter_steps.values():
                step.clear()
            row |= {"lora_rank": args.lora_rank, "adapted_ms_per_image": adapted / n}
        report["rows"].append(row | {"kernels": kernels})
        print(f"\n{n} image(s): tower {ms:.2f} ms, {ms / n:.2f} ms/image, launched in {launch:.2f} ms of host time;")
        if adapter_steps:
            rank = args.lora_rank
            print(f"  with a rank-{rank} adapter on every row: {adapted / n:.2f} ms/image ({adapted / ms:.2f}x)")
        print("  one layer's SDPA (x32 layers):")
        print("  " + ", ".join(f"{k} {v:.3f} ms ({32 * v:.1f})" for k, v in attn.items()))
        total = sum(r[1] for r in kernels)
        print(f"  top kernels ({total:.1f} ms of the listed):")
        for name, t, count in kernels:
            print(f"    {t:8.2f} ms {count:5d}x  {name}")
    if args.head_dims:
        print(f"\n{max(args.images)} image(s), one layer's attention per head dim:")
        report["head_dims"] = head_dim_sweep(max(args.images), 54 * 72, args.head_dims)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
