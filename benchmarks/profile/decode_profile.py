"""Where a decode step's time goes, on the GPU: attention kernels alone, then whole engine steps.

    python benchmarks/profile/decode_profile.py [--shape yuan2-2b] [--backends torch,triton]
        [--batches 1,64,256] [--context 512] [--steps 20] [--out DIR]

1. Kernels: one layer's decode attention (Yuan2-2B: 32 heads of 64, block 16) for each backend at
   each batch size, timed with `triton.testing.do_bench`, against the memory floor (K and V bytes
   read / measured copy bandwidth).
2. Engine: for each backend (its own subprocess: a clean GPU), B requests of --context prompt
   tokens are prefilled, then --steps decode steps are timed one by one: wall time of
   `LLMEngine.step()` (synchronised), the GPU time of the model forward (CUDA events), and the host
   time around it. Then --steps steps back to back (no sync between them: with async scheduling the
   host prepares step N+1 while the GPU runs step N), and where `ModelRunner.launch` still made
   the host wait for the GPU (`torch.cuda.set_sync_debug_mode`: file:line of each synchronizing
   call). A torch.profiler table of a few steps goes to DIR/profile_<backend>_<B>.txt, and one of
   the prefill steps before them (timed: prefill ms and step count are printed) to
   DIR/profile_prefill_<backend>_<B>_<k>.txt (k: the batch's index in --batches, so a repeated
   batch size profiles a prefill after warm-up; pass --extra '{"enable_prefix_caching": false}' then).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: h200_shapes
from h200_shapes import SHAPES, copy_bandwidth, write_config  # noqa: E402


def kernel_bench(batches: list[int], context: int, bandwidth: float) -> list[dict]:
    import torch
    import triton.testing

    from pagoda.layers.attention import AttentionBatch
    from pagoda.layers.torch_attention import TorchAttentionBackend
    from pagoda.layers.triton_attention import TritonAttentionBackend

    heads, dim, block = 32, 64, 16
    rows = []
    for b in batches:
        blocks_per = -(-(context + 1) // block)
        num_blocks = b * blocks_per + 1
        k_cache = torch.randn(num_blocks, block, heads, dim, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        perm = torch.randperm(num_blocks - 1, device="cuda")[: b * blocks_per] + 1  # scattered blocks
        tables = perm.view(b, blocks_per).long()
        seq = [context + 1] * b
        slots = tables[:, context // block] * block + context % block
        batch = AttentionBatch(
            [1] * b, seq, torch.arange(b + 1, device="cuda"), torch.tensor(seq, device="cuda"), tables, slots, block
        )
        q = torch.randn(b, heads, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn_like(q)
        v = torch.randn_like(q)
        floor_ms = 2 * b * (context + 1) * heads * dim * 2 / bandwidth * 1e3
        for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
            meta = backend.prepare(batch)

            def step(backend=backend, meta=meta, q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache):
                return backend.forward(q, k, v, k_cache, v_cache, meta, dim**-0.5)

            ms = triton.testing.do_bench(step, warmup=10, rep=100)
            rows.append(
                {
                    "backend": backend.name,
                    "batch": b,
                    "context": context,
                    "ms": ms,
                    "floor_ms": floor_ms,
                    "x_floor": ms / floor_ms,
                }
            )
            print(
                f"kernel {backend.name:6s} B={b:4d} ctx={context}: {ms * 1e3:8.1f} us  "
                f"(floor {floor_ms * 1e3:6.1f} us, x{ms / floor_ms:.2f})",
                flush=True,
            )
        k_cache = v_cache = None
        torch.cuda.empty_cache()
    return rows


def engine_steps(
    model: str, backend: str, batches: list[int], context: int, steps: int, out: str | None, extra: dict
) -> list[dict]:
    import torch

    from pagoda import LLM, SamplingParams

    llm = LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=context + 4 * steps + 64,
        attention_backend=backend,
        seed=0,
        **extra,
    )
    engine = llm.engine
    runner = engine.runner
    events: list[tuple] = []

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def before(*_):
        if not cuda:
            return
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        events.append((start,))

    def after(*_):
        if not cuda:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        events[-1] = (events[-1][0], end)

    runner.model.register_forward_pre_hook(before)
    runner.model.register_forward_hook(after)
    params = SamplingParams(temperature=0, max_tokens=4 * steps + 32, ignore_eos=True)
    results = []
    for k, b in enumerate(batches):
        ids = [f"b{b}-{k}-{i}" for i in range(b)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, [1000 + (i * 7 + j) % 30000 for j in range(context)], params)
        prefill = _profiler(out and cuda)
        sync()
        t0, prefill_steps = time.perf_counter(), 0
        with prefill:
            while engine.scheduler.num_waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
            ):
                engine.step()
                prefill_steps += 1
            sync()
        prefill_ms = (time.perf_counter() - t0) * 1e3
        if out and cuda:
            with open(os.path.join(out, f"profile_prefill_{backend}_{b}_{k}.txt"), "w") as f:
                f.write(prefill.key_averages().table(sort_by="self_cuda_time_total", row_limit=30))
        for _ in range(3):
            engine.step()
        sync()
        walls, gpu = [], []
        for _ in range(steps):
            events.clear()
            t0 = time.perf_counter()
            engine.step()
            sync()
            walls.append((time.perf_counter() - t0) * 1e3)
            gpu.append(sum(s.elapsed_time(e) for s, e in events))
        walls.sort()
        gpu.sort()
        t0 = time.perf_counter()
        syncs = _count_syncs(runner) if cuda else None
        for _ in range(steps):
            engine.step()
        sync()
        pipelined = (time.perf_counter() - t0) * 1e3 / steps
        row = {
            "backend": backend,
            "batch": b,
            "context": context,
            "step_ms_p50": walls[len(walls) // 2],
            "forward_gpu_ms_p50": gpu[len(gpu) // 2],
            "running": engine.scheduler.num_running,
            "step_ms_back_to_back": pipelined,
            "prefill_ms": prefill_ms,
            "prefill_steps": prefill_steps,
            "launch_syncs": dict(syncs.most_common(8)) if syncs is not None else None,
        }
        if syncs is not None:
            runner.__dict__.pop("launch", None)  # back to the unwrapped method
        if out and cuda:
            with _profiler(True) as prof:
                for _ in range(3):
                    engine.step()
                sync()
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
            trace = os.path.join(out, f"trace_{backend}_{b}.json")
            prof.export_chrome_trace(trace)
            row["timeline"] = timeline_gaps(trace, 3)
            with open(os.path.join(out, f"profile_{backend}_{b}.txt"), "w") as f:
                f.write(table + "\n" + json.dumps(row["timeline"], indent=1))
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        print(
            f"engine {backend:6s} B={b:4d}: prefill {prefill_ms:.1f} ms in {prefill_steps} steps, "
            f"step {row['step_ms_p50']:.2f} ms, forward GPU "
            f"{row['forward_gpu_ms_p50']:.2f} ms, back to back {pipelined:.2f} ms/step, "
            f"syncs in launch: {row['launch_syncs']}",
            flush=True,
        )
        if row.get("timeline"):
            t = row["timeline"]
            print(
                f"  GPU timeline B={b}: span {t['span_us_per_step']:.0f} us/step, busy {t['busy_us_per_step']:.0f}, "
                f"idle {t['idle_us_per_step']:.0f}, {t['device_events_per_step']:.0f} device events/step",
                flush=True,
            )
            for g in t["largest_gaps_us"]:
                print(f"    gap {g[0]:6.1f} us  after {g[1]}  before {g[2]}", flush=True)
        results.append(row)
    return results


def timeline_gaps(trace_path: str, steps: int, top: int = 12) -> dict:
    """Where the GPU sat idle during the profiled steps, from the Chrome trace's device events
    (kernels, copies, memsets, in start order): busy vs span per step, and the largest gaps with
    the events on either side (e.g. a host-to-device copy the graph waits for, or the sampler's
    kernels after it). Overlapping events (PDL, a side stream) count once."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not gpu:
        return {}
    busy, gaps, end, prev = 0.0, [], gpu[0][0], gpu[0][2]
    for start, stop, name in gpu:
        if start > end:
            gaps.append((start - end, prev[:60], name[:60]))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, prev = stop, name
    span = end - gpu[0][0]
    gaps.sort(reverse=True)
    return {
        "span_us_per_step": span / steps,
        "busy_us_per_step": busy / steps,
        "idle_us_per_step": (span - busy) / steps,
        "device_events_per_step": len(gpu) / steps,
        "largest_gaps_us": [(round(g, 1), a, b) for g, a, b in gaps[:top]],
    }


