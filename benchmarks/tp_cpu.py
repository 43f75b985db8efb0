"""Tensor and pipeline parallelism on the CPU: offline tokens/s of TP = N x PP = P against one rank on the
same model, same run.

Usage:
    python benchmarks/tp_cpu.py [--model M] [--tp 3] [--pp 1] [--rounds 2] [--num-prompts 16] [--input-len 64]
        [--output-len 32] [--json benchmarks/results/tp_cpu.json]

Each round builds the one-rank engine, then the N x P one (ranks over gloo, each on its share of the cores),
and times one `LLM.generate` of the same seeded random prompts (greedy, ignore_eos) after a warm-up; rounds
alternate so a drift of the machine hits both. With --pp > 1 a third engine runs the same stages with one
micro-batch in flight (PAGODA_PP_MICRO_BATCHES=0), the stages taking turns, against the default of one
micro-batch per stage. On a machine with few cores TP = N is expected to be slower (the ranks split the
same cores and add a collective per layer): this measures the cost, it is no target.
The default model (SmolLM2-135M: 9 heads, 3 KV heads) accepts N = 3 only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time


def _run(
    model: str | None, layout: tuple[int, int, bool], prompts: list[list[int]], output_len: int
) -> tuple[float, list[list[int]]]:
    from pagoda import LLM, SamplingParams

    tp, pp, micro_batches = layout
    os.environ["PAGODA_PP_MICRO_BATCHES"] = "1" if micro_batches else "0"  # read when the config is built
    llm = LLM(
        model,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_model_len=512,
        cpu_kv_cache_space_gib=0.25,
        seed=0,
    )
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    llm.shutdown()
    return len(prompts) * output_len / elapsed, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    rows = []
    one, split = (1, 1, True), (args.tp, args.pp, True)
    layouts = [one, split] + ([(args.tp, args.pp, False)] if args.pp > 1 else [])
    rates: dict[tuple[int, int, bool], list[float]] = {}
    for round_index in range(args.rounds):
        tokens = {}
        for layout in layouts if round_index % 2 == 0 else layouts[::-1]:
            tok_s, tokens[layout] = _run(args.model, layout, prompts, args.output_len)
            tp, pp, micro = layout
            label = f"tp={tp} pp={pp}" + ("" if pp == 1 else f" micro-batches={pp if micro else 1}")
            rows.append({"round": round_index + 1, "tp": tp, "pp": pp, "micro_batches": pp if micro else 1})
            rows[-1]["output_tok_s"] = round(tok_s, 1)
            rates.setdefault(layout, []).append(tok_s)
            print(f"round {round_index + 1} {label}: {tok_s:.1f} output tok/s", flush=True)
        for layout in layouts[1:]:
            same = sum(a == b for a, b in zip(tokens[one], tokens[layout]))
            print(f"round {round_index + 1} {layout}: {same}/{len(prompts)} outputs identical to one rank", flush=True)
    mean = {layout: sum(runs) / len(runs) for layout, runs in rates.items()}
    print("\n| tp | pp | micro-batches | mean output tok/s | vs one rank |\n| ---: | ---: | ---: | ---: | ---: |")
    for tp, pp, micro in layouts:
        m = mean[tp, pp, micro]
        print(f"| {tp} | {pp} | {pp if micro else 1} | {m:.1f} | {m / mean[one]:.2f}x |")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        result = {
            "machine": f"cpu, {os.cpu_count()} cores",
            "commit": commit,
            "date": time.strftime("%Y-%m-%d"),
            "model": args.model or "default (SmolLM2-135M-Instruct GGUF)",
            "args": vars(args),
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
