"""Speculative decoding leaves greedy outputs unchanged: 50 prompts per method, token for token against the
same engine without it, on real weights (the embedded SmolLM2-135M, CPU).

Usage:
    python benchmarks/spec_decode_identity.py [--max-tokens 32] [--json FILE]

Methods: ngram (k = 4), suffix (k = 8) and draft_model (the target drafting for itself, k = 3), each with
proposals at any batch size (disable_by_batch_size 64), over 50 prompts (copying and open chat) run all at
once, with three sampling settings: plain greedy, greedy with a repetition penalty of 1.1 and greedy asking
for 2 logprobs (their values compared to 1e-3). Prints identical / 50 and the acceptance per method and
setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

from spec_decode_cpu import CHAT, PASSAGES

PROMPTS = (
    [f"Repeat this text exactly, word for word:\n\n{p}" for p in PASSAGES]
    + [f"Here is a passage:\n\n{p}\n\nQuote its first sentence." for p in PASSAGES]
    + [f"Here is a passage:\n\n{p}\n\nSummarise it in one sentence." for p in PASSAGES]
    + [f"Here is a passage:\n\n{p}\n\nWhat is its main subject?" for p in PASSAGES]
    + CHAT
    + [f"{q} Answer in one sentence." for q in CHAT]
    + [f"{q} Answer in detail." for q in CHAT]
    + [f"Translate to French: {q}" for q in CHAT]
    + ["Write a limerick about a cat.", "List five fruits.", "What is 12 times 12?"]
    + ["Explain recursion to a child.", "Name three rivers in Europe.", "What is the boiling point of water?"]
)[:50]
SETTINGS = {
    "greedy": {},
    "repetition_penalty=1.1": {"repetition_penalty": 1.1},
    "logprobs=2": {"logprobs": 2},
}


def _methods(default_model: str) -> dict[str, dict]:
    common = {"disable_by_batch_size": 64}
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, **common},
        "suffix": {"method": "suffix", "num_speculative_tokens": 8, **common},
        "draft_model": {"method": "draft_model", "model": default_model, "num_speculative_tokens": 3, **common},
    }


def _run(spec: dict | None, max_tokens: int) -> dict:
    from pagoda import LLM, SamplingParams

    llm = LLM(max_model_len=2048, cpu_kv_cache_space_gib=0.5, seed=0, speculative_config=spec)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    out = {}
    for name, knobs in SETTINGS.items():
        counts = llm.engine.speculator.counts if spec else None
        before = (counts.num_draft_tokens, counts.num_accepted_tokens) if counts else (0, 0)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, **knobs)
        results = [r.outputs[0] for r in llm.chat(chats, params, use_tqdm=False)]
        row: dict = {"tokens": [r.token_ids for r in results]}
        if knobs.get("logprobs"):
            row["logprobs"] = [[lp[t].logprob for t, lp in zip(r.token_ids, r.logprobs)] for r in results]
        if counts:
            row["drafted"] = counts.num_draft_tokens - before[0]
            row["accepted"] = counts.num_accepted_tokens - before[1]
        out[name] = row
    llm.shutdown()
    return out


def main() -> None:
    from pagoda.models.source import default_gguf_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    reference = _run(None, args.max_tokens)
    rows = []
    for method, spec in _methods(default_gguf_path()).items():
        got = _run(spec, args.max_tokens)
        for setting in SETTINGS:
            mine, want = got[setting], reference[setting]
            same = sum(a == b for a, b in zip(mine["tokens"], want["tokens"]))
            row = {"method": method, "setting": setting, "identical": f"{same}/{len(PROMPTS)}"}
            if "logprobs" in want:
                row["max_logprob_diff"] = max(
                    (abs(x - y) for a, b in zip(mine["logprobs"], want["logprobs"]) for x, y in zip(a, b)), default=0.0
                )
            row.update(accepted=mine["accepted"], drafted=mine["drafted"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| method | setting | identical | accepted / proposed | max logprob difference |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        diff = f"{r['max_logprob_diff']:.1e}" if "max_logprob_diff" in r else "-"
        print(f"| {r['method']} | {r['setting']} | {r['identical']} | {r['accepted']} / {r['drafted']} | {diff} |")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        result = {"machine": f"cpu, {os.cpu_count()} cores", "commit": commit, "date": time.strftime("%Y-%m-%d")}
        result.update(args=vars(args), prompts=len(PROMPTS), rows=rows)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
