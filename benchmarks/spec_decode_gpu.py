"""Speculative decoding at one request on a GPU: time per output token with and without, same prompts, same run,
each side in a process of its own, against the floor of streaming every weight once per token.

Usage:
    python benchmarks/spec_decode_gpu.py MODEL [--load-format dummy] [--tokens-prompts 8] [--max-tokens 256] \\
        [--side off] [--side ngram:4] [--side "suffix:8"] [--side "ngram:4|PAGODA_MIXED_STEP_GRAPHS=0"] [--json FILE] \\
        [--profile N]

A side is `METHOD[:K[,KEY=VALUE ...]][|NAME=VALUE ...]` (METHOD `off`, `ngram`, `suffix` or `draft_model`; further
`--speculative-config` keys, values as JSON; the environment variables set for that side's process).
`draft_model` drafts with `--draft MODEL` (default: the target itself, so with real weights every proposal the
target would make is drafted: the draft engine's cost at full acceptance).
Two tasks, greedy, one request at a time (c = 1), `--max-tokens` out, EOS ignored (with `--batch`, one task
instead: every prompt at once, output tokens/s):
- `first`: each prompt once. With random weights only what the model repeats of its own output can be proposed;
  with real weights and `--chat`, the copy-heavy prompts of `spec_decode_cpu.py` (quote a passage).
- `again`: the same prompts again. Suffix decoding proposes the first answers (kept in its store of finished
  outputs), which greedy decoding repeats exactly: proposals right by construction, which times verification
  itself. Prompt lookup has nothing more to copy than the first time.
TPOT = (time of a `--max-tokens` request - time of a 1-token request of the same prompt) / (max_tokens - 1),
averaged over the prompts. The floor is the model's weight bytes over the bandwidth of a device-to-device copy
(bytes read and written per second) measured in the same process. Every side's outputs must equal the `off`
side's (greedy).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _copy_bandwidth() -> float | None:
    """Bytes per second moved (read + written) by a 2 GiB device-to-device copy, best of six (None: no GPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize()
        t = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del a, b
    torch.cuda.empty_cache()
    return 2 * 2**31 / best


def _prompts(args, tokenizer_vocab: int) -> list:
    if args.chat:
        from spec_decode_cpu import COPY  # noqa: PLC0415 (this folder's CPU benchmark: same copy-heavy prompts)

        return [[{"role": "user", "content": p}] for p in COPY[: args.prompts]]
    import numpy as np

    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(100, tokenizer_vocab - 100, 40).tolist()} for _ in range(args.prompts)]


