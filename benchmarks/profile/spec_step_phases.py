"""Where one request's decode steps spend their time, speculation off or on: host time per phase, and the GPU time
of each graph replay by bucket.

    python benchmarks/profile/spec_step_phases.py MODEL [--load-format dummy] [--side suffix:8] [--prompts 4] \\
        [--max-tokens 256] [--trace] [--chat]

MODEL is any Pagoda model (SmolLM2-135M's shape with `--load-format dummy` is the host-bound case; random weights
loop, so suffix proposals hold by construction). `--side` is `off` or `METHOD:K[,KEY=VALUE ...]`, built as
`spec_decode_gpu.py` builds its sides.
Prompts of 40 random token ids, or with `--chat` the copy-heavy chat prompts of `spec_decode_cpu.py` (real weights
with a tokenizer, e.g. the default model's GGUF: where a first answer's host time goes), greedy, EOS ignored, one
request at a time after a warm-up. Each phase is wall
time around one engine, runner or speculator call (perf_counter, no synchronisation added), per step: `launch.*`
builds and queues a step, `process.*` reads it (`process.result.wait` is the host waiting for the GPU) and makes
the next proposals. On a GPU each graph step (its inputs' copy, the replay, the logits) is bracketed by CUDA
events, so its GPU time per bucket comes out too. A phase nested in another is counted in both. `--trace` (GPU
only) then runs one more prompt under torch.profiler and lists each kernel's GPU time a step, the kernels of graph
replays included.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np
import torch

from pagoda import SamplingParams
from pagoda.worker import graph_runner, pending_step, spec_rows

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from spec_decode_gpu import _prompts, speculative_llm  # noqa: E402 (the same sides and prompts as spec_decode_gpu.py)


def _timed(totals: dict, counts: collections.Counter, obj, name: str, label: str) -> None:
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - started
            counts[label] += 1

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--side", default="suffix:8")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--trace", action="store_true", help="then one more prompt under torch.profiler: each kernel's GPU time a step"
    )
    parser.add_argument("--chat", action="store_true", help="the copy-heavy chat prompts (a model with a tokenizer)")
    args = parser.parse_args()
    llm = speculative_llm(args.model, args.load_format, args.side, chat=args.chat)
    engine, runner = llm.engine, llm.engine.runner
    totals: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    phases = [
        (engine, "step", "step"),
        (engine.scheduler, "schedule", "schedule"),
        (runner, "launch", "launch"),
        (runner, "_prepare", "launch.prepare"),
        (spec_rows, "build_inputs", "launch.prepare.inputs"),
        (runner, "_run_model", "launch.model"),
        (graph_runner.GraphRunner, "write", "launch.model.graph_inputs"),
        (torch.cuda.CUDAGraph, "replay", "launch.model.replay"),
        (runner, "_sample", "launch.sample"),
        (spec_rows, "sample", "launch.sample.verify"),
        (pending_step.PendingStep, "__init__", "launch.sample.copy_out"),
        (engine, "_process", "process"),
        (pending_step.PendingStep, "result", "process.result"),
        (torch.cuda.Event, "synchronize", "process.result.wait"),
        (engine.scheduler, "update", "process.scheduler_update"),
        (engine.output_processor, "process", "process.outputs"),
    ]
    if engine.speculator is not None:
        phases.append((engine.speculator, "propose", "process.propose"))
    for obj, name, label in phases:
        _timed(totals, counts, obj, name, label)
    replays: list[tuple[tuple, torch.cuda.Event, torch.cuda.Event]] = []
    if runner.graphs is not None and runner.graphs.capture:
        graphs, run = runner.graphs, runner.graphs.run

        def timed_run(inputs, positions, mm=None):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = run(inputs, positions, mm)
            end.record()
            replays.append((graphs.bucket_for(inputs), start, end))
            return out

        graphs.run = timed_run
    prompts = _prompts(args, engine.config.model.vocab_size)

    def answer(prompt, params: SamplingParams) -> int:
        run = llm.chat if args.chat else llm.generate
        return len(run([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    answer(prompts[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    totals.clear()
    counts.clear()
    replays.clear()
    started, tokens = time.perf_counter(), 0
    for prompt in prompts:
        tokens += answer(prompt, params)
    wall = time.perf_counter() - started
    steps = counts["step"]
    per_token, per_step = 1e3 * wall / tokens, 1e3 * wall / steps
    print(f"{args.side}: {steps} steps, {tokens} tokens, {per_token:.3f} ms a token, {per_step:.3f} ms a step")
    for label in sorted(totals):
        print(f"  {label:28s} {1e6 * totals[label] / steps:8.1f} µs a step ({counts[label]} calls)")
    if replays:
        torch.cuda.synchronize()
        by_bucket = collections.defaultdict(list)
        for bucket, start, end in replays:
            by_bucket[bucket].append(start.elapsed_time(end))
        for (kind, size), times in sorted(by_bucket.items(), key=lambda item: -len(item[1])):
            print(f"  replay {kind} {size:5d}: GPU {np.median(times):.3f} ms median ({len(times)} steps)")
    if args.trace and torch.cuda.is_available():
        _kernel_table(lambda: answer(prompts[0], params), counts)
    llm.shutdown()


def _kernel_table(answer, counts: collections.Counter) -> None:
    """One prompt (`answer()`) under torch.profiler: each kernel's GPU time a step (graph replays' kernels included).
    The profiler slows the host many times over, so no wall time or busy share is given: only the kernels' own."""
    from torch.profiler import ProfilerActivity, profile

    counts.clear()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        answer()
        torch.cuda.synchronize()
    steps = max(counts["step"], 1)
    kernels: dict[str, list[float]] = collections.defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            kernels[event.name].append(event.device_time_total)
    busy = sum(sum(times) for times in kernels.values())
    launches = sum(len(times) for times in kernels.values())
    print(f"  trace: {steps} steps, kernels {busy / steps:.1f} µs a step, {launches / steps:.1f} launches a step")
    for name, times in sorted(kernels.items(), key=lambda item: -sum(item[1]))[:25]:
        print(f"    {sum(times) / steps:8.1f} µs a step  {len(times) / steps:6.1f} a step  {name[:90]}")


if __name__ == "__main__":
    main()
