"""The CPU attention's decode rows in place against gathered, per layer call, to set `policy.CPU_KV_VIEW_MAX_ROWS`.

    python benchmarks/profile/cpu_kv_views.py [--rows 1 2 4 8 16] [--context 256 1024] [--threads 2]

The embedded model's attention shape (9 query heads, 3 KV heads, head dim 64, float32, blocks of 16), each row's
blocks one run of block ids: `TorchAttentionBackend.forward` for one decode step, with the rows attended through
views of the cache (one call per row) and with them gathered into one padded batch (the metadata's views
dropped). Prints the median time per call of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagoda.kernels import policy
from pagoda.layers.attention import AttentionBatch
from pagoda.layers.torch_attention import TorchAttentionBackend

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def _batch(rows: int, context: int) -> tuple[AttentionBatch, int]:
    per_row = -(-context // BLOCK)
    tables = torch.arange(1, 1 + rows * per_row).view(rows, per_row)  # consecutive runs, block 0 the null block
    seq_lens = [context] * rows
    starts = torch.arange(rows + 1)
    slots = tables[:, (context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK
    batch = AttentionBatch([1] * rows, seq_lens, starts, torch.tensor(seq_lens), tables, slots, BLOCK)
    return batch, 1 + rows * per_row


def _time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _one_step(backend: TorchAttentionBackend, rows: int, context: int, repeat: int) -> tuple[float, float]:
    """Seconds per decode-step call (in place, gathered) for `rows` rows of `context` keys."""
    batch, num_blocks = _batch(rows, context)
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM)
    v_cache = torch.randn_like(k_cache)
    q, k, v = torch.randn(rows, HEADS, DIM), torch.randn(rows, KV_HEADS, DIM), torch.randn(rows, KV_HEADS, DIM)
    meta = backend.prepare(batch)
    assert meta.decode_views is not None
    in_place = _time(lambda: backend.forward(q, k, v, k_cache, v_cache, meta, DIM**-0.5), repeat)
    meta.decode_views = None
    gathered = _time(lambda: backend.forward(q, k, v, k_cache, v_cache, meta, DIM**-0.5), repeat)
    return in_place, gathered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    policy.CPU_KV_VIEW_MAX_ROWS = max(args.rows)  # every row count in place here, to compare
    backend = TorchAttentionBackend()
    print("| context | rows | in place us | gathered us | gathered / in place |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for context in args.context:
        for rows in args.rows:
            in_place, gathered = _one_step(backend, rows, context, args.repeat)
            print(f"| {context} | {rows} | {in_place * 1e6:.0f} | {gathered * 1e6:.0f} | {gathered / in_place:.2f}x |")


if __name__ == "__main__":
    main()
