"""A media part's own settings: OpenAI's `image_url.detail` and Qwen's per-item keys (qwen-vl-utils' names).

The images are checked against transformers' Qwen2-VL processor run with the pixel budget each setting stands
for (detail "low": OpenAI's 512x512 version, as max_pixels 512 * 512), the videos against the same request with
the setting given for the whole request; unknown keys are refused, not dropped."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from pagoda.errors import InvalidRequest
from pagoda.frontend.multimodal.chat import MultiModalServing, build_inputs, split_content
from pagoda.frontend.multimodal.image_processor import ProcessedVisual, VisionPreprocessConfig
from pagoda.frontend.multimodal.media import MediaPolicy
from pagoda.frontend.multimodal.prompt import PlaceholderIds

IMAGE_PAD, VIDEO_PAD = 151655, 151656
CKPT_MAX = 12845056  # the official checkpoints' max_pixels


def _png(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _uri(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"


def _hf(image: Image.Image, max_pixels: int, min_pixels: int = 3136) -> tuple[np.ndarray, tuple[int, int, int]]:
    proc = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    out = proc(images=image, return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def _serving(max_pixels: int = CKPT_MAX) -> MultiModalServing:
    cfg = VisionPreprocessConfig(max_pixels=max_pixels)
    return MultiModalServing(PlaceholderIds(IMAGE_PAD, VIDEO_PAD), 2, cfg, MediaPolicy())


def _build(parts: list[dict], mm: MultiModalServing | None = None, request_kwargs: dict | None = None):
    _, refs = split_content([{"role": "user", "content": parts}])
    ids = [1] + [IMAGE_PAD if r.modality == "image" else VIDEO_PAD for r in refs] + [2]
    return asyncio.run(build_inputs(mm or _serving(), ids, refs, request_kwargs))


def _assert_item_is(item, reference: tuple[np.ndarray, tuple[int, int, int]]) -> None:
    pixels, grid = reference
    assert item.grid_thw == grid
    assert item.length == grid[0] * grid[1] * grid[2] // 4
    visual = ProcessedVisual(item.pixel_values, item.grid_thw, 2, item.pixel_lut, item.temporal_repeat)
    np.testing.assert_array_equal(visual.normalized(), pixels)


def test_detail_low_is_the_512x512_budget_and_high_or_auto_the_models():
    image = _png(1000, 750)
    low, high, auto, unset = (
        {"type": "image_url", "image_url": {"url": _uri(image), "detail": d}} for d in ("low", "high", "auto", None)
    )
    ids, inputs = _build([low, high, auto, unset])
    low_item, *full_items = inputs.items
    _assert_item_is(low_item, _hf(image, 512 * 512))
    assert low_item.length == 15 * 21  # 420 x 588 pixels
    for item in full_items:
        _assert_item_is(item, _hf(image, CKPT_MAX))
        assert item.length == 27 * 36  # 756 x 1008 pixels
    assert ids.count(IMAGE_PAD) == low_item.length + 3 * 27 * 36
    assert low_item.content_hash != full_items[0].content_hash


def test_detail_low_never_raises_a_lower_budget_and_a_small_image_is_unchanged():
    image = _png(1000, 750, seed=1)
    low = {"type": "image_url", "image_url": {"url": _uri(image), "detail": "low"}}
    _, inputs = _build([low], mm=_serving(64 * 784))
    _assert_item_is(inputs.items[0], _hf(image, 64 * 784))
    small = _png(300, 200, seed=2)
    parts = [{"type": "image_url", "image_url": {"url": _uri(small), "detail": d}} for d in ("low", "auto")]
    _, inputs = _build(parts)
    low_item, auto_item = inputs.items
    _assert_item_is(low_item, _hf(small, CKPT_MAX))
    assert low_item.content_hash == auto_item.content_hash  # the same pixels: one encoder output serves both


def test_qwen_per_image_pixel_budgets_apply_to_their_image_alone():
    image = _png(640, 480, seed=3)
    parts = [
        {"type": "image", "image": _uri(image), "max_pixels": 128 * 784},
        {"type": "image_url", "image_url": {"url": _uri(image)}, "min_pixels": 1024 * 784},
        {"type": "image", "image": _uri(image)},
    ]
    _, inputs = _build(parts, request_kwargs={"max_pixels": 2048 * 784})
    capped, grown, plain = inputs.items
    _assert_item_is(capped, _hf(image, 128 * 784))
    _assert_item_is(grown, _hf(image, 2048 * 784, min_pixels=1024 * 784))
    _assert_item_is(plain, _hf(image, 2048 * 784))
    assert capped.length < plain.length < grown.length


def _video_uri(frames: int = 30, fps: int = 10) -> str:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "bgr0"
        for i in range(frames):
            arr = np.random.default_rng(i).integers(0, 256, (48, 64, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return f"data:video/x-matroska;base64,{base64.b64encode(buf.getvalue()).decode()}"


def test_qwen_per_video_sampling_equals_the_request_wide_setting():
    url = _video_uri()
    for part_keys, request_kwargs in (
        ({"nframes": 4}, {"nframes": 4}),
        ({"fps": 1}, {"fps": 1}),
        ({"max_pixels": 4 * 784, "min_pixels": 784}, {"video_max_pixels": 4 * 784, "video_min_pixels": 784}),
    ):
        ids, inputs = _build([{"type": "video", "video": url, **part_keys}])
        ref_ids, ref_inputs = _build([{"type": "video", "video": url}], request_kwargs=request_kwargs)
        _, default = _build([{"type": "video", "video": url}])
        (item,), (ref,) = inputs.items, ref_inputs.items
        assert ids == ref_ids and item.grid_thw == ref.grid_thw
        np.testing.assert_array_equal(item.pixel_values, ref.pixel_values)
        assert item.grid_thw != default.items[0].grid_thw  # the setting changed something


@pytest.mark.parametrize(
    "part,fragment",
    [
        ({"type": "image_url", "image_url": {"url": "data:,", "detail": "medium"}}, "detail must be one of"),
        ({"type": "image_url", "image_url": {"url": "data:,", "uuid": "a"}}, "'uuid'"),
        ({"type": "image_url", "image_url": {"url": "data:,"}, "cache_control": {}}, "'cache_control'"),
        ({"type": "image_url", "image_url": {"url": "data:,"}, "uuid": 5}, "uuid must be a string"),
        ({"type": "image", "image": "data:,", "resized_height": 280}, "'resized_height'"),
        ({"type": "video_url", "video_url": {"url": "data:,", "detail": "low"}}, "'detail'"),
        ({"type": "video", "video": "data:,", "fps": 1, "video_start": 2.0}, "'video_start'"),
    ],
)
def test_unknown_or_bad_part_keys_are_refused_naming_them(part, fragment):
    with pytest.raises(InvalidRequest, match=fragment) as caught:
        split_content([{"role": "user", "content": [{"type": "text", "text": "look"}, part]}])
    assert "messages[0].content[1]" in caught.value.message


def test_vllm_uuid_is_accepted_and_the_content_still_decides():
    """vLLM clients name items with `uuid`; Pagoda's caches go by content, so two images under one uuid stay two."""
    first, second = _png(64, 48, seed=5), _png(64, 48, seed=6)
    parts = [
        {"type": "image_url", "image_url": {"url": _uri(first)}, "uuid": "same"},
        {"type": "image_url", "image_url": {"url": _uri(second)}, "uuid": "same"},
        {"type": "image", "image": _uri(first), "uuid": None},
    ]
    _, inputs = _build(parts)
    a, b, again = inputs.items
    assert a.content_hash != b.content_hash and a.content_hash == again.content_hash


@pytest.mark.parametrize(
    "part,fragment",
    [
        ({"type": "image", "image": "data:,", "max_pixels": 0}, "max_pixels must be a positive integer"),
        ({"type": "image", "image": "data:,", "max_pixels": CKPT_MAX * 2}, "over the model's limit"),
        ({"type": "image", "image": "data:,", "min_pixels": CKPT_MAX + 784}, "must not exceed"),
        ({"type": "video", "video": "data:,", "nframes": 4, "fps": 2}, "either fps or nframes"),
    ],
)
def test_bad_part_settings_are_refused_before_any_fetch(part, fragment):
    # "data:," is no image at all: the refusal names the setting, so nothing was fetched or decoded first.
    with pytest.raises(InvalidRequest, match=fragment) as caught:
        _build([part])
    assert "messages[0].content[0]" in caught.value.message
    assert caught.value.param == "messages"
