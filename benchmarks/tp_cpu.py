"""Tensor parallelism on the CPU: offline tokens/s of TP = N against TP = 1 on the same model, same run.

Usage:
    python benchmarks/tp_cpu.py [--model M] [--tp 3] [--rounds 2] [--num-prompts 16] [--input-len 64]
        [--output-len 32] [--json benchmarks/results/tp_cpu.json]

Each round builds the TP = 1 engine, then the TP = N one (N ranks, gloo, each on its share of the cores),
and times one `LLM.generate` of the same seeded random prompts (greedy, ignore_eos) after a warm-up; rounds
alternate so a drift of the machine hits both. On a machine with few cores TP = N is expected to be slower
(the ranks split the same cores and add a collective per layer): this measures the cost, it is no target.
The default model (SmolLM2-135M: 9 heads, 3 KV heads) accepts N = 3 only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time


def _run(model: str | None, tp: int, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    from pagoda import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, max_model_len=512, cpu_kv_cache_space_gib=0.25, seed=0)
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
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    rows = []
    for round_index in range(args.rounds):
        tokens = {}
        for tp in (1, args.tp):
            tok_s, tokens[tp] = _run(args.model, tp, prompts, args.output_len)
            rows.append({"round": round_index + 1, "tp": tp, "output_tok_s": round(tok_s, 1)})
            print(f"round {round_index + 1} tp={tp}: {tok_s:.1f} output tok/s", flush=True)
        same = sum(a == b for a, b in zip(tokens[1], tokens[args.tp]))
        print(f"round {round_index + 1}: {same}/{len(prompts)} outputs identical to TP = 1", flush=True)
    mean = {tp: sum(r["output_tok_s"] for r in rows if r["tp"] == tp) / args.rounds for tp in (1, args.tp)}
    print("\n| tp | mean output tok/s | vs TP = 1 |\n| ---: | ---: | ---: |")
    for tp in (1, args.tp):
        print(f"| {tp} | {mean[tp]:.1f} | {mean[tp] / mean[1]:.2f}x |")
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
