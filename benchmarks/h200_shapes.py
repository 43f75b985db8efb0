"""The model shapes the H200 benchmarks run (random weights: speed depends on shapes, not values).

    yuan2-2b             YuanForCausalLM, Yuan2-2B's dimensions, with the LF gate
    llama-yuan2-2b-dims  LlamaForCausalLM with the same dimensions (MHA, 32 x 64) — the anchors' shape A
    qwen2-vl-2b-text     Qwen2VLForConditionalGeneration, the real 2B config, fed text only
    qwen2-vl-7b-text     the same with the 7B's language model (QWEN2VL_7B_TEXT)
    llama-3-8b           LlamaForCausalLM, Llama-3-8B's dimensions (GQA 32/8 x 128)

`QWEN2VL_7B_TEXT` holds what Qwen2-VL-7B's language model changes from the 2B's (its vision tower is the 2B's,
merged into 3584).

`write_config(folder, shape)` writes `folder/<shape>/config.json` (and copies tokenizer files from
`tokenizer_dir` when given) and returns that folder.
"""

from __future__ import annotations

import json
import os
import shutil

QWEN2VL_7B_TEXT = dict(
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    tie_word_embeddings=False,
)

_YUAN_DIMS = dict(
    hidden_size=2048,
    num_hidden_layers=24,
    num_attention_heads=32,
    intermediate_size=8192,
    vocab_size=135040,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    torch_dtype="bfloat16",
)

SHAPES: dict[str, dict] = {
    "yuan2-2b": dict(
        architectures=["YuanForCausalLM"],
        model_type="yuan",
        tie_word_embeddings=True,
        use_flash_attention=False,
        reset_attention_mask=True,
        reset_position_ids=True,
        eos_token_id=77185,
        **_YUAN_DIMS,
    ),
    "llama-yuan2-2b-dims": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        tie_word_embeddings=False,
        num_key_value_heads=32,
        rope_theta=10000.0,
        eos_token_id=2,
        **_YUAN_DIMS,
    ),
    "qwen2-vl-2b-text": dict(
        architectures=["Qwen2VLForConditionalGeneration"],
        model_type="qwen2_vl",
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        hidden_act="silu",
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        bos_token_id=151643,
        eos_token_id=151645,
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
        vision_config=dict(
            depth=32,
            embed_dim=1280,
            num_heads=16,
            mlp_ratio=4,
            patch_size=14,
            temporal_patch_size=2,
            spatial_merge_size=2,
            in_chans=3,
            hidden_size=1536,
        ),
    ),
    "llama-3-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=128000,
        eos_token_id=128001,
    ),
}


SHAPES["qwen2-vl-7b-text"] = dict(
    SHAPES["qwen2-vl-2b-text"],
    **QWEN2VL_7B_TEXT,
    vision_config=dict(SHAPES["qwen2-vl-2b-text"]["vision_config"], hidden_size=3584),
)


def write_config(folder: str, shape: str, tokenizer_dir: str | None = None) -> str:
    path = os.path.join(folder, shape)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(SHAPES[shape], f, indent=1)
    if tokenizer_dir:
        for name in os.listdir(tokenizer_dir):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


def kv_bytes_per_token(c: dict, dtype_bytes: int = 2) -> int:
    """K and V bytes one token occupies over all layers, for a config dict like SHAPES' values."""
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", heads)
    return 2 * c["num_hidden_layers"] * kv_heads * (c["hidden_size"] // heads) * dtype_bytes


def copy_bandwidth() -> float | None:
    """Bytes/s of a 2 GiB device-to-device copy (read + write counted); None without a GPU."""
    import time

    import torch

    if not torch.cuda.is_available():
        return None

    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 10
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2 * 2**30 / seconds
