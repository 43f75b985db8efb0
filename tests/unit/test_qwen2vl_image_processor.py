"""Qwen2-VL preprocessing: bit parity with transformers' PIL image processor, worked examples as
literal numbers (docs/models.md, Qwen2-VL: image preprocessing), and videos against a loop-per-patch
reading of the video patch layout (docs/models.md, Qwen2-VL: video patches)."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from pagoda.errors import ConfigError, InvalidRequest
from pagoda.frontend.multimodal.image_processor import (
    ProcessedVisual,
    VisionPreprocessConfig,
    normalize_levels,
    preprocess_image,
    preprocess_video,
    smart_resize,
)
from pagoda.worker.encoder_runner import encoder_pixels

CKPT_MAX = 12845056  # official preprocessor_config.json max_pixels
MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


def _noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Random pixels: the hardest input for a resize/patch-order comparison."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr, mode)


def _reopen_png(image: Image.Image) -> Image.Image:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return Image.open(io.BytesIO(buf.getvalue()))


def _hf(image: Image.Image, min_pixels: int = 3136, max_pixels: int = CKPT_MAX):
    proc = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    out = proc(images=image, return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def _assert_parity(image: Image.Image, max_pixels: int = CKPT_MAX) -> ProcessedVisual:
    ref_pixels, ref_grid = _hf(image, max_pixels=max_pixels)
    ours = preprocess_image(image, VisionPreprocessConfig(max_pixels=max_pixels))
    assert ours.grid_thw == ref_grid
    assert ours.pixel_values.dtype == np.uint8  # levels; normalised where they are used
    normalized = ours.normalized()
    assert normalized.dtype == np.float32
    assert normalized.shape == ref_pixels.shape
    np.testing.assert_array_equal(normalized, ref_pixels)  # bit-exact
    # ... and the device-side gather the runner applies gives the same bits.
    on_device = encoder_pixels(ours.pixel_values, ours.pixel_lut, torch.device("cpu"), ours.temporal_repeat)
    np.testing.assert_array_equal(on_device.numpy(), ref_pixels)
    return ours


# ---------------------------------------------------------------------------------------------
# Parity with transformers


@pytest.mark.parametrize(
    "width,height,max_pixels,grid",
    [
        (1000, 750, CKPT_MAX, (1, 54, 72)),
        (224, 224, CKPT_MAX, (1, 16, 16)),
        (742, 742, CKPT_MAX, (1, 52, 52)),  # 26.5 rounds half to even -> 26
        (1920, 1080, 1280 * 784, (1, 52, 94)),
        (28, 28, CKPT_MAX, (1, 4, 4)),  # grown to min_pixels
        (10, 10, CKPT_MAX, (1, 4, 4)),
        (3, 500, CKPT_MAX, (1, 52, 2)),  # aspect 166.7, still allowed
        (500, 3, CKPT_MAX, (1, 2, 52)),
        (5600, 28, CKPT_MAX, (1, 2, 400)),  # aspect exactly 200 is allowed
    ],
)
def test_rgb_parity_with_transformers(width, height, max_pixels, grid):
    ours = _assert_parity(_noise(width, height), max_pixels)
    assert ours.grid_thw == grid


def test_rgba_png_composited_on_white_like_transformers():
    image = _reopen_png(_noise(123, 77, "RGBA", seed=1))
    assert image.mode == "RGBA"
    _assert_parity(image)


def test_palette_images_with_and_without_transparency():
    palette = _noise(90, 61, seed=2).quantize(colors=64)
    assert palette.mode == "P"
    _assert_parity(_reopen_png(palette))
    palette.info["transparency"] = 3  # one palette entry is transparent
    reopened = _reopen_png(palette)
    assert reopened.info.get("transparency") is not None
    _assert_parity(reopened)


def test_grayscale_parity():
    image = _noise(200, 150, "L", seed=3)
    ours = _assert_parity(image)
    # The three channels saw the same grey levels: only mean/std differ between them.
    cols = ours.normalized().reshape(-1, 3, 2, 14, 14)
    restored = cols * STD[None, :, None, None, None] + MEAN[None, :, None, None, None]
    np.testing.assert_allclose(restored[:, 0], restored[:, 1], atol=1e-5)


def test_image_is_duplicated_temporally_and_counts_tokens():
    ours = preprocess_image(_noise(56, 84), VisionPreprocessConfig())
    # One frame per temporal patch travels; the encoder input holds it twice.
    assert ours.temporal_repeat == 2 and ours.pixel_values.shape == (24, 588)
    cols = ours.normalized().reshape(-1, 3, 2, 14 * 14)  # [patches, c, tau, pixels]
    np.testing.assert_array_equal(cols[:, :, 0], cols[:, :, 1])
    one_frame = normalize_levels(ours.pixel_values, ours.pixel_lut).reshape(-1, 3, 196)
    np.testing.assert_array_equal(cols[:, :, 0], one_frame)
    on_device = encoder_pixels(ours.pixel_values, ours.pixel_lut, torch.device("cpu"), ours.temporal_repeat)
    np.testing.assert_array_equal(on_device.numpy(), ours.normalized())
    assert ours.grid_thw == (1, 6, 4)
    assert ours.num_tokens == 6


def test_smart_resize_matches_transformers_on_random_sizes():
    rng = random.Random(0)
    for _ in range(3000):
        h, w = rng.randint(1, 6000), rng.randint(1, 6000)
        if max(h, w) / min(h, w) > 200:
            continue
        lo = rng.choice([3136, 256 * 784, 128 * 784])
        hi = rng.choice([CKPT_MAX, 1280 * 784, 768 * 784])
        assert smart_resize(h, w, 28, lo, hi) == hf_smart_resize(h, w, 28, lo, hi), (h, w, lo, hi)


# ---------------------------------------------------------------------------------------------
# Worked examples (checkpoint defaults; docs/models.md, Qwen2-VL: image preprocessing), as literal numbers


@pytest.mark.parametrize(
    "width,height,max_pixels,resized_wh,grid,tokens",
    [
        (1000, 750, CKPT_MAX, (1008, 756), (1, 54, 72), 972),
        (224, 224, CKPT_MAX, (224, 224), (1, 16, 16), 64),
        (742, 742, CKPT_MAX, (728, 728), (1, 52, 52), 676),
        (1920, 1080, CKPT_MAX, (1932, 1092), (1, 78, 138), 2691),
        (1920, 1080, 1280 * 784, (1316, 728), (1, 52, 94), 1222),
        (4000, 3000, CKPT_MAX, (4004, 2996), (1, 214, 286), 15301),
        (28, 28, CKPT_MAX, (56, 56), (1, 4, 4), 4),
        (10, 10, CKPT_MAX, (56, 56), (1, 4, 4), 4),
        (8000, 8000, CKPT_MAX, (3584, 3584), (1, 256, 256), 16384),
        # "A huge square -> 3584" is only true up to float error: w/beta is
        # sqrt(max_pixels) = 3584 exactly on paper, but can land on 127.999.../28 and floor to 127.
        # transformers does the same (the random-size test above pins our arithmetic to it).
        (20000, 20000, CKPT_MAX, (3556, 3556), (1, 254, 254), 16129),
    ],
)
def test_spec_worked_examples(width, height, max_pixels, resized_wh, grid, tokens):
    h, w = smart_resize(height, width, 28, 3136, max_pixels)
    assert (w, h) == resized_wh
    visual = ProcessedVisual(np.empty((0, 1176), np.float32), (1, h // 14, w // 14))
    assert visual.grid_thw == grid
    assert visual.num_tokens == tokens
    assert grid[1] * grid[2] == 4 * tokens  # ViT patches = 4 per LLM token


def test_aspect_ratio_over_200_is_a_400():
    with pytest.raises(InvalidRequest, match="aspect ratio .* exceeds 200"):
        smart_resize(1, 201)
    with pytest.raises(InvalidRequest, match="exceeds 200") as info:
        preprocess_image(_noise(201, 1), VisionPreprocessConfig())
    assert info.value.http_status == 400


# ---------------------------------------------------------------------------------------------
# Video against a straightforward implementation of the patch layout (odd count: repeat the last frame)


def _reference_video(frames: list[Image.Image], size_hw: tuple[int, int]) -> tuple[np.ndarray, tuple]:
    """Loop over temporal patches, merge windows and the 4 patches in them; one row each."""
    h, w = size_hw
    normed = []
    for f in frames:
        u8 = np.asarray(f.convert("RGB").resize((w, h), Image.Resampling.BICUBIC))
        x = (u8.astype(np.float64) * (1 / 255)).astype(np.float32)
        normed.append(((x - MEAN) / STD).transpose(2, 0, 1))  # [3, h, w]
    if len(normed) % 2:
        normed.append(normed[-1])
    gt, gh, gw = len(normed) // 2, h // 14, w // 14
    rows = []
    for t in range(gt):
        for wr in range(gh // 2):
            for wc in range(gw // 2):
                for mr in range(2):
                    for mc in range(2):
                        y0, x0 = (2 * wr + mr) * 14, (2 * wc + mc) * 14
                        row = [
                            normed[2 * t + tau][c, y0 : y0 + 14, x0 : x0 + 14].reshape(-1)
                            for c in range(3)
                            for tau in range(2)
                        ]  # (c, tau, y, x)
                        rows.append(np.concatenate(row))
    return np.stack(rows), (gt, gh, gw)


@pytest.mark.parametrize("count", [4, 3])
def test_video_matches_spec_reference(count):
    frames = [_noise(100, 80, seed=10 + i) for i in range(count)]
    frames[-1] = _noise(70, 90, seed=99)  # a differently sized frame is stretched
    cfg = VisionPreprocessConfig()
    h, w = smart_resize(80, 100, 28, cfg.video_min_pixels, cfg.video_max_pixels)
    assert (h, w) == (308, 364)  # grown to the 128*784 video minimum
    ours = preprocess_video(frames, cfg)
    ref, grid = _reference_video(frames, (h, w))
    assert ours.grid_thw == grid == (2, h // 14, w // 14)
    assert ours.num_tokens == 2 * (h // 28) * (w // 28) == 286
    np.testing.assert_array_equal(ours.normalized(), ref)
    on_device = encoder_pixels(ours.pixel_values, ours.pixel_lut, torch.device("cpu"))
    np.testing.assert_array_equal(on_device.numpy(), ref)


def test_video_uses_video_pixel_budget_and_odd_padding_repeats_last_frame():
    cfg = VisionPreprocessConfig(video_min_pixels=3136, video_max_pixels=56 * 56)
    frames = [_noise(300, 200, seed=i) for i in range(3)]
    ours = preprocess_video(frames, cfg)
    h, w = smart_resize(200, 300, 28, 3136, 56 * 56)
    assert ours.grid_thw == (2, h // 14, w // 14)
    second_pair = ours.pixel_values.reshape(2, -1, 3, 2, 196)[1]  # [patches, c, tau, px]
    np.testing.assert_array_equal(second_pair[:, :, 0], second_pair[:, :, 1])
    with pytest.raises(InvalidRequest):
        preprocess_video([], cfg)


# ---------------------------------------------------------------------------------------------
# Configuration


def test_config_from_model_folder(tmp_path):
    assert VisionPreprocessConfig.from_model_folder(None) == VisionPreprocessConfig()
    assert VisionPreprocessConfig.from_model_folder(str(tmp_path)) == VisionPreprocessConfig()
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "min_pixels": 3136,
                "max_pixels": 1003520,
                "patch_size": 14,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.25, 0.25, 0.25],
                "image_processor_type": "Qwen2VLImageProcessor",
            }
        )
    )
    cfg = VisionPreprocessConfig.from_model_folder(str(tmp_path))
    assert cfg.max_pixels == 1003520 and cfg.image_mean == (0.5, 0.5, 0.5) and cfg.image_std == (0.25,) * 3

    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 200704, "longest_edge": 1003520}})
    )
    cfg = VisionPreprocessConfig.from_model_folder(str(tmp_path))
    assert (cfg.min_pixels, cfg.max_pixels) == (200704, 1003520)

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_pixels": "big"}))
    with pytest.raises(ConfigError, match="max_pixels"):
        VisionPreprocessConfig.from_model_folder(str(tmp_path))


def test_request_overrides():
    base = VisionPreprocessConfig()
    assert base.with_overrides(None, "mm_processor_kwargs") is base
    cfg = base.with_overrides({"max_pixels": 1280 * 784, "video_max_pixels": 256 * 784}, "mm_processor_kwargs")
    assert cfg.max_pixels == 1280 * 784 and cfg.video_max_pixels == 256 * 784
    assert cfg.cache_key() != base.cache_key() and base.cache_key() == VisionPreprocessConfig().cache_key()
    bad = [
        ({"patch_size": 16}, "patch_size"),
        ({"max_pixels": 0}, "max_pixels"),
        ({"min_pixels": True}, "min_pixels"),
        ({"min_pixels": 1.5}, "min_pixels"),
        ({"min_pixels": CKPT_MAX + 1}, "min_pixels"),
        ({"video_max_pixels": 10}, "video_max_pixels"),
    ]
    for kwargs, key in bad:
        with pytest.raises(InvalidRequest, match=key) as info:
            base.with_overrides(kwargs, "mm_processor_kwargs")
        assert info.value.param == "mm_processor_kwargs"
