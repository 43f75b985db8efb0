"""What Yuan2's localized filtering costs: Yuan2-2B vs a Llama of the same dimensions, same run.

    python benchmarks/models/yuan_lf_overhead.py [--num-prompts 256] [--input-len 512] [--output-len 256]
        [--repeats 1] [--shape 2b|tiny] [--out DIR]

Method:
  * Two configs with Yuan2-2B's real dimensions (hidden 2048, 24 layers, 32 heads of 64, FFN 8192,
    vocab 135040, tied embeddings): `YuanForCausalLM` and `LlamaForCausalLM`. They differ only by
    Yuan's LF gate (two convolutions + an RMSNorm per layer, 2·H² extra weights per layer, ~9% more
    weights in all) and its per-sequence state slots. Weights are random (`load_format="dummy"`):
    speed depends on shapes, not values.
  * Each model runs in its own subprocess (a clean GPU each), alternating Llama, Yuan per repeat:
    a warm-up generate, then one timed `LLM.generate` of N prompts of exactly --input-len random
    token ids, --output-len tokens each (greedy, ignore_eos), bfloat16, default engine settings.
  * Reported: output tokens/s for each (the median repeat; every run is listed), and the LF overhead
    = 1 - yuan / llama, plus where each model's GPU time goes (LF gates, attention) from CUDA events.
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

SHAPES = {
    "2b": dict(
        hidden_size=2048,
        num_hidden_layers=24,
        num_attention_heads=32,
        intermediate_size=8192,
        vocab_size=135040,
        max_position_embeddings=8192,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=2048,
        max_position_embeddings=1024,
    ),
}


def write_configs(folder: str, shape: str) -> dict[str, str]:
    dims = SHAPES[shape]
    yuan = dict(
        architectures=["YuanForCausalLM"],
        model_type="yuan",
        hidden_act="silu",
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        use_flash_attention=False,
        reset_attention_mask=True,
        reset_position_ids=True,
        eos_token_id=77185 % dims["vocab_size"],
        **dims,
    )
    llama = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        num_key_value_heads=dims["num_attention_heads"],
        rope_theta=10000.0,
        eos_token_id=2,
        **dims,
    )
    paths = {}
    for name, cfg in (("llama", llama), ("yuan", yuan)):
        paths[name] = os.path.join(folder, name)
        os.makedirs(paths[name], exist_ok=True)
        with open(os.path.join(paths[name], "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
    return paths


def run_one(model: str, args: argparse.Namespace) -> dict:
    import torch

    from pagoda import LLM, SamplingParams

    llm = LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=args.input_len + args.output_len + 16,
        seed=0,
    )
    vocab = llm.config.model.hf_config["vocab_size"]
    rng = random.Random(0)
    prompts = [
        [rng.randrange(min(1000, vocab // 4), vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], warm, use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == args.num_prompts * args.output_len
    stats = llm.engine.scheduler.stats
    shares = gpu_time_shares(llm, prompts, args) if torch.cuda.is_available() else {}
    return {
        "model": llm.config.model.architecture,
        "device": llm.config.device.device,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "seconds": seconds,
        "output_tokens": produced,
        "output_tok_per_s": produced / seconds,
        "total_tok_per_s": (produced + args.num_prompts * args.input_len) / seconds,
        "steps": stats.num_steps,
        "preemptions": stats.num_preemptions,
        "kv_blocks": llm.engine.kv_layout.num_blocks - 1,
        "state_bytes_per_seq": llm.engine.runner.kv_cache_spec().state_bytes_per_seq,
        **shares,
    }


def gpu_time_shares(llm, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Where the model's GPU time goes (a separate, shorter generate with CUDA events around each
    module; not the timed run): the share of model-forward time spent in the LF gates and in
    paged attention."""
    import torch

    from pagoda import SamplingParams
    from pagoda.layers.attention import Attention
    from pagoda.layers.localized_filter import LocalizedFilter

    model = llm.engine.runner.model
    events: dict[str, list] = {"model": [], "lf": [], "attention": []}
    handles = []

    def track(module, kind):
        def before(*_):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            events[kind].append([start, None])

        def after(*_):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events[kind][-1][1] = end

        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))

    track(model, "model")
    for module in model.modules():
        if isinstance(module, LocalizedFilter):
            track(module, "lf")
        elif isinstance(module, Attention):
            track(module, "attention")
    params = SamplingParams(temperature=0, max_tokens=max(2, args.output_len // 8), ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    for handle in handles:
        handle.remove()
    total = {kind: sum(s.elapsed_time(e) for s, e in pairs) for kind, pairs in events.items()}
    return {
        "model_gpu_ms": total["model"],
        "lf_share_of_forward": total["lf"] / total["model"],
        "attention_share_of_forward": total["attention"] / total["model"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="2b")
    ap.add_argument("--out", default=None, help="folder for yuan_lf_overhead.json / .md")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one model folder
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)))
        return

    results: dict[str, list[dict]] = {"llama": [], "yuan": []}
    with tempfile.TemporaryDirectory() as folder:
        paths = write_configs(folder, args.shape)
        for _ in range(args.repeats):
            for name in ("llama", "yuan"):
                cmd = [
                    sys.executable,
                    __file__,
                    "--one",
                    paths[name],
                    "--num-prompts",
                    str(args.num_prompts),
                    "--input-len",
                    str(args.input_len),
                    "--output-len",
                    str(args.output_len),
                ]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if proc.returncode or line is None:
                    sys.exit(f"{name} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
                results[name].append(json.loads(line[len("RESULT ") :]))
                print(f"{name}: {results[name][-1]['output_tok_per_s']:.1f} output tok/s", flush=True)

    # The median run of each model (GPU clocks and host noise move single runs by several percent).
    best = {
        name: sorted(runs, key=lambda r: r["output_tok_per_s"])[(len(runs) - 1) // 2] for name, runs in results.items()
    }
    overhead = 1 - best["yuan"]["output_tok_per_s"] / best["llama"]["output_tok_per_s"]
    summary = {"workload": vars(args) | {"one": None}, "runs": results, "median": best, "lf_overhead": overhead}
    table = [
        "| model | output tok/s | total tok/s | seconds | steps | preemptions | LF share of forward "
        "| attention share of forward |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in ("llama", "yuan"):
        r = best[name]
        shares = [
            f"{r[k] * 100:.1f} %" if k in r else "-" for k in ("lf_share_of_forward", "attention_share_of_forward")
        ]
        table.append(
            f"| {r['model']} | {r['output_tok_per_s']:.1f} | {r['total_tok_per_s']:.1f} | "
            f"{r['seconds']:.2f} | {r['steps']} | {r['preemptions']} | {shares[0]} | {shares[1]} |"
        )
    spread = {name: ", ".join(f"{r['output_tok_per_s']:.0f}" for r in runs) for name, runs in results.items()}
    table.append(f"\nAll runs, output tok/s, in order: Llama {spread['llama']}; Yuan {spread['yuan']}")
    table.append(
        f"\nLF overhead (1 - Yuan/Llama median output tok/s): **{overhead * 100:.1f} %** "
        f"({args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, "
        f"{best['yuan']['device']} {best['yuan']['gpu'] or ''})"
    )
    text = "\n".join(table)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "yuan_lf_overhead.json"), "w") as f:
            json.dump(summary, f, indent=1)
        with open(os.path.join(args.out, "yuan_lf_overhead.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
