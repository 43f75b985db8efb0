"""Speculative decoding (n-gram or suffix proposals) on the CPU with real weights (the embedded SmolLM2-135M): output
tokens/s with and without, same prompts, same run, and how many tokens a step yields where proposals ran.

Usage:
    python benchmarks/spec_decode_cpu.py [--method ngram|suffix] [--k 4] [--max-tokens 64] [--rounds 2] [--json FILE]
        [--extra '{"prompt_lookup_min": 2}']

Three tasks, greedy: `copy` (the chat model repeats or quotes a given passage: answers that copy spans of their
context, the case prompt lookup is for), `chat` (open questions: little to copy) and `chat_again` (the same
questions asked again: suffix decoding finds the earlier answers among finished outputs; prompt lookup has
nothing more to copy than the first time). Each round builds both
engines (speculation off, then on; the order reversed in the second round) and times one `LLM.chat` of each
task's prompts after a warm-up, all at once (c = 8) or, with --one-at-a-time, one after another (c = 1).
Every output must be identical with and without (greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

PASSAGES = [
    "The Pagoda engine serves Yuan2 and Qwen2-VL models. It keeps a paged KV cache with prefix caching, rebuilds "
    "its batch every step, prefills long prompts in chunks and preempts requests when memory runs out.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens in the chloroplasts of "
    "plant cells, where chlorophyll absorbs mostly blue and red light.",
    "The Treaty of Westphalia, signed in 1648, ended the Thirty Years' War and is often named as the start of the "
    "modern system of sovereign states in Europe.",
    "A hash table maps keys to values by computing an index from each key. Collisions are resolved by chaining or "
    "by open addressing, and the table grows when its load factor passes a threshold.",
]
COPY = [f"Repeat this text exactly, word for word:\n\n{p}" for p in PASSAGES] + [
    f"Here is a passage:\n\n{p}\n\nQuote its first sentence." for p in PASSAGES
]
CHAT = [
    "What is the capital of France?",
    "Give me three tips for better sleep.",
    "Write a haiku about autumn.",
    "Explain what a prime number is.",
    "What should I pack for a beach trip?",
    "Name a famous painter and one of their works.",
    "How do plants drink water?",
    "Suggest a name for a pet turtle.",
]


def _run(spec: dict | None, tasks: dict[str, list[str]], max_tokens: int, one_at_a_time: bool) -> dict:
    from pagoda import LLM, SamplingParams

    llm = LLM(max_model_len=2048, cpu_kv_cache_space_gib=0.5, seed=0, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.chat([[{"role": "user", "content": "Hello"}]], params, use_tqdm=False)  # warm-up
    out = {}
    for name, prompts in tasks.items():
        counts = llm.engine.speculator.counts if spec else None
        before = (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) if counts else (0, 0, 0)
        started = time.perf_counter()
        chats = [[{"role": "user", "content": p}] for p in prompts]
        if one_at_a_time:  # c = 1: each request alone in its steps
            results = [llm.chat([c], params, use_tqdm=False)[0] for c in chats]
        else:
            results = llm.chat(chats, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        tokens = [r.outputs[0].token_ids for r in results]
        row = {"tok_s": sum(map(len, tokens)) / elapsed, "tokens": tokens}
        if counts:
            drafts = counts.num_drafts - before[0]
            row["drafted"] = counts.num_draft_tokens - before[1]
            row["accepted"] = counts.num_accepted_tokens - before[2]
            row["tokens_per_verify_step"] = 1 + row["accepted"] / drafts if drafts else None
        out[name] = row
    llm.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", choices=("ngram", "suffix"), default="ngram")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one-at-a-time", action="store_true", help="requests one after another (c = 1)")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--extra",
        default="{}",
        help='more --speculative-config keys as JSON, e.g. \'{"prompt_lookup_min": 2, "prompt_lookup_max": 5}\'',
    )
    args = parser.parse_args()
    spec = {"method": args.method, "num_speculative_tokens": args.k, **json.loads(args.extra)}
    tasks = {"copy": COPY, "chat": CHAT, "chat_again": CHAT}
    rows = []
    for round_index in range(args.rounds):
        order = [None, spec] if round_index % 2 == 0 else [spec, None]
        results = {bool(s): _run(s, tasks, args.max_tokens, args.one_at_a_time) for s in order}
        for name in tasks:
            off, on = results[False][name], results[True][name]
            same = sum(a == b for a, b in zip(off["tokens"], on["tokens"]))
            row = {
                "round": round_index + 1,
                "task": name,
                "off_tok_s": round(off["tok_s"], 1),
                "on_tok_s": round(on["tok_s"], 1),
                "speedup": round(on["tok_s"] / off["tok_s"], 3),
                "identical": f"{same}/{len(tasks[name])}",
                "accepted": on["accepted"],
                "drafted": on["drafted"],
                "tokens_per_verify_step": on["tokens_per_verify_step"] and round(on["tokens_per_verify_step"], 2),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| task | off tok/s | on tok/s | on / off | identical | accepted / drafted | tokens per verify step |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: |")
    for name in tasks:
        mine = [r for r in rows if r["task"] == name]
        off = sum(r["off_tok_s"] for r in mine) / len(mine)
        on = sum(r["on_tok_s"] for r in mine) / len(mine)
        acc, dra = sum(r["accepted"] for r in mine), sum(r["drafted"] for r in mine)
        steps = [r["tokens_per_verify_step"] for r in mine if r["tokens_per_verify_step"]]
        per = f"{sum(steps) / len(steps):.2f}" if steps else "-"
        ident = ", ".join(r["identical"] for r in mine)
        print(f"| {name} | {off:.1f} | {on:.1f} | {on / off:.2f}x | {ident} | {acc} / {dra} | {per} |")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        result = {"machine": f"cpu, {os.cpu_count()} cores", "commit": commit, "date": time.strftime("%Y-%m-%d")}
        result.update(args=vars(args), rows=rows)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
