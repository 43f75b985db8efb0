"""Constrained decoding's cost: offline output tokens/s of JSON-schema requests against unconstrained ones,
same model, same prompts, same run, at each concurrency.

Usage:
    python benchmarks/structured_output.py [--model M] [--concurrency 1 64] [--output-len 128] [--rounds 2]
        [--json benchmarks/results/structured_output_cpu.json]
    python benchmarks/structured_output.py --shape qwen2-vl-2b-text --tokenizer .gpu/qwen-tokenizer \
        --json benchmarks/results/structured_output_h200.json     # on the device

--shape builds one of `benchmarks/h200_shapes.py`'s shapes with random bf16 weights (speed depends on the
shape and the vocabulary, not the values) around the tokenizer files in --tokenizer: the grammar engine
needs the real vocabulary, the model does not need real weights.

Both sides generate exactly --output-len tokens per request, so tokens/s compare like for like: the
unconstrained requests with ignore_eos, the constrained ones under a schema that cannot close sooner (an
array of at least 64 receipt lines, each with an enum, a bounded integer and a bounded string). Each
constrained round uses a schema the engine has not seen (a different title), so its compile is paid in
the timing, once per round, as a new schema in production would be. Rounds alternate the two sides. On
the device: the H200 target is constrained >= 90 % of unconstrained at c = 64.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time


def schema(round_index: int) -> dict:
    line = {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "maxLength": 10},
            "kind": {"enum": ["food", "tool", "other"]},
            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
        },
        "required": ["sku", "kind", "qty"],
    }
    return {"title": f"receipt-{round_index}", "type": "array", "minItems": 64, "items": line}


def _install_timers() -> dict[str, list]:
    """Host time of the runner's mask step (its wait for the last step's tokens included) and of the
    grammar engine's fill inside it, summed per name: {name: [seconds, calls]}."""
    from pagoda.frontend.structured_output.manager import GrammarManager
    from pagoda.worker.model_runner import ModelRunner

    timers: dict[str, list] = {}

    def timed(cls: type, name: str) -> None:
        inner = getattr(cls, name)
        slot = timers.setdefault(name, [0.0, 0])

        def wrapper(*a, **k):
            started = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                slot[0] += time.perf_counter() - started
                slot[1] += 1

        setattr(cls, name, wrapper)

    timed(ModelRunner, "_token_bitmask")
    timed(GrammarManager, "fill")
    timed(ModelRunner, "launch")
    return timers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--shape", default=None, help="a shape of benchmarks/h200_shapes.py, random weights")
    parser.add_argument("--tokenizer", default=None, help="with --shape: a folder of tokenizer files")
    parser.add_argument(
        "--breakdown", action="store_true", help="also time the engine's mask work per constrained step (host ms)"
    )
    args = parser.parse_args()
    timers = _install_timers() if args.breakdown else None

    from pagoda import LLM, SamplingParams
    from pagoda.sampling_params import StructuredOutputsParams

    engine_args: dict = dict(max_model_len=1024, max_num_seqs=max(args.concurrency), seed=0)
    model = args.model
    if args.shape:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from h200_shapes import write_config

        model = write_config(tempfile.mkdtemp(prefix="pagoda-so-"), args.shape, args.tokenizer)
        engine_args.update(load_format="dummy", dtype="bfloat16")
    else:
        engine_args.update(cpu_kv_cache_space_gib=1)
    llm = LLM(model, **engine_args)
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    rows = []
    llm.generate([{"prompt_token_ids": [7] * 8}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    for c in args.concurrency:
        prompts = [
            {"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(args.input_len)]} for _ in range(c)
        ]
        for round_index in range(args.rounds):
            for side in ("free", "json"):
                if side == "free":
                    params = SamplingParams(temperature=0.8, max_tokens=args.output_len, ignore_eos=True)
                else:
                    so = StructuredOutputsParams(json=schema(len(rows)))
                    params = SamplingParams(temperature=0.8, max_tokens=args.output_len, structured_outputs=so)
                started = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - started
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                assert tokens == c * args.output_len, f"{side}: {tokens} tokens, expected {c * args.output_len}"
                rows.append(
                    {
                        "concurrency": c,
                        "round": round_index + 1,
                        "side": side,
                        "output_tok_s": round(tokens / elapsed, 1),
                    }
                )
                print(f"c={c} round {round_index + 1} {side}: {tokens / elapsed:.1f} output tok/s", flush=True)
                if timers is not None:
                    means = (f"{k} {v[0] / max(1, v[1]) * 1e3:.3f} ms x{v[1]}" for k, v in timers.items())
                    print("   " + ", ".join(means), flush=True)
                    for v in timers.values():
                        v[:] = [0.0, 0]
    print("\n| concurrency | unconstrained tok/s | JSON-schema tok/s | ratio |\n| ---: | ---: | ---: | ---: |")
    summary = []
    for c in args.concurrency:
        mean = {
            side: sum(r["output_tok_s"] for r in rows if r["concurrency"] == c and r["side"] == side) / args.rounds
            for side in ("free", "json")
        }
        summary.append(
            {
                "concurrency": c,
                "free_tok_s": round(mean["free"], 1),
                "json_tok_s": round(mean["json"], 1),
                "ratio": round(mean["json"] / mean["free"], 3),
            }
        )
        print(f"| {c} | {mean['free']:.1f} | {mean['json']:.1f} | {mean['json'] / mean['free']:.3f} |")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        device = "cuda" if llm.config.device.device == "cuda" else f"cpu ({os.cpu_count()} cores)"
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": device,
                    "commit": commit,
                    "date": time.strftime("%Y-%m-%d"),
                    "model": args.shape or args.model or "default",
                    "output_len": args.output_len,
                    "summary": summary,
                    "rows": rows,
                },
                f,
                indent=1,
            )
            f.write("\n")


if __name__ == "__main__":
    main()
