"""Image-request throughput of Qwen2-VL: Pagoda vs transformers `generate()`, same machine, same run.

    python benchmarks/models/qwen2vl_image_throughput.py [--shape 2b|7b|tiny] [--concurrency 1 16 64]
        [--output-len 128] [--text-len 20] [--out DIR]

Workload (issue 5): one 1000x750 image (972 placeholder tokens at the checkpoint's pixel limits)
+ 20 text tokens in, 128 tokens out (greedy, ignore_eos), bf16 on the GPU.
  * Images are random pixels, a different image per request (no encoder-cache or prefix hits), run
    through Pagoda's preprocessing (bit-exact with transformers' PIL processor) once, up front; its
    CPU cost per image is reported separately.
  * Pagoda: the offline engine (`LLMEngine`) with at most C requests in flight: a new request is
    added whenever one finishes, until 2*C requests (4 for C=1) are done. Random weights
    (`load_format="dummy"`) of the Qwen2-VL-2B shape: speed depends on shapes only.
  * transformers: `Qwen2VLForConditionalGeneration` (random init, bf16, sdpa) `generate()` on static
    batches of C requests (all prompts have the same length, so no padding), the same number of
    requests.
Reported per system and C: image requests/s, output tokens/s, mean request latency.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: h200_shapes
from h200_shapes import QWEN2VL_7B_TEXT  # noqa: E402

SHAPES = {
    "2b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        vision=dict(depth=32, embed_dim=1280, num_heads=16),
    ),
    "7b": dict(QWEN2VL_7B_TEXT, vocab_size=151936, vision=dict(depth=32, embed_dim=1280, num_heads=16)),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=151936,
        vision=dict(depth=2, embed_dim=32, num_heads=4),
    ),
}
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 151655, 151656, 151652, 151653


def write_config(folder: str, shape: str) -> str:
    dims = dict(SHAPES[shape])
    vision = dims.pop("vision")
    tied = dims.pop("tie_word_embeddings", True)  # the 2B ties its LM head to the embedding, the 7B does not
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    section = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]  # [16, 24, 24] for 128
    config = dict(
        architectures=["Qwen2VLForConditionalGeneration"],
        model_type="qwen2_vl",
        **dims,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        hidden_act="silu",
        tie_word_embeddings=tied,
        torch_dtype="bfloat16",
        bos_token_id=151643,
        eos_token_id=151645,
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        rope_scaling={"type": "mrope", "mrope_section": section},
        vision_config=dict(
            vision,
            mlp_ratio=4,
            patch_size=14,
            temporal_patch_size=2,
            spatial_merge_size=2,
            in_chans=3,
            hidden_size=dims["hidden_size"],
        ),
    )
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def make_requests(count: int, text_len: int, seed: int):
    """(token ids with one placeholder, ProcessedVisual) per request, plus seconds of preprocessing
    (NaN where Pillow is missing: then the pixels are random values of the same 1000x750 grid)."""
    rng = np.random.default_rng(seed)
    text_rng = random.Random(seed)
    requests, spent = [], 0.0
    for _ in range(count):
        start = time.perf_counter()
        visual = _random_image_visual(rng)
        spent += time.perf_counter() - start
        text = [text_rng.randrange(1000, 150000) for _ in range(text_len)]
        requests.append((text[: text_len // 2] + [VISION_START, IMAGE_PAD, VISION_END] + text[text_len // 2 :], visual))
    return requests, spent / count


@dataclass
class _GridVisual:
    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]

    @property
    def num_tokens(self) -> int:
        return self.grid_thw[0] * self.grid_thw[1] * self.grid_thw[2] // 4

    def normalized(self) -> np.ndarray:
        return self.pixel_values


def _random_image_visual(rng: np.random.Generator):
    try:
        from PIL import Image

        from pagoda.frontend.multimodal.image_processor import VisionPreprocessConfig, preprocess_image
    except ImportError:  # no Pillow: the 1000x750 image's grid (1, 54, 72), random pixels
        return _GridVisual(rng.standard_normal((54 * 72, 1176), dtype=np.float32), (1, 54, 72))
    image = Image.fromarray(rng.integers(0, 256, (750, 1000, 3), dtype=np.uint8))
    return preprocess_image(image, VisionPreprocessConfig())


def make_engine(folder: str):
    """The offline engine both this benchmark and profile/image_step_profile.py drive: random bf16 weights."""
    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=4096,
        seed=0,
        gpu_memory_utilization=0.5,
    )
    return LLMEngine(EngineConfig.create(args))


def run_pagoda(folder: str, requests, concurrency: int, output_len: int) -> dict:
    from pagoda.frontend.multimodal.prompt import PlaceholderIds, expand_prompt
    from pagoda.sampling_params import SamplingParams

    engine = make_engine(folder)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    placeholders = PlaceholderIds(IMAGE_PAD, VIDEO_PAD)
    prepared = [expand_prompt(ids, [("image", visual)], placeholders, "bench") for ids, visual in requests]

    def drive(batch, limit: int) -> tuple[float, list[float], int]:
        pending, started, latencies, produced = list(enumerate(batch)), {}, [], 0
        sync()
        t0 = time.perf_counter()
        while pending or engine.has_unfinished_requests():
            while pending and len(started) < limit:
                index, (ids, mm) = pending.pop(0)
                engine.add_request(f"q{index}-{t0}", ids, params, mm_inputs=mm)
                started[f"q{index}-{t0}"] = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    latencies.append(time.perf_counter() - started.pop(out.request_id))
                    produced += len(out.outputs[0].token_ids)
        sync()
        return time.perf_counter() - t0, latencies, produced

    drive(prepared[:2], 2)  # warm-up (also compiles nothing)
    seconds, latencies, produced = drive(prepared, concurrency)
    engine = None
    free_gpu()
    return {
        "system": "pagoda",
        "concurrency": concurrency,
        "requests": len(prepared),
        "seconds": seconds,
        "requests_per_s": len(prepared) / seconds,
        "output_tok_per_s": produced / seconds,
        "mean_latency_s": float(np.mean(latencies)),
    }


def run_hf(folder: str, requests, concurrency: int, output_len: int, device: str) -> dict:
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    model = (
        transformers.Qwen2VLForConditionalGeneration._from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
        .to(device)
        .eval()
    )

    def generate(batch) -> int:
        from pagoda.frontend.multimodal.prompt import PlaceholderIds, expand_prompt

        expanded = [
            expand_prompt(ids, [("image", v)], PlaceholderIds(IMAGE_PAD, VIDEO_PAD), "hf")[0] for ids, v in batch
        ]
        input_ids = torch.tensor(expanded, device=device)
        pixels = torch.from_numpy(np.concatenate([v.normalized() for _, v in batch])).to(device, torch.bfloat16)
        grids = torch.tensor([v.grid_thw for _, v in batch], device=device)
        kwargs = dict(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=pixels,
            image_grid_thw=grids,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
        )
        with torch.inference_mode():
            try:  # transformers >= 5.2x needs the token types; older versions reject them
                out = model.generate(mm_token_type_ids=(input_ids == IMAGE_PAD).long(), **kwargs)
            except (TypeError, ValueError):
                out = model.generate(**kwargs)
        return (out.shape[1] - input_ids.shape[1]) * len(batch)

    generate(requests[:1])  # warm-up
    sync()
    t0 = time.perf_counter()
    produced, latencies = 0, []
    for i in range(0, len(requests), concurrency):
        start = time.perf_counter()
        produced += generate(requests[i : i + concurrency])
        sync()
        latencies += [time.perf_counter() - start] * len(requests[i : i + concurrency])
    seconds = time.perf_counter() - t0
    model = None
    free_gpu()
    return {
        "system": "transformers",
        "concurrency": concurrency,
        "requests": len(requests),
        "seconds": seconds,
        "requests_per_s": len(requests) / seconds,
        "output_tok_per_s": produced / seconds,
        "mean_latency_s": float(np.mean(latencies)),
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_gpu() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="2b")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--text-len", type=int, default=20)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-pagoda", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        write_config(folder, args.shape)
        for c in args.concurrency:
            requests, preprocess_s = make_requests(4 if c == 1 else 2 * c, args.text_len, seed=c)
            if not args.skip_pagoda:
                rows.append(
                    run_pagoda(folder, requests, c, args.output_len) | {"preprocess_ms_per_image": preprocess_s * 1e3}
                )
                print(json.dumps(rows[-1]), flush=True)
            if not args.skip_hf:
                rows.append(run_hf(folder, requests, c, args.output_len, device))
                print(json.dumps(rows[-1]), flush=True)
    table = [
        "| concurrency | system | image req/s | output tok/s | mean latency s | requests |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        table.append(
            f"| {r['concurrency']} | {r['system']} | {r['requests_per_s']:.2f} | "
            f"{r['output_tok_per_s']:.1f} | "
            f"{r['mean_latency_s']:.2f} | {r['requests']} |"
        )
    speedups = []
    for c in args.concurrency:
        ours = next((r for r in rows if r["system"] == "pagoda" and r["concurrency"] == c), None)
        theirs = next((r for r in rows if r["system"] == "transformers" and r["concurrency"] == c), None)
        if ours and theirs:
            speedups.append(f"C={c}: {ours['requests_per_s'] / theirs['requests_per_s']:.2f}x")
    pre = np.mean([r["preprocess_ms_per_image"] for r in rows if "preprocess_ms_per_image" in r] or [float("nan")])
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    table.append(
        f"\nPagoda / transformers image req/s: {', '.join(speedups) or '-'} "
        f"(Qwen2-VL-{args.shape} shape, random weights, 1000x750 image + {args.text_len} text tokens in, "
        f"{args.output_len} out, {gpu}); preprocessing {pre:.1f} ms per image on the CPU, not in the timings."
    )
    text = "\n".join(table)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "qwen2vl_image_throughput.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(args.out, "qwen2vl_image_throughput.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
