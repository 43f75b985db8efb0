"""Where an image request's time goes in Pagoda's engine: preprocessing, the vision tower, prefill of the
placeholder tokens, and decode steps slowed by the image prefills sharing them.

    python benchmarks/profile/image_step_profile.py [--shape 2b] [--concurrency 16 64] [--output-len 128]

The workload of benchmarks/models/qwen2vl_image_throughput.py (one 1000x750 random image + 20 text tokens
in, 128 out, a new request whenever one finishes, random bf16 weights of the Qwen2-VL-2B shape), through
the offline `LLMEngine`. Each step is timed to the end of its GPU work (a device sync after `step()`, so
steps do not overlap: absolute rates are below the served ones) and classified by what it ran: decode
rows only, or prefill tokens (with or without vision-tower work). The vision tower's own time is measured
inside the step (synchronised around `model.encode`). Prints one table per concurrency: the share of the
run in each kind of step, the mean step time per kind, and the per-image costs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))
from qwen2vl_image_throughput import IMAGE_PAD, VIDEO_PAD, free_gpu, make_engine, make_requests, sync, write_config  # noqa: E402


def profile(folder: str, requests, concurrency: int, output_len: int, kernels: int = 0) -> dict:
    from pagoda.frontend.multimodal.prompt import PlaceholderIds, expand_prompt
    from pagoda.sampling_params import SamplingParams

    engine = make_engine(folder)
    model = engine.runner.model
    encode = model.encode
    encoder_s = [0.0]
    encoded = [0]

    def timed_encode(pixels, grid):
        sync()
        t = time.perf_counter()
        out = encode(pixels, grid)
        sync()
        encoder_s[0] += time.perf_counter() - t
        encoded[0] += len(grid)
        return out

    model.encode = timed_encode
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    placeholders = PlaceholderIds(IMAGE_PAD, VIDEO_PAD)
    prepared = [expand_prompt(ids, [("image", v)], placeholders, "profile") for ids, v in requests]
    # What each step scheduled: one-token rows (decodes) and the tokens of longer rows (prefill chunks).
    schedule = engine.scheduler.schedule
    last = [(0, 0)]

    def recording_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        tokens = out.num_scheduled_tokens.values()
        last[0] = (sum(1 for n in tokens if n == 1), sum(n for n in tokens if n > 1))
        return out

    engine.scheduler.schedule = recording_schedule

    def drive(batch, limit: int, prefix: str) -> tuple[float, list[tuple[str, float, int, int]]]:
        rows: list[tuple[str, float, int, int]] = []  # kind, seconds, decode rows, prefill tokens
        pending, live = list(enumerate(batch)), 0
        t0 = time.perf_counter()
        while pending or engine.has_unfinished_requests():
            while pending and live < limit:
                index, (ids, mm) = pending.pop(0)
                engine.add_request(f"{prefix}{index}", ids, params, mm_inputs=mm)
                live += 1
            images_before = encoded[0]
            sync()
            t = time.perf_counter()
            outs = engine.step()
            sync()
            dt = time.perf_counter() - t
            live -= sum(1 for o in outs if o.finished)
            decode_rows, prefill_tokens = last[0]
            kind = (
                "decode only"
                if not prefill_tokens
                else "prefill, vision tower"
                if encoded[0] > images_before
                else "prefill"
            )
            rows.append((kind, dt, decode_rows, prefill_tokens))
        return time.perf_counter() - t0, rows

    drive(prepared[:2], 2, "warm")
    encoder_s[0], encoded[0] = 0.0, 0
    if not kernels:
        total, rows = drive(prepared, concurrency, "q")
    else:
        # Which GPU kernels the run's time goes to: the tower's and the language model's side by side.
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            total, rows = drive(prepared, concurrency, "q")
        print_kernels(prof, total, kernels)
    engine = model = None  # the closures above hold both: free_gpu() collects the cycle
    return {"total_s": total, "rows": rows, "images": len(prepared), "encoder_s": encoder_s[0]}


def print_kernels(prof, total_s: float, top: int) -> None:
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    busy_us = sum(e.self_device_time_total for e in events)
    print(f"\nGPU kernels: {busy_us / 1e6:.2f} s busy of {total_s:.2f} s ({busy_us / 1e6 / total_s:.0%})")
    print("| kernel | calls | total ms | share of busy | mean us |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        name = e.key if len(e.key) <= 90 else e.key[:87] + "..."
        t = e.self_device_time_total
        print(f"| {name} | {e.count} | {t / 1000:.1f} | {t / busy_us:.1%} | {t / max(e.count, 1):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="2b")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--text-len", type=int, default=20)
    parser.add_argument("--kernels", type=int, default=0, help="print the N costliest GPU kernels of the run")
    args = parser.parse_args()
    import tempfile

    folder = write_config(tempfile.mkdtemp(prefix="qwen2vl-profile-"), args.shape)
    for c in args.concurrency:
        requests, prep_s = make_requests(max(2 * c, 8), args.text_len, seed=c)
        result = profile(folder, requests, c, args.output_len, args.kernels)
        free_gpu()  # the next concurrency's engine sizes its KV pool from the free memory
        rows, total = result["rows"], result["total_s"]
        print(f"\nC={c}: {result['images']} images in {total:.2f} s; preprocessing {prep_s * 1000:.1f} ms/image (CPU)")
        print("| step kind | steps | share of run | mean step ms | mean decode rows | mean prefill tokens |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for kind in ("decode only", "prefill", "prefill, vision tower"):
            mine = [r for r in rows if r[0] == kind]
            if not mine:
                continue
            seconds = sum(r[1] for r in mine)
            print(
                f"| {kind} | {len(mine)} | {seconds / total:.0%} | {1000 * seconds / len(mine):.2f} | "
                f"{np.mean([r[2] for r in mine]):.1f} | {np.mean([r[3] for r in mine]):.0f} |"
            )
        enc = result["encoder_s"]
        print(f"vision tower: {1000 * enc / result['images']:.2f} ms/image, {enc / total:.0%} of the run")


if __name__ == "__main__":
    main()