def speculative_llm(model: str, load_format: str, side: str, draft: str | None = None, chat: bool = False):
    """The `LLM` a side runs: bf16, seeded, `side` = `off` or `METHOD[:K[,KEY=VALUE ...]]` (n-gram matches of 2-4
    tokens unless the keys say otherwise; a `draft_model` drafts with `draft`, by default the model itself); without
    `chat`, token-id prompts only."""
    from pagoda import LLM

    method, _, rest = side.partition(":")
    k, *keys = rest.split(",")
    spec = None if method == "off" else {"method": method, "num_speculative_tokens": int(k or 4)}
    if spec and method == "ngram":
        spec |= {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if spec and method == "draft_model":
        spec |= {"model": draft or model}
    if spec:  # further speculative_config keys, e.g. suffix:3,suffix_decoding_min_token_prob=0.3 (they win)
        spec |= {name: json.loads(value) for name, _, value in (key.partition("=") for key in keys)}
    return LLM(
        model,
        load_format=load_format,
        dtype="bfloat16",
        max_model_len=4096,
        seed=0,
        speculative_config=spec,
        skip_tokenizer_init=not chat,  # random weights: token-id prompts
    )


def _side(args) -> dict:
    """One side, in this process: its TPOT and acceptance per task, and its outputs."""
    import torch

    from pagoda import SamplingParams

    llm = speculative_llm(args.model, args.load_format, args.run_side, args.draft, args.chat)
    spec = llm.engine.speculator is not None
    weights = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    vocab = llm.engine.config.model.vocab_size
    prompts = _prompts(args, vocab)

    def run(prompt, max_tokens: int):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        ask = llm.chat if args.chat else llm.generate
        out = ask([prompt], params, use_tqdm=False)
        return time.perf_counter() - started, out[0].outputs[0].token_ids

    run(prompts[0], 8)  # warm-up
    counts = llm.engine.speculator.counts if spec else None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"side": args.run_side, "gpu": gpu, "weights_bytes": weights, "copy_bytes_per_s": _copy_bandwidth()}
    result["tasks"] = {}
    for task in ("batch",) if args.batch else ("first", "again"):
        before = (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) if counts else (0, 0, 0)
        if args.batch:  # every prompt at once: output tokens/s
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
            started = time.perf_counter()
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            row = {"tok_s": sum(map(len, tokens)) / (time.perf_counter() - started), "tokens": tokens}
        else:
            tpots, tokens = [], []
            profiler = cProfile.Profile() if args.profile and spec and task == "again" else None
            if profiler is not None:
                profiler.enable()
            for prompt in prompts:
                full, ids = run(prompt, args.max_tokens)
                one, _ = run(prompt, 1)
                tpots.append((full - one) / (args.max_tokens - 1))
                tokens.append(ids)
            if profiler is not None:  # where a speculating side's host time goes, proposals right by construction
                profiler.disable()
                text = io.StringIO()
                for order in ("cumulative", "tottime"):  # where the time goes, then which functions spend it
                    pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(args.profile)
                result["profile"] = text.getvalue()
            row = {"tpot_ms": 1000 * sum(tpots) / len(tpots), "tokens": tokens}
        if counts:
            drafts = counts.num_drafts - before[0]
            row["drafted"] = counts.num_draft_tokens - before[1]
            row["accepted"] = counts.num_accepted_tokens - before[2]
            row["accept_len"] = 1 + row["accepted"] / drafts if drafts else None
        result["tasks"][task] = row
    llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--chat", action="store_true", help="real weights: the copy-heavy chat prompts")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--draft", default=None, help="the draft_model side's draft (default: MODEL itself)")
    parser.add_argument("--batch", action="store_true", help="all prompts at once: output tokens/s instead of TPOT")
    parser.add_argument("--side", action="append", default=None, help="METHOD[:K[,KEY=VALUE ...]][|NAME=VALUE ...]")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="cProfile's N costliest functions of each speculating "
        "side's `again` task (timed under the profiler: its TPOT reads higher)",
    )
    parser.add_argument("--run-side", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_side:
        print("RESULT " + json.dumps(_side(args)), flush=True)
        return
    sides = args.side or ["off", "ngram:2", "ngram:4", "ngram:8", "suffix:8"]
    if "off" not in [s.split("|")[0] for s in sides]:
        sides = ["off", *sides]
    results = []
    for side in sides:
        spec, _, env_text = side.partition("|")
        env = dict(os.environ, **dict(t.split("=", 1) for t in env_text.split()))
        cmd = [sys.executable, __file__, *sys.argv[1:], "--run-side", spec]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"side {side!r} failed:\n{proc.stderr[-3000:]}", flush=True)
            continue
        result = json.loads(line[7:]) | {"side": side}
        results.append(result)
        if "profile" in result:
            print(f"{side} (again), cProfile:\n" + result.pop("profile"), flush=True)
        brief = {t: {k: v for k, v in r.items() if k != "tokens"} for t, r in result["tasks"].items()}
        print(side, json.dumps(brief), flush=True)
    base = next((r for r in results if r["side"] == "off"), None)
    if base is None:
        raise SystemExit("the `off` side failed: no reference")
    rate = base["copy_bytes_per_s"]
    floor = 1000 * base["weights_bytes"] / rate if rate else float("nan")  # HBM bandwidth serves reads and writes
    gib = base["weights_bytes"] / 2**30
    print(f"\nweights {gib:.2f} GiB; floor (weights over the copy's bytes per second) {floor:.3f} ms")
    unit = "tok/s" if args.batch else "TPOT ms"
    print(f"| side | task | {unit} | side / off (speed) | TPOT / floor | accept len | accepted / drafted | identical |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in results:
        for task, row in r["tasks"].items():
            ref = base["tasks"][task]
            same = sum(a == b for a, b in zip(row["tokens"], ref["tokens"]))
            row["identical"] = f"{same}/{len(ref['tokens'])}"
            acc = f"{row['accepted']} / {row['drafted']}" if "accepted" in row else "-"
            alen = f"{row['accept_len']:.2f}" if row.get("accept_len") else "-"
            if args.batch:
                value, ratio, vs_floor = f"{row['tok_s']:.0f}", row["tok_s"] / ref["tok_s"], "-"
            else:
                value, ratio = f"{row['tpot_ms']:.3f}", ref["tpot_ms"] / row["tpot_ms"]
                vs_floor = f"{row['tpot_ms'] / floor:.2f}"
            cells = [r["side"], task, value, f"{ratio:.2f}x", vs_floor, alen, acc, row["identical"]]
            print("| " + " | ".join(cells) + " |")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        for r in results:
            for row in r["tasks"].values():
                row.pop("tokens")
        meta = {"commit": commit, "date": time.strftime("%Y-%m-%d"), "gpu": base.get("gpu"), "floor_ms": floor}
        meta["args"] = vars(args)
        Path(args.json).write_text(json.dumps(meta | {"sides": results}, indent=1))


if __name__ == "__main__":
    main()
