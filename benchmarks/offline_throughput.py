"""Offline generation throughput: Pagoda vs. Hugging Face transformers, same machine, same weights.

Usage:
    python benchmarks/offline_throughput.py [--model M] [--num-prompts 32] [--input-len 128]
        [--output-len 128] [--batch-size 32] [--device auto] [--dtype auto] [--skip-hf-single]
        [--hf-single-prompts 4] [--threads N] [--json out.json] [--seed 0]

Method:
  * N prompts of random token ids (seeded), each of a length drawn uniformly from
    [input_len/2, input_len], so every system has to cope with ragged input. Special tokens
    (the lowest ids) are avoided. Every request produces exactly --output-len tokens, greedily.
  * Pagoda: one `LLM.generate` call on all N prompts (SamplingParams(temperature=0,
    ignore_eos=True)), after a tiny warm-up generate. Continuous batching is Pagoda's own business.
  * HF single: `model.generate()` one prompt at a time. This is slow on a CPU, so it runs on the
    first --hf-single-prompts prompts only and its tokens/s is extrapolated (marked in the table).
  * HF static batch: `model.generate()` on padded batches of --batch-size prompts (left padding,
    attention_mask, min_new_tokens = max_new_tokens = output_len, do_sample=False).
  * The HF model is built from the very weights Pagoda loads (`resolve_model_source`): an HF folder
    goes through `AutoModelForCausalLM.from_pretrained`; a GGUF file (the default model) is
    dequantized by Pagoda's reader and loaded into the matching transformers class
    (`LlamaForCausalLM` for the default model). Both run in the dtype Pagoda resolved, on its device.
  * CPU timings are only as good as the machine is quiet: the 1-minute load average is printed at
    the start and end; when other processes compete, torch's OpenMP threads can slow down badly.
  * Correctness: how many Pagoda outputs equal the HF static-batch greedy tokens exactly. Padding
    and different kernels can legitimately flip a near-tie argmax, so this is reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder / hub id / .gguf (default: Pagoda's embedded model)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32, help="static batch size for HF batched generate")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--skip-hf-single", action="store_true")
    p.add_argument("--hf-single-prompts", type=int, default=4, help="prompts timed for HF single (extrapolated)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low = min(1000, vocab // 4)  # skip special/control tokens at the bottom of the vocabulary
    return [
        [rng.randrange(low, vocab) for _ in range(rng.randint(max(1, input_len // 2), input_len))] for _ in range(n)
    ]


def build_hf_model(model: str | None, dtype: torch.dtype, device: str):
    import transformers

    from pagoda.models.source import resolve_model_source

    src = resolve_model_source(model)
    if src.kind == "hf":
        hf = transformers.AutoModelForCausalLM.from_pretrained(src.location, dtype=dtype)
    else:
        cfg = {k: v for k, v in src.hf_config.items() if k not in ("architectures", "torch_dtype", "dtype")}
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
        missing, unexpected = hf.load_state_dict(dict(src.iter_weights()), strict=False)
        allowed = {"lm_head.weight"} if cfg.get("tie_word_embeddings") else set()
        if set(missing) - allowed or unexpected:
            raise RuntimeError(f"HF weight mismatch: missing={missing} unexpected={unexpected}")
        hf.tie_weights()
    return hf.to(device=device, dtype=dtype).eval()


@torch.inference_mode()
def hf_generate(hf, batch: list[list[int]], output_len: int, pad_id: int, device: str) -> list[list[int]]:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = hf.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        do_sample=False,
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        pad_token_id=pad_id,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    return out[:, width:].tolist()


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagoda import LLM, SamplingParams

    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, seed=args.seed)
    device, dtype_name = llm.config.device.device, llm.config.model.dtype
    tok = llm.engine.tokenizer
    vocab = min(llm.config.model.hf_config["vocab_size"], len(tok))
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    mean_in = sum(map(len, prompts)) / len(prompts)
    load_start = os.getloadavg()[0]  # other busy processes skew CPU timings: report the load
    print(
        f"device={device} dtype={dtype_name} threads={torch.get_num_threads()} load={load_start:.2f} "
        f"prompts={len(prompts)} "
        f"input_len~U[{args.input_len // 2},{args.input_len}] (mean {mean_in:.1f}) output_len={args.output_len}"
    )
    rows, n, out_len = [], len(prompts), args.output_len

    # 1. Pagoda
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(
        [{"prompt_token_ids": prompts[0][:8]}],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    outs, secs = timed(lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    pagoda_tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(t) == out_len for t in pagoda_tokens), "Pagoda did not produce exactly output_len tokens"
    rows.append(
        {
            "system": "pagoda",
            "prompts": n,
            "output_tokens": n * out_len,
            "seconds": secs,
            "tok_per_s": n * out_len / secs,
        }
    )

    # HF model from the same weights
    hf = build_hf_model(args.model, getattr(torch, dtype_name), device)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    hf_generate(hf, [prompts[0][:8]], 4, pad_id, device)  # warm-up

    # 2. HF one prompt at a time (subset, extrapolated)
    if not args.skip_hf_single:
        subset = prompts[: max(1, min(args.hf_single_prompts, n))]
        _, secs = timed(lambda: [hf_generate(hf, [p], out_len, pad_id, device) for p in subset])
        rows.append(
            {
                "system": f"hf-single (first {len(subset)}, extrapolated)",
                "prompts": len(subset),
                "output_tokens": len(subset) * out_len,
                "seconds": secs,
                "tok_per_s": len(subset) * out_len / secs,
                "extrapolated_seconds_all": secs * n / len(subset),
            }
        )

    # 3. HF padded static batches
    def run_static():
        res = []
        for i in range(0, n, args.batch_size):
            res += hf_generate(hf, prompts[i : i + args.batch_size], out_len, pad_id, device)
        return res

    hf_tokens, secs = timed(run_static)
    rows.append(
        {
            "system": f"hf-static-batch (bs={args.batch_size})",
            "prompts": n,
            "output_tokens": n * out_len,
            "seconds": secs,
            "tok_per_s": n * out_len / secs,
        }
    )

    base = rows[-1]["tok_per_s"]
    for r in rows:
        r["vs_hf_static"] = r["tok_per_s"] / base
    print(f"\n{'system':<40}{'prompts':>8}{'out tok':>9}{'seconds':>10}{'tok/s':>10}{'vs HF static':>14}")
    for r in rows:
        print(
            f"{r['system']:<40}{r['prompts']:>8}{r['output_tokens']:>9}{r['seconds']:>10.2f}"
            f"{r['tok_per_s']:>10.1f}{r['vs_hf_static']:>13.2f}x"
        )
    if not args.skip_hf_single:
        print(
            f"(hf-single timed on {rows[1]['prompts']} prompts; all {n} would take "
            f"~{rows[1]['extrapolated_seconds_all']:.0f}s at that rate)"
        )

    load_end = os.getloadavg()[0]
    print(
        f"1-min load average: {load_start:.2f} at start, {load_end:.2f} at end "
        f"(this run alone adds up to ~{torch.get_num_threads()}; more means other processes shared the "
        f"{os.cpu_count()} CPUs and skewed the timings)"
    )
    exact = sum(a == b for a, b in zip(pagoda_tokens, hf_tokens))
    prefix = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(pagoda_tokens, hf_tokens)
    ]
    print(
        f"correctness: {exact}/{n} Pagoda outputs exactly match HF static-batch greedy tokens "
        f"(mean matching prefix {sum(prefix) / n:.1f}/{out_len} tokens; padding may flip near-ties)"
    )

    if args.json:
        result = {
            "args": vars(args),
            "device": device,
            "dtype": dtype_name,
            "threads": torch.get_num_threads(),
            "loadavg_start_end": [load_start, load_end],
            "mean_input_len": mean_in,
            "results": rows,
            "correctness": {"exact_matches": exact, "num_prompts": n, "matching_prefix": prefix},
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
