"""Can the vision tower run beside decode steps on a GPU, and what would that save?

    python benchmarks/profile/encoder_overlap.py [--images 8] [--rows 64] [--context 4000] [--out FILE.json]

A decode step of a language model reads its weights and every running row's KV cache and does little
arithmetic; the vision tower is compute-bound (GEMMs near the card's peak, attention). Today an image step
runs the tower in line, so every running decode waits for it. This measures what running the tower on a
second stream would give, before the engine is built around it:

  * `decode`: a stand-in for one decode step of the Qwen2-VL-2B language model (28 layers of width 1536,
    12 query / 2 KV heads of 128, MLP 8960; `--rows` rows, each attending `--context` cached positions),
    captured as one CUDA graph, as the engine replays decode steps;
  * `tower`: one forward of the vision tower (random bf16 weights, `--images` 1000x750 images);
  * `both`: the tower on a side stream while the decode graph replays on the main stream as many times as
    fit in the tower's own time, with the main stream at high priority, then at equal priority.

It prints each alone, the overlapped wall time against the sum of the two alone (the saving), and how much
slower a decode step ran while the tower shared the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vision_tower_profile import build_tower  # noqa: E402

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 28, 1536, 12, 2, 128, 8960


class DecodeStandIn:
    """One decode step's weight and KV reads, laid out as the language model's (see the module docstring)."""

    def __init__(self, rows: int, context: int):
        bf16 = {"device": "cuda", "dtype": torch.bfloat16}
        qkv_out = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.layers = [
            (
                torch.randn(HIDDEN, qkv_out, **bf16) * 0.02,
                torch.randn(HEADS * HEAD_DIM, HIDDEN, **bf16) * 0.02,
                torch.randn(HIDDEN, 2 * MLP, **bf16) * 0.02,
                torch.randn(MLP, HIDDEN, **bf16) * 0.02,
                torch.randn(rows, KV_HEADS, context, HEAD_DIM, **bf16),
                torch.randn(rows, KV_HEADS, context, HEAD_DIM, **bf16),
            )
            for _ in range(LAYERS)
        ]
        self.x = torch.randn(rows, HIDDEN, **bf16)
        self.rows = rows

    def step(self) -> torch.Tensor:
        x = self.x
        for w_qkv, w_o, w_up, w_down, k, v in self.layers:
            qkv = x @ w_qkv
            q = qkv[:, : HEADS * HEAD_DIM].view(self.rows, HEADS, 1, HEAD_DIM)
            attn = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            x = x + attn.reshape(self.rows, -1) @ w_o
            gate, up = (x @ w_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w_down
        return x


def timed(stream: torch.cuda.Stream, fn) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        fn()
        end.record()
    return start, end


def median_ms(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start, end = timed(torch.cuda.current_stream(), fn)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def overlapped(tower_fn, graph: torch.cuda.CUDAGraph, steps: int, main_priority: int, repeats: int = 5) -> dict:
    """The tower on a low-priority side stream, `steps` decode replays on a main stream of `main_priority`."""
    side = torch.cuda.Stream(priority=0)
    main = torch.cuda.Stream(priority=main_priority)
    walls, decodes, towers = [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        begin = torch.cuda.Event(enable_timing=True)
        begin.record(torch.cuda.current_stream())
        side.wait_event(begin)
        main.wait_event(begin)
        t_start, t_end = timed(side, tower_fn)
        d_start, d_end = timed(main, lambda: [graph.replay() for _ in range(steps)])
        torch.cuda.synchronize()
        walls.append(max(begin.elapsed_time(t_end), begin.elapsed_time(d_end)))
        decodes.append(d_start.elapsed_time(d_end) / steps)
        towers.append(t_start.elapsed_time(t_end))
    return {
        "wall_ms": statistics.median(walls),
        "decode_step_ms": statistics.median(decodes),
        "tower_ms": statistics.median(towers),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    tower = build_tower(torch.bfloat16)
    pixels = torch.randn(args.images * 54 * 72, 3 * 2 * 14 * 14, device="cuda", dtype=torch.bfloat16)
    grids = [(1, 54, 72)] * args.images

    def tower_fn():
        with torch.inference_mode():
            tower(pixels, grids)

    decode = DecodeStandIn(args.rows, args.context)
    graph_stream = torch.cuda.Stream()
    with torch.cuda.stream(graph_stream), torch.inference_mode():
        for _ in range(2):
            decode.step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=graph_stream):
            decode.step()
    torch.cuda.synchronize()
    for _ in range(3):
        tower_fn()
    tower_ms = median_ms(tower_fn)
    decode_ms = median_ms(graph.replay)
    steps = max(1, round(tower_ms / decode_ms))
    low, high = torch.cuda.Stream.priority_range()
    report = {
        "gpu": torch.cuda.get_device_name(),
        "images": args.images,
        "rows": args.rows,
        "context": args.context,
        "tower_ms": tower_ms,
        "decode_step_ms": decode_ms,
        "decode_steps": steps,
        "sequential_ms": tower_ms + steps * decode_ms,
        "both": {},
    }
    print(f"{report['gpu']}: tower ({args.images} images) {tower_ms:.2f} ms alone; decode step ({args.rows} rows x")
    sequence = f"{steps} steps + tower in sequence {report['sequential_ms']:.1f} ms"
    print(f"  {args.context} positions) {decode_ms:.3f} ms alone; {sequence}")
    print("| main stream | wall ms | saved vs sequence | decode step ms (x alone) | tower ms (x alone) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, priority in (("high priority", high), ("equal priority", low)):
        row = overlapped(tower_fn, graph, steps, priority)
        report["both"][name] = row
        saved = 1 - row["wall_ms"] / report["sequential_ms"]
        print(
            f"| {name} | {row['wall_ms']:.1f} | {100 * saved:.0f} % | {row['decode_step_ms']:.3f}"
            f" ({row['decode_step_ms'] / decode_ms:.2f}x) | {row['tower_ms']:.1f} ({row['tower_ms'] / tower_ms:.2f}x) |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
