"""Where the offline benchmark's wall time goes, step by step.

    python benchmarks/profile/offline_timeline.py [--shapes yuan2-2b,llama-yuan2-2b-dims] [--prompts 512]
        [--input-len 512] [--output-len 256] [--max-num-seqs 512] [--sync] [--tiny] [--out t.json]

Runs h200.py's offline workload (random prompt ids, greedy, ignore_eos, one `LLM.generate`-like
loop over `engine.step()`) and records every step: its wall time, how many rows it ran and how many
of its tokens were prefill. Steps fall in three kinds — `prefill` (no decode row), `mixed` (chunked
prefill beside decode rows), `decode` (one token per row) — and the table prints, per kind, the
steps, their summed wall time and tokens, so the gap between two shapes (Yuan2's LF gate vs the
same-dimension Llama) can be charged to prefill or decode.

With async scheduling a step's wall time is mostly the GPU time of the step launched before it;
`--sync` synchronises after every step so each one's wall time is its own (a little slower overall).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: h200, h200_shapes
from h200 import random_prompts, shape_config
from h200_shapes import write_config


def kind_of(rows: int, tokens: int, prefill_tokens: int) -> str:
    if prefill_tokens == 0:
        return "decode"
    return "prefill" if prefill_tokens == tokens else "mixed"


def timeline(folder: str, args: argparse.Namespace) -> dict:
    import torch

    from pagoda import LLM, SamplingParams

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    llm = LLM(
        model=folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16" if cuda else "float32",
        max_model_len=args.input_len + args.output_len + 64,
        max_num_seqs=args.max_num_seqs,
        seed=0,
    )
    engine = llm.engine
    prompts = random_prompts(args.prompts, args.input_len, engine.vocab_size, 0)
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:16]],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )

    scheduled: list[tuple[int, int, int]] = []  # (rows, tokens, prefill tokens) per schedule() call
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        prefill = 0
        for n in out.num_scheduled_tokens.values():
            if n > 1:
                prefill += n
        for new in out.new_requests:  # a one-token first chunk is still prefill
            if out.num_scheduled_tokens.get(new.request_id) == 1:
                prefill += 1
        scheduled.append((len(out.num_scheduled_tokens), out.total_num_scheduled_tokens, prefill))
        return out

    engine.scheduler.schedule = recording_schedule
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"t{i}", p, params)
    sync()
    walls = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        if args.sync:
            sync()
        walls.append(time.perf_counter() - t0)
    sync()
    seconds = time.perf_counter() - start
    engine.scheduler.schedule = schedule

    # With async scheduling step k's wall time waits for the step launched at k-1 (its own launch
    # overlaps). Charge each wall time to the step whose result it waited for.
    if not args.sync and engine.config.scheduler.async_scheduling:
        charged = list(zip(scheduled, walls[1:] + [0.0]))
    else:
        charged = list(zip(scheduled, walls))
    kinds: dict[str, dict] = {}
    for (rows, tokens, prefill), wall in charged:
        k = kinds.setdefault(
            kind_of(rows, tokens, prefill), {"steps": 0, "seconds": 0.0, "tokens": 0, "prefill_tokens": 0, "rows": 0}
        )
        k["steps"] += 1
        k["seconds"] += wall
        k["tokens"] += tokens
        k["prefill_tokens"] += prefill
        k["rows"] += rows
    produced = args.prompts * args.output_len
    return {
        "seconds": seconds,
        "output_throughput": produced / seconds,
        "steps": len(walls),
        "kinds": kinds,
        "per_step": [{"rows": r, "tokens": t, "prefill_tokens": p, "ms": w * 1e3} for (r, t, p), w in charged],
    }


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="yuan2-2b,llama-yuan2-2b-dims")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--sync", action="store_true", help="synchronise after every step")
    ap.add_argument("--tiny", action="store_true", help="tiny configs (a CPU smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for shape in args.shapes.split(","):
            path = write_config(folder, shape)
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(shape_config(shape, args.tiny), f, indent=1)
            results[shape] = timeline(path, args)
            gc.collect()  # the previous shape's engine, before the next one's
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print("| shape | kind | steps | seconds | ms/step | tokens/step | rows/step |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for shape, r in results.items():
        for kind in ("prefill", "mixed", "decode"):
            k = r["kinds"].get(kind)
            if k:
                print(
                    f"| {shape} | {kind} | {k['steps']} | {k['seconds']:.3f} | {k['seconds'] / k['steps'] * 1e3:.2f} "
                    f"| {k['tokens'] / k['steps']:.0f} | {k['rows'] / k['steps']:.0f} |"
                )
        print(f"| {shape} | all | {r['steps']} | {r['seconds']:.3f} | | {r['output_throughput']:.0f} out tok/s | |")


if __name__ == "__main__":
    main()
