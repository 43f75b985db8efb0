"""LoRA serving cost on a GPU: output tokens/s of a batch spread over 1, 4 or 16 adapters against the base model
alone, same prompts, same run, each side in a process of its own.

Usage:
    python benchmarks/lora_gpu.py WORKDIR [--batch 64 256] [--side base] [--side lora:1] [--side lora:16] \\
        [--side "lora:16|PAGODA_LORA_KERNELS=0"] [--rank 16] [--shape tiny] [--json FILE]

WORKDIR gets a config-only Llama-3-8B-shaped folder (served with random weights, `--load-format dummy`) and
16 random rank-`--rank` PEFT adapter folders on every linear layer (q/k/v/o, gate/up/down). A side is
`base` (no `enable_lora`) or `lora:A` (`enable_lora`, `max_loras` 16, requests assigned to A adapters in turn),
then `|NAME=VALUE ...` environment variables for its process. Every batch size runs all its prompts at once
(`max_num_seqs` = the batch: c = batch), 128 token-id prompt tokens in and `--max-tokens` out, EOS ignored,
after the same batch for two tokens as a warm-up. Prints one table with each side's tokens/s over the base side's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from h200_shapes import SHAPES as MODEL_SHAPES  # noqa: E402  (this folder's shapes)

LLAMA3_8B = MODEL_SHAPES["llama-3-8b"]
# A smoke-test shape for a CPU (`--shape tiny`): the same code path in seconds.
TINY = LLAMA3_8B | {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SHAPES = {"llama3-8b": LLAMA3_8B, "tiny": TINY}


def targets(cfg: dict) -> dict[str, tuple[int, int]]:
    """module: (in, out) of every linear layer of a decoder layer."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    return {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (h, i),
        "mlp.up_proj": (h, i),
        "mlp.down_proj": (i, h),
    }


ADAPTERS = 16
PROMPT_LEN = 128


def write_adapters(root: Path, cfg: dict, rank: int, count: int = ADAPTERS) -> list[Path]:
    """`count` random rank-`rank` PEFT folders root/a{i} on every linear layer of a model of config `cfg` (kept if
    already there)."""
    import torch
    from safetensors.torch import save_file

    folders = []
    for i in range(count):
        folder = root / f"a{i}"
        folders.append(folder)
        if (folder / "adapter_model.safetensors").is_file():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        g = torch.Generator(dev).manual_seed(i)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for module, (fan_in, fan_out) in targets(cfg).items():
                name = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{name}.lora_A.weight"] = (
                    (torch.randn(rank, fan_in, generator=g, device=dev) / 64).bfloat16().cpu()
                )
                tensors[f"{name}.lora_B.weight"] = (
                    (torch.randn(fan_out, rank, generator=g, device=dev) / 64).bfloat16().cpu()
                )
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets(cfg))}
        (folder / "adapter_config.json").write_text(json.dumps(config))
    return folders


def write_inputs(work: Path, rank: int, shape: str) -> tuple[Path, list[Path]]:
    """The base folder and ADAPTERS adapter folders under work (kept if already there)."""
    cfg = SHAPES[shape]
    base = work / f"{shape}-shape"
    base.mkdir(parents=True, exist_ok=True)
    (base / "config.json").write_text(json.dumps(cfg))
    return base, write_adapters(work / f"{shape}-adapters", cfg, rank)


def run_side(base: str, adapters: list[str], side: str, batches: list[int], max_tokens: int, rank: int) -> dict:
    """In this process: one engine for the side, every batch size (warm-up, then the timed batch)."""
    import numpy as np

    from pagoda import LLM, SamplingParams
    from pagoda.lora.request import LoRARequest

    count = 0 if side == "base" else int(side.split(":")[1])
    extra = {} if count == 0 else {"enable_lora": True, "max_loras": ADAPTERS, "max_lora_rank": rank}
    llm = LLM(
        base,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_num_seqs=max(batches),
        max_model_len=PROMPT_LEN + max_tokens + 16,
        gpu_memory_utilization=0.85,
        **extra,
    )
    requests = [LoRARequest(f"a{i}", i + 1, adapters[i]) for i in range(count)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rng = np.random.default_rng(0)
    vocab = json.loads((Path(base) / "config.json").read_text())["vocab_size"]
    rows = {}
    for batch in batches:
        prompts = [{"prompt_token_ids": rng.integers(3, vocab - 1, PROMPT_LEN).tolist()} for _ in range(batch)]
        loras = [requests[i % count] for i in range(batch)] if count else None
        # Warm-up: the same batch for two tokens, so the timed run meets no step size (and no kernel variant to
        # compile) that the warm-up did not: its prefill steps and its first decode steps.
        warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        llm.generate(prompts, warm, use_tqdm=False, lora_request=loras)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows[batch] = {"output_tok_s": round(tokens / elapsed, 1), "seconds": round(elapsed, 3)}
    return rows


def write_json(path: Path, args: argparse.Namespace, results: dict) -> None:
    import datetime

    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    out = {"gpu": gpu, "commit": commit, "date": datetime.date.today().isoformat(), "shape": args.shape}
    out |= {"rank": args.rank, "max_tokens": args.max_tokens, "sides": results}
    path.write_text(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--side", action="append", default=None)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.work)
    base, folders = write_inputs(work, args.rank, args.shape)
    if args.child:
        rows = run_side(str(base), [str(f) for f in folders], args.child, args.batch, args.max_tokens, args.rank)
        print("ROWS " + json.dumps(rows))
        return
    sides = args.side or ["base", "lora:1", "lora:4", "lora:16"]
    results = {}
    for side in sides:
        method, *env = side.split("|")
        cmd = [sys.executable, __file__, str(work), "--child", method, "--rank", str(args.rank)]
        cmd += ["--max-tokens", str(args.max_tokens), "--shape", args.shape, "--batch", *map(str, args.batch)]
        proc = subprocess.run(cmd, env=os.environ | dict(e.split("=", 1) for e in env), capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("ROWS ")), None)
        if line is None:
            print(f"{side}: failed\n{proc.stderr[-3000:]}")
            continue
        results[side] = {int(k): v for k, v in json.loads(line[5:]).items()}
        print(f"{side}: {json.dumps(results[side])}", flush=True)  # each side as it ends: a cut-off run keeps these
        if args.json:
            write_json(Path(args.json), args, results)
    ref = results.get("base", {})
    print(f"{'side':<34}" + "".join(f"{'c=' + str(b) + ' tok/s':>16}{'/ base':>9}" for b in args.batch))
    for side, rows in results.items():
        cells = ""
        for b in args.batch:
            tok = rows[b]["output_tok_s"]
            ratio = f"{tok / ref[b]['output_tok_s']:.3f}" if b in ref else "-"
            cells += f"{tok:>16,.0f}{ratio:>9}"
        print(f"{side:<34}{cells}")
    if args.json:
        write_json(Path(args.json), args, results)


if __name__ == "__main__":
    main()
