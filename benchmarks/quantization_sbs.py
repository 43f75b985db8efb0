"""Quantized serving beside vLLM on the H200: the served ladder's rows → `results/quantization.json`.

The runs are the side-by-side runs of benchmarks/README.md ("Against vLLM": vLLM 0.26 carried to the
device as wheels, its own `bench serve` client pooled over several processes; 40 tokens in, 256 out;
vLLM's fp8 also needs the `compressed-tensors` and `loguru` wheels, the API processes `httptools`). With
`side_by_side.sh` the script that starts one server, runs the client ladder and writes `sbs_<label>.jsonl`:

    T=.anchor/tools; M=/tmp/models/yuan2-2b-shape    # a Llama with Yuan2-2B's dimensions
    bash $T/side_by_side.sh pagoda pagoda_bf16 $M "--api-server-count 4" "warm c1 c64 c256"
    bash $T/side_by_side.sh pagoda pagoda_fp8 $M "--api-server-count 4 --quantization fp8 --kv-cache-dtype fp8" \\
        "warm c1 c64 c256"
    bash $T/side_by_side.sh vllm vllm_fp8 $M "--api-server-count 4 --quantization fp8 --kv-cache-dtype fp8" \\
        "warm c1 c64 c256"
    python3 benchmarks/quantization_sbs.py awq-folder /tmp/models/qwen2-vl-2b /tmp/models/qwen2-vl-7b-awq
    TOK=/tmp/models/qwen2-vl-2b bash $T/side_by_side.sh pagoda pagoda_awq /tmp/models/qwen2-vl-7b-awq \\
        "--api-server-count 4" "warm c1"      # and the same with vllm

Then, here, with the `sbs_*.jsonl` files the runs wrote under $OUT:

    python benchmarks/quantization_sbs.py collect DIR --commit SHA [--date YYYY-MM-DD]

Each row: shape, system (pagoda | vllm), quantization (none | fp8 | awq | gptq), kv_cache_dtype
(auto | fp8), concurrency, and vLLM's key names (output_throughput, median/p95 ttft/tpot/itl ms).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil

RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "quantization.json")
# side_by_side.sh labels → (shape, system, quantization, kv_cache_dtype)
LABELS = {
    "pagoda_bf16": ("llama-yuan2-2b-dims", "pagoda", "none", "auto"),
    "pagoda_fp8": ("llama-yuan2-2b-dims", "pagoda", "fp8", "fp8"),
    "vllm_bf16": ("llama-yuan2-2b-dims", "vllm", "none", "auto"),
    "vllm_fp8": ("llama-yuan2-2b-dims", "vllm", "fp8", "fp8"),
    "pagoda_awq": ("qwen2-vl-7b", "pagoda", "awq", "auto"),
    "vllm_awq": ("qwen2-vl-7b", "vllm", "awq", "auto"),
}
# multi_client.py's names → vLLM's `bench serve` names
KEYS = {
    "span_throughput": "output_throughput",
    "p50_ttft_ms": "median_ttft_ms",
    "p95_ttft_ms": "p95_ttft_ms",
    "p50_tpot_ms": "median_tpot_ms",
    "p95_tpot_ms": "p95_tpot_ms",
    "p50_itl_ms": "median_itl_ms",
    "p95_itl_ms": "p95_itl_ms",
    "requests": "num_prompts",
    "failed": "failed",
}


def awq_folder(src: str, dst: str) -> None:
    """A Qwen2-VL-7B-shaped AWQ (GEMM, 4-bit, group 128) config folder from a Qwen2-VL-2B one (random
    weights: both servers load it with --load-format dummy). The vision tower is not converted."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        num_hidden_layers=28,
        vocab_size=152064,
    )
    config["vision_config"]["hidden_size"] = 3584
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "version": "gemm",
        "zero_point": True,
        "modules_to_not_convert": ["visual"],
    }
    with open(path, "w") as f:
        json.dump(config, f, indent=1)


def collect(folder: str, commit: str, date: str, gpu: str) -> dict:
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "sbs_*.jsonl"))):
        for line in open(path):
            r = json.loads(line)
            if r.get("step") in (None, "warm") or r.get("label") not in LABELS or "span_throughput" not in r:
                continue
            shape, system, quantization, kv = LABELS[r["label"]]
            row = {
                "shape": shape,
                "system": system,
                "quantization": quantization,
                "kv_cache_dtype": kv,
                "concurrency": r["concurrency"],
                "input_len": 40,
                "output_len": 256,
                "client_processes": r.get("procs"),
            }
            row.update({new: r.get(old) for old, new in KEYS.items()})
            rows.append(row)
    return {"gpu": gpu, "commit": commit, "date": date, "rows": rows}


def table(result: dict) -> str:
    lines = [f"{'shape':20s} {'system':7s} {'quant':5s} {'kv':5s} {'c':>4s} {'tok/s':>9s} {'TPOT ms':>8s}"]
    for r in result["rows"]:
        lines.append(
            f"{r['shape']:20s} {r['system']:7s} {r['quantization']:5s} {r['kv_cache_dtype']:5s} "
            f"{r['concurrency']:4d} {r['output_throughput']:9.1f} {r['median_tpot_ms']:8.3f}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("awq-folder", help="make the Qwen2-VL-7B-shaped AWQ config folder")
    a.add_argument("src")
    a.add_argument("dst")
    c = sub.add_parser("collect", help="the sbs_*.jsonl rows of a device run → results/quantization.json")
    c.add_argument("folder")
    c.add_argument("--commit", required=True)
    c.add_argument("--date", default=datetime.date.today().isoformat())
    c.add_argument("--gpu", default="NVIDIA H200", help="the device the rows were measured on")
    c.add_argument("--out", default=RESULT)
    args = ap.parse_args()
    if args.cmd == "awq-folder":
        awq_folder(args.src, args.dst)
        return
    result = collect(args.folder, args.commit, args.date, args.gpu)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))


if __name__ == "__main__":
    main()
