"""What one image's upload to the GPU costs the engine core's host thread, and where (CUDA only).

    python benchmarks/profile/pixel_upload.py [--rows 3888] [--images 8] [--repeats 20]

The served engine core uploads each image's uint8 levels ([patch rows, 1176]; 3,888 rows for a 1000x750
picture, 4.6 MB) with `device_copy.to_device`: a pinned copy (PyTorch's caching host allocator), then a
non-blocking copy to the GPU. A py-spy profile of the served core at c=64 put ~6 ms of host time per image
there. This times, per image, with the GPU idle and with it busy (a sleeping kernel queued first, as a
running step would be):
  to_device       the engine's path as it is;
  pin only        `Tensor.pin_memory()` alone;
  staged          a copy into one pinned buffer allocated once, then the non-blocking copy (timing only: the
                  buffer's slots are rewritten without waiting for their earlier copies);
  pageable        `.to(device, non_blocking=True)` from the numpy array itself.
Prints one table (ms per image, median of --repeats batches of --images images).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagoda.device_copy import to_device

PATCH_WIDTH = 3 * 2 * 14 * 14


def timed(fn, images: list[np.ndarray], busy: bool, repeats: int) -> float:
    """Median host ms per image of `fn(image)` over `repeats` batches."""
    per_image = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work queued ahead of the copies
        t = time.perf_counter()
        for image in images:
            fn(image)
        per_image.append((time.perf_counter() - t) * 1000 / len(images))
    torch.cuda.synchronize()
    return statistics.median(per_image)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=3888)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (args.rows, PATCH_WIDTH), dtype=np.uint8) for _ in range(args.images)]
    staging = torch.empty(args.images * args.rows * PATCH_WIDTH, dtype=torch.uint8, pin_memory=True)
    slot = [0]

    def staged(image: np.ndarray) -> torch.Tensor:
        n = image.size
        start = (slot[0] % args.images) * n
        slot[0] += 1
        host = staging[start : start + n].view(image.shape)
        host.copy_(torch.from_numpy(image))
        return host.to(device, non_blocking=True)

    paths = {
        "to_device": lambda image: to_device(image, device),
        "pin only": lambda image: torch.from_numpy(image).pin_memory(),
        "staged": staged,
        "pageable": lambda image: torch.from_numpy(image).to(device, non_blocking=True),
    }
    for fn in paths.values():  # warm the allocators
        timed(fn, images, False, 2)
    print(f"{args.images} images of {args.rows} x {PATCH_WIDTH} uint8 ({images[0].nbytes / 1e6:.1f} MB each)")
    print("| path | GPU idle, ms/image | GPU busy, ms/image |")
    print("| --- | ---: | ---: |")
    for name, fn in paths.items():
        idle, busy = timed(fn, images, False, args.repeats), timed(fn, images, True, args.repeats)
        print(f"| {name} | {idle:.3f} | {busy:.3f} |")


if __name__ == "__main__":
    main()
