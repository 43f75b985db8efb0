"""What a lone image's first vision-tower forwards cost the engine's thread on a GPU, pass by pass, and what the
encoder's CUDA graph capture costs, phase by phase.

    python benchmarks/profile/encoder_capture_cost.py [--passes 5] [--grid 1 54 72] [--out FILE.json]

Random bf16 weights of the Qwen2-VL tower (depth 32, width 1280), one image of the given grid (default a
1000x750 picture: 3,888 patch rows). Each pass is timed on the host with a device sync after it, the way a served
step waits for it: the attention's backend gate (`layers/segment_attention.py`) runs a new shape on flash for its
first passes and builds cuDNN's plan at the pass it switches. Then, as `worker/encoder_graphs.py` does while
serving: the plan, the eager forward on the side stream, the capture, the first replay, each timed alone; then the
same capture sequence for a second grid whose shape no pass has met (the plan built inside the capture's eager
forward, or not, as the gate says).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vision_tower_profile import build_tower  # noqa: E402  (this folder's tower)

from pagoda.worker.graph_runner import capture_graph, gc_paused  # noqa: E402

PATCH_DIM = 3 * 2 * 14 * 14


def timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start), out


def capture_phases(tower, grid: tuple[int, int, int]) -> dict[str, float]:
    pixels = torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    row: dict[str, float] = {}
    row["plan_ms"], plan = timed(lambda: tower.plan([grid], pixels.device))
    stream.wait_stream(torch.cuda.current_stream())

    def eager():
        with torch.cuda.stream(stream):
            return tower.run(pixels, plan)

    row["side_stream_eager_ms"], _ = timed(eager)
    with gc_paused(collect=False):
        row["capture_ms"], (graph, _) = timed(
            lambda: capture_graph(lambda: tower.run(pixels, plan), pool, stream, while_serving=True)
        )
    row["first_replay_ms"], _ = timed(graph.replay)
    row["replay_ms"], _ = timed(graph.replay)
    row["eager_after_ms"], _ = timed(lambda: tower.run(pixels, plan))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--grid", type=int, nargs=3, default=[1, 54, 72])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    tower = build_tower(torch.bfloat16)
    grid = tuple(args.grid)
    pixels = torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, device="cuda", dtype=torch.bfloat16)
    report: dict = {"gpu": torch.cuda.get_device_name(), "grid": grid, "passes_ms": []}
    with torch.inference_mode():
        for i in range(args.passes):
            ms, _ = timed(lambda: tower(pixels, [grid]))
            report["passes_ms"].append(ms)
            print(f"pass {i + 1}: {ms:8.1f} ms")
        report["capture_known_shape"] = capture_phases(tower, grid)
        other = (grid[0], grid[1] + 2, grid[2])
        report["capture_new_shape"] = capture_phases(tower, other)
    for name in ("capture_known_shape", "capture_new_shape"):
        print(name + ": " + ", ".join(f"{k} {v:.1f}" for k, v in report[name].items()))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