def _profiler(enabled: bool):
    """A torch.profiler context over CPU and CUDA activity, or a no-op context."""
    import contextlib

    if not enabled:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def _count_syncs(runner):
    """Wrap runner.launch so that every call that makes the host wait for the GPU is counted by the
    Python line that issued it (torch's sync debug mode turns them into warnings)."""
    import collections
    import warnings

    import torch

    counts: collections.Counter = collections.Counter()
    launch = runner.launch

    def checked(so):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return launch(so)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                for w in caught:
                    counts[f"{os.path.basename(w.filename)}:{w.lineno}"] += 1

    runner.launch = checked
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="yuan2-2b", choices=sorted(SHAPES))
    ap.add_argument("--backends", default="torch,triton")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--extra", default="{}", help="JSON of extra LLM(...) arguments")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    if args.one:
        rows = engine_steps(
            args.one, args.backends, batches, args.context, args.steps, args.out, json.loads(args.extra)
        )
        print("RESULT " + json.dumps(rows))
        return
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    summary: dict = {"shape": args.shape}
    if not args.skip_kernels:
        bw = copy_bandwidth()
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
        summary["copy_bandwidth"] = bw
        summary["kernels"] = kernel_bench(batches, args.context, bw)
    summary["engine"] = []
    with tempfile.TemporaryDirectory() as folder:
        model = write_config(folder, args.shape)
        for backend in args.backends.split(","):
            cmd = [
                sys.executable,
                __file__,
                "--one",
                model,
                "--backends",
                backend,
                "--batches",
                args.batches,
                "--context",
                str(args.context),
                "--steps",
                str(args.steps),
                "--extra",
                args.extra,
            ]
            if args.out:
                cmd += ["--out", args.out]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            print(proc.stdout[-3000:].replace("RESULT", "result"), flush=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                print(f"{backend} failed ({proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
                continue
            summary["engine"] += json.loads(line[len("RESULT ") :])
    if args.out:
        with open(os.path.join(args.out, f"decode_profile_{args.shape}.json"), "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
