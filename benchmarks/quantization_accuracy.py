"""What quantization costs in accuracy: teacher-forced logits of a quantized model against the same
model unquantized, over one long token sequence.

    python benchmarks/quantization_accuracy.py [--model PATH_OR_ID] [--methods fp8,awq,gptq]
        [--positions 1000] [--group-size 64] [--dtype float32] [--device auto] [--out result.json]

Default model: the embedded SmolLM2-135M-Instruct (real weights). Text: this repository's docs,
tokenized by the model's tokenizer and cut to --positions tokens. Each method:
- fp8: `--quantization fp8` (per-channel e4m3 weights at load, per-token activations);
- awq / gptq: an int4 checkpoint written from the model's own weights (round-to-nearest, asymmetric
  for AWQ, symmetric act-order for GPTQ, group --group-size) by `int4_formats.quantize_awq/_gptq`,
  then loaded as any AWQ/GPTQ checkpoint.
Reported per method: greedy agreement (the argmax of the quantized logits equals the unquantized
argmax, at every position), the mean and max |Δlogit| over the logits' standard deviation, and the
perplexity of the text under both. (CI checks the quantized functions themselves against
references: tests/models/test_quantized_models.py and the kernel tests.)
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def docs_text() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return "\n\n".join(open(p, encoding="utf-8").read() for p in sorted(glob.glob(os.path.join(root, "docs", "*.md"))))


def write_int4_checkpoint(model: str | None, method: str, group_size: int, folder: str) -> str:
    """An AWQ (GEMM) or GPTQ (act-order, symmetric) checkpoint of `model`'s weights in `folder`."""
    import torch
    from safetensors.torch import save_file

    from pagoda.layers.quantization.int4_formats import quantize_awq, quantize_gptq
    from pagoda.models.source import resolve_model_source

    source = resolve_model_source(model)
    tensors: dict[str, Any] = {}
    for name, tensor in source.iter_weights():
        value = tensor if isinstance(tensor, torch.Tensor) else tensor.read()
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix.rsplit(".", 1)[-1] in PROJECTIONS:
            w = value.float()
            if method == "awq":
                qweight, qzeros, scales = quantize_awq(w, group_size)
                tensors.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales})
            else:
                qweight, qzeros, scales, g_idx = quantize_gptq(w, group_size, sym=True, act_order=True)
                tensors.update(
                    {
                        f"{prefix}.qweight": qweight,
                        f"{prefix}.qzeros": qzeros,
                        f"{prefix}.scales": scales,
                        f"{prefix}.g_idx": g_idx,
                    }
                )
        else:
            tensors[name] = value.contiguous()
    config = dict(source.hf_config)
    if method == "awq":
        config["quantization_config"] = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "version": "gemm",
            "zero_point": True,
        }
    else:
        config["quantization_config"] = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": True,
            "sym": True,
            "checkpoint_format": "gptq",
        }
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


def compare(base: Any, quantized: Any, token_ids: list[int]) -> dict[str, float]:
    """Agreement and logit error of `quantized` against `base` ([n, V] float32 logits each)."""
    import torch

    agree = (base.argmax(-1) == quantized.argmax(-1)).float().mean().item()
    spread = base.std().item()
    diff = (quantized - base).abs()
    targets = torch.tensor(token_ids[1:])

    def perplexity(logits: Any) -> float:
        return math.exp(torch.nn.functional.cross_entropy(logits[:-1], targets).item())

    return {
        "greedy_agreement": agree,
        "mean_abs_logit_diff_over_std": diff.mean().item() / spread,
        "max_abs_logit_diff_over_std": diff.max().item() / spread,
        "perplexity_base": perplexity(base),
        "perplexity_quantized": perplexity(quantized),
    }


def measure(
    model: str | None, methods: list[str], positions: int, group_size: int, dtype: str, device: str
) -> dict[str, Any]:
    from pagoda import LLM

    common = {"dtype": dtype, "device": device, "max_model_len": positions + 16, "enforce_eager": True}
    base_llm = LLM(model=model, **common)
    token_ids = base_llm.get_tokenizer().encode(docs_text())[:positions]
    if len(token_ids) < positions:
        raise SystemExit(f"the docs give only {len(token_ids)} tokens")
    base = base_llm.engine.runner.prompt_logits(token_ids)
    base_llm.shutdown()
    del base_llm
    results: dict[str, Any] = {"model": model or "default (SmolLM2-135M-Instruct)", "positions": positions}
    for method in methods:
        with tempfile.TemporaryDirectory() as tmp:
            if method == "fp8":
                llm = LLM(model=model, quantization="fp8", **common)
            else:
                folder = write_int4_checkpoint(model, method, group_size, os.path.join(tmp, method))
                llm = LLM(model=folder, skip_tokenizer_init=True, **common)
            results[method] = compare(base, llm.engine.runner.prompt_logits(token_ids), token_ids)
            llm.shutdown()
        print(method, json.dumps(results[method]), flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--methods", default="fp8,awq,gptq")
    ap.add_argument("--positions", type=int, default=1000)
    ap.add_argument("--group-size", type=int, default=64)  # SmolLM2's hidden size 576 is 9 groups of 64
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out")
    args = ap.parse_args()
    results = measure(args.model, args.methods.split(","), args.positions, args.group_size, args.dtype, args.device)
    print(f"{'method':8s} {'agree':>7s} {'mean|d|/sd':>11s} {'max|d|/sd':>10s} {'ppl base':>9s} {'ppl q':>9s}")
    for method in args.methods.split(","):
        r = results[method]
        print(
            f"{method:8s} {r['greedy_agreement']:7.3f} {r['mean_abs_logit_diff_over_std']:11.4f} "
            f"{r['max_abs_logit_diff_over_std']:10.3f} {r['perplexity_base']:9.3f} {r['perplexity_quantized']:9.3f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
