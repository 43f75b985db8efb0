"""Where a speculative step's host time goes at one request: time per output token with and without speculation,
then a cProfile of the speculating side's steps.

    python benchmarks/profile/spec_step_profile.py [--side off] [--side suffix:8] [--prompts 4] [--max-tokens 128]
        [--profile 30] [--model DIR]

Without `--model`, random bf16 weights of SmolLM2-135M's shape (the default model's: a model so small that its
steps are host time). Each prompt (200 random tokens) is generated once to warm up, then the prompts are asked
again one at a time, greedy, EOS ignored: suffix decoding then proposes the first answers, which greedy decoding
repeats exactly, so proposals hold by construction and a step's cost is what is timed, not the acceptance. Every
side runs in a process of its own; `--profile N` prints the N costliest functions (cumulative, then own time) of
a third pass of the last side given.
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
import tempfile
import time

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def run_side(args) -> None:
    from pagoda import LLM, SamplingParams

    model, extra = args.model, {}
    if model is None:
        model = tempfile.mkdtemp(prefix="spec-profile-")
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(SMOLLM2_135M, f)
        extra = {"load_format": "dummy", "dtype": "bfloat16"}
    if args.run_side != "off":
        method, k = args.run_side.split(":")
        extra["speculative_config"] = {"method": method, "num_speculative_tokens": int(k)}
    llm = LLM(model=model, skip_tokenizer_init=True, max_model_len=4096, **extra)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 40000 + 3 for j in range(200)]} for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)

    def one_at_a_time() -> float:
        start = time.perf_counter()
        for prompt in prompts:
            llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    seconds = one_at_a_time()
    print(f"{args.run_side}: {1000 * seconds / (args.max_tokens * len(prompts)):.3f} ms per output token", flush=True)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        one_at_a_time()
        profiler.disable()
        for order in ("cumulative", "tottime"):
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(args.profile)
            print(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", action="append", help="off, or METHOD:K (ngram:4, suffix:8); repeatable")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--profile", type=int, default=0, help="cProfile's N costliest functions of the last side")
    parser.add_argument("--model", default=None, help="a model folder (default: SmolLM2-135M's shape, random)")
    parser.add_argument("--run-side", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_side is not None:
        run_side(args)
        return
    sides = args.side or ["off", "suffix:8"]
    for i, side in enumerate(sides):
        cmd = [sys.executable, __file__, "--run-side", side, "--prompts", str(args.prompts)]
        cmd += ["--max-tokens", str(args.max_tokens), "--profile", str(args.profile if i == len(sides) - 1 else 0)]
        if args.model:
            cmd += ["--model", args.model]
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
