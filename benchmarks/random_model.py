"""Write a random-weight HF checkpoint with the shape of a real model, for speed runs where the real
weights cannot travel (e.g. the GPU machine, which has no network and a small upload limit).

    python benchmarks/random_model.py OUT_DIR [--like PATH_OR_GGUF] [--tokenizer DIR] [--dtype bfloat16]
    python benchmarks/random_model.py OUT_DIR --config config.json [--tokenizer DIR]

--like takes the config of an existing model (HF folder or .gguf; default: the embedded model);
--config takes a config.json directly. Speed does not depend on weight values, only on shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--like", default=None)
    ap.add_argument("--config", default=None)
    ap.add_argument("--tokenizer", default=None, help="folder whose tokenizer files are copied in")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    import transformers

    if args.config:
        with open(args.config) as f:
            cfg = json.load(f)
    else:
        from pagoda.models.source import resolve_model_source

        cfg = dict(resolve_model_source(args.like).hf_config)
    cfg["torch_dtype"] = args.dtype
    config = transformers.AutoConfig.for_model(cfg.pop("model_type", "llama"), **cfg)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.out, safe_serialization=True)
    if args.tokenizer:
        for name in os.listdir(args.tokenizer):
            if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
                shutil.copy(os.path.join(args.tokenizer, name), args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
