"""An image's preprocessing in the API process with the banded resize on N threads against PIL's resize on one.

    python benchmarks/profile/resize_threads.py --threads 1 2 4 --out benchmarks/results/resize_threads_cpu.json

For each size: one JPEG as vLLM's random-mm dataset (and `pagoda bench --image`) sends it, decoded once by the
API process's own `decode_image`, then `preprocess_image` (RGB, bicubic resize, patchify)
runs `--repeats` times per thread count, the counts alternated within each round and their order reversed every
other round (a neighbour's load on a small VM then falls on both alike); the table gives each count's minimum and
median ms, the medians' ratio to the first count, and the JPEG decode's ms beside them (the other large piece of the
preprocessing, which no thread count changes). Every count's pixels are checked equal to one thread's.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from pagoda.frontend.multimodal.image_processor import VisionPreprocessConfig, preprocess_image
from pagoda.frontend.multimodal.media import MediaPolicy, decode_image
from pagoda.tools.bench.workload import image_rng, random_jpeg_data_uri

SIZES = ("640x480", "1000x750", "1280x720", "1920x1080")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cfg = VisionPreprocessConfig()
    rows = []
    for size in args.sizes:
        w, h = map(int, size.split("x"))
        data = base64.b64decode(random_jpeg_data_uri(image_rng(0, w, h), w, h).split(",", 1)[1])
        decode_ms = []
        for _ in range(5):
            start = time.perf_counter()
            image = decode_image(data, MediaPolicy(), size)
            decode_ms.append((time.perf_counter() - start) * 1e3)
        times: dict[int, list[float]] = {n: [] for n in args.threads}
        pixels: dict[int, np.ndarray] = {}
        for r in range(args.repeats):
            for n in args.threads if r % 2 == 0 else reversed(args.threads):
                os.environ["PAGODA_RESIZE_THREADS"] = str(n)
                start = time.perf_counter()
                visual = preprocess_image(image, cfg)
                times[n].append((time.perf_counter() - start) * 1e3)
                pixels.setdefault(n, visual.pixel_values)
        first = args.threads[0]
        for n in args.threads:
            assert np.array_equal(pixels[n], pixels[first]), f"{size}: {n} threads' pixels differ"
            rows.append(
                {
                    "size": size,
                    "threads": n,
                    "preprocess_ms": round(statistics.median(times[n]), 2),
                    "preprocess_min_ms": round(min(times[n]), 2),
                    "vs_first": round(statistics.median(times[n]) / statistics.median(times[first]), 3),
                    "jpeg_decode_ms": round(statistics.median(decode_ms), 2),
                }
            )
    print(f"cores: {os.cpu_count()}")
    print("| size | threads | preprocess ms, median | min | vs first | JPEG decode ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        cells = (r["size"], r["threads"], r["preprocess_ms"], r["preprocess_min_ms"], f"{r['vs_first']:.2f}x")
        print("| " + " | ".join(map(str, cells)) + f" | {r['jpeg_decode_ms']} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"cores": os.cpu_count(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
