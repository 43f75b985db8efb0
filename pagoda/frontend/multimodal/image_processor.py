"""Qwen2-VL image / video preprocessing (docs/models.md, Qwen2-VL: image preprocessing, video patches).

Bit-exact with transformers' `Qwen2VLImageProcessorPil` on the CPU: the same RGB conversion
(alpha composited onto white), the same `smart_resize` arithmetic (Python round-half-to-even),
PIL bicubic on uint8, the same float64 rescale then float32 normalise, and the same patch order.
Exactness matters because the content hash of the pixels keys the prefix and encoder caches, and
because our golden tests compare logits against transformers.

Speed matters too (users' pitfall #2: CPU-bound preprocessing starves the GPU): the resized frames
stay uint8 through the patchify (one reshape/transpose copy, no Python loops over pixels or patches),
and normalisation is a 256-entry lookup table per channel (same bits as the arithmetic, since it is
elementwise) carried beside the levels and applied where the patches are used, on the device: a
quarter of float32's bytes to hash, send to the engine core and copy to the GPU.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
from PIL import Image

from pagoda.errors import ConfigError, InvalidRequest
from pagoda.frontend.multimodal.banded_resize import resize_bicubic
from pagoda.inputs import expand_temporal

MAX_ASPECT_RATIO = 200

# Keys a request may override through `mm_processor_kwargs`. The other settings are properties of
# the checkpoint's vision tower and must not change per request.
_PIXEL_KEYS = ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels", "video_total_pixels")
# Frame sampling of a video *file* (qwen-vl-utils' names) -> the config field it sets.
_SAMPLING_KEYS = {
    "fps": "video_fps",
    "nframes": "video_nframes",
    "min_frames": "video_min_frames",
    "max_frames": "video_max_frames",
}
_OVERRIDABLE = (*_PIXEL_KEYS, *_SAMPLING_KEYS)
# Most frames sampled from one video file: qwen-vl-utils' FPS_MAX_FRAMES, also the cap on overrides
# (memory and the encoder's work grow with the frame count).
MAX_SAMPLED_FRAMES = 768
MAX_SAMPLING_FPS = 60.0


@dataclass(frozen=True)
class VisionPreprocessConfig:
    """Preprocessing settings. Defaults are the official Qwen2-VL checkpoints' preprocessor_config.json
    values (images: 4 to 16384 tokens) and qwen-vl-utils' video settings."""

    min_pixels: int = 3136  # 4 * 28 * 28
    max_pixels: int = 12845056  # 16384 * 28 * 28
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    video_min_pixels: int = 128 * 784
    video_max_pixels: int = 768 * 784
    # Video files only (a video given as frames uses its frames as sent): the total pixel
    # budget shared by the sampled frames, and the frame sampling (`video_nframes`, when set, wins over fps).
    video_total_pixels: int = 24576 * 784
    video_fps: float = 2.0
    video_nframes: int | None = None
    video_min_frames: int = 4
    video_max_frames: int = MAX_SAMPLED_FRAMES

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one LLM token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_model_folder(cls, folder: str | None) -> VisionPreprocessConfig:
        """Read `preprocessor_config.json` from a checkpoint folder; defaults when it is absent.

        Like transformers, explicit `min_pixels`/`max_pixels` win over the newer nested
        `size: {shortest_edge, longest_edge}` spelling when a file has both.
        """
        if folder is None:
            return cls()
        path = os.path.join(folder, "preprocessor_config.json")
        if not os.path.isfile(path):
            return cls()
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"Cannot read {path}: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls(**_settings_from_json(raw, path))

    def with_overrides(self, kwargs: dict[str, Any] | None, param: str) -> VisionPreprocessConfig:
        """Apply a request's (or the server's) `mm_processor_kwargs`: pixel budgets and video frame
        sampling (fps | nframes, min_frames, max_frames); bad input is a 400."""
        if not kwargs:
            return self
        if not isinstance(kwargs, dict):
            raise InvalidRequest(f"{param} must be an object, got {type(kwargs).__name__}.", param)
        if "fps" in kwargs and "nframes" in kwargs:
            raise InvalidRequest(f"{param}: give either fps or nframes for a video, not both.", param)
        updates: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key not in _OVERRIDABLE:
                raise InvalidRequest(f"{param}: unknown key {key!r}; supported keys: {', '.join(_OVERRIDABLE)}.", param)
            if key == "fps":
                if not _is_positive_number(value) or value > MAX_SAMPLING_FPS:
                    raise InvalidRequest(
                        f"{param}.fps must be a number in (0, {MAX_SAMPLING_FPS:g}], got {value!r}.", param
                    )
                updates["video_fps"] = float(value)
                updates["video_nframes"] = None  # fps given at a later layer wins over an earlier nframes
                continue
            if not _is_positive_int(value):
                raise InvalidRequest(f"{param}.{key} must be a positive integer, got {value!r}.", param)
            if key in _SAMPLING_KEYS and value > MAX_SAMPLED_FRAMES:
                raise InvalidRequest(f"{param}.{key} must be at most {MAX_SAMPLED_FRAMES} frames, got {value}.", param)
            updates[_SAMPLING_KEYS.get(key, key)] = value
        cfg = replace(self, **updates)
        for lo, hi in (
            ("min_pixels", "max_pixels"),
            ("video_min_pixels", "video_max_pixels"),
            ("video_min_frames", "video_max_frames"),
        ):
            if getattr(cfg, lo) > getattr(cfg, hi):
                bad = lo if lo in updates else hi
                raise InvalidRequest(
                    f"{param}.{_key_of(bad)}: {_key_of(lo)} ({getattr(cfg, lo)}) must not exceed "
                    f"{_key_of(hi)} ({getattr(cfg, hi)}).",
                    param,
                )
        return cfg

    def cache_key(self) -> str:
        """Every setting that changes the pixels of given frames, as a stable string (part of content hashes).

        The leading tag versions the algorithm itself: bump it if preprocessing ever changes. The video
        file sampling settings are left out: they choose which frames are decoded (and the total-pixel
        budget their size), which the hashed pixels themselves show.
        """
        values = ",".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name not in _NOT_IN_CACHE_KEY
        )
        return f"qwen2vl-pil-v1({values})"


_NOT_IN_CACHE_KEY = frozenset(("video_total_pixels", *_SAMPLING_KEYS.values()))


def _key_of(field_name: str) -> str:
    """The mm_processor_kwargs key that sets a config field."""
    return next((key for key, name in _SAMPLING_KEYS.items() if name == field_name), field_name)


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _settings_from_json(raw: dict[str, Any], path: str) -> dict[str, Any]:
    """Pick and validate the settings we use from a preprocessor_config.json object."""
    out: dict[str, Any] = {}
    size = raw.get("size")
    if isinstance(size, dict):
        if "shortest_edge" in size:
            out["min_pixels"] = size["shortest_edge"]
        if "longest_edge" in size:
            out["max_pixels"] = size["longest_edge"]
    for key in ("min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size"):
        if raw.get(key) is not None:
            out[key] = raw[key]
    for key, value in out.items():
        if not _is_positive_int(value):
            raise ConfigError(f"{path}: {key} must be a positive integer, got {value!r}")
    for key in ("image_mean", "image_std"):
        if raw.get(key) is not None:
            out[key] = _three_floats(raw[key], key, path)
    if out.get("min_pixels", 3136) > out.get("max_pixels", 12845056):
        raise ConfigError(f"{path}: min_pixels must not exceed max_pixels")
    if any(s <= 0 for s in out.get("image_std", (1.0,))):
        raise ConfigError(f"{path}: image_std values must be positive")
    return out


def _three_floats(value: Any, key: str, path: str) -> tuple[float, float, float]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 3
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        raise ConfigError(f"{path}: {key} must be a list of 3 numbers, got {value!r}")
    return (float(value[0]), float(value[1]), float(value[2]))


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: float = 3136, max_pixels: float = 12845056
) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, ~aspect-preserving, pixel count in range.

    Follows transformers' arithmetic to the float operation: `round` is
    Python's round-half-to-even (742/28 = 26.5 -> 26), the shrink branch floors and keeps at
    least one factor, the grow branch ceils, and there is no re-check afterwards.
    """
    if height <= 0 or width <= 0:
        raise InvalidRequest(f"Image has an empty side ({width}x{height}).", "messages")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise InvalidRequest(
            f"Image aspect ratio {ratio:.1f} ({width}x{height}) exceeds {MAX_ASPECT_RATIO}.", "messages"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass
class ProcessedVisual:
    """Encoder input for one image or video, as uint8 levels and the lookup table that normalises them.

    The normalised float32 patches are `lut[channel, level]` exactly (see `_normalize_lut`), so the
    levels plus a 3 KB table carry the same bits in a quarter of the bytes: that is what is hashed,
    sent to the engine core and copied to the device, where one gather normalises them (the worker's
    `encoder_runner.encoder_pixels`). A still image's T frames per temporal patch are one frame: its rows hold
    that frame once (`temporal_repeat` = T, `inputs.expand_temporal`), half the bytes again.
    `normalized()` gives the float32 patches on the host (references, tests).
    """

    pixel_values: np.ndarray  # uint8 [num_patches, 3 * T' * p * p], num_patches = t*h*w, T' = T / temporal_repeat
    grid_thw: tuple[int, int, int]  # patch grid (t, h, w) before the merge
    merge_size: int = 2
    pixel_lut: np.ndarray | None = None  # float32 [3, 256]: the normalised value of each level per channel
    temporal_repeat: int = 1

    @property
    def num_tokens(self) -> int:
        """LLM placeholder tokens: one per merge window (merge_size**2 patches) per temporal patch."""
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size**2

    def normalized(self) -> np.ndarray:
        """float32 [num_patches, 3 * T * p * p]: what the vision tower sees."""
        rows = self.pixel_values if self.pixel_lut is None else normalize_levels(self.pixel_values, self.pixel_lut)
        return np.ascontiguousarray(expand_temporal(rows, self.temporal_repeat))


def normalize_levels(levels: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """uint8 patch rows [P, C * T * p * p] -> float32 through the per-channel table `lut` [C, 256]; a
    row's columns are channel-major ((c * T + tau) * p + y) * p + x, so column j has channel j // (T*p*p)."""
    channels = lut.shape[0]
    channel = np.arange(levels.shape[1]) // (levels.shape[1] // channels)  # [C*T*p*p]
    return lut[channel[None, :], levels]


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency composited onto white, as transformers does.

    A plain `convert("RGB")` would drop alpha and expose whatever colour sits under transparent
    pixels (often black), which changes what the model sees and breaks parity.
    """
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _normalize_lut(cfg: VisionPreprocessConfig) -> np.ndarray:
    """[3, 256] float32: the normalised value of every uint8 level per channel.

    Same operations and dtypes as transformers (x * (1/255) in float64, cast to float32, then
    (x - mean) / std in float32), so a lookup gives identical bits.
    """
    levels = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)  # [256]
    mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None]  # [3, 1]
    std = np.asarray(cfg.image_std, dtype=np.float32)[:, None]  # [3, 1]
    return (levels[None, :] - mean) / std  # [3, 256]


def _resize(image: Image.Image, size_hw: tuple[int, int]) -> np.ndarray:
    """RGB-convert and bicubic-resize one frame on uint8 -> uint8 [H, W, 3] (PIL's resize, in bands on threads)."""
    return resize_bicubic(to_rgb(image), size_hw)


def _patchify(frames: np.ndarray, cfg: VisionPreprocessConfig, tp: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """frames [n, H, W, C] with n % tp == 0 -> ([t*gh*gw, C*tp*p*p], (t, gh, gw)), same dtype; tp frames per
    temporal patch (the processor's T, or 1 for a still image's one frame).

    Rows: temporal patch, then merge window (raster), then the m*m patches inside it (raster).
    Columns: (c, tau, y, x). One transpose-copy; no per-patch work.
    """
    n, height, width, channels = frames.shape
    p, m = cfg.patch_size, cfg.merge_size
    gt, gh, gw = n // tp, height // p, width // p
    x = frames.reshape(gt, tp, gh // m, m, p, gw // m, m, p, channels)
    # axes: 0 t, 1 tau, 2 window-row, 3 row-in-window, 4 y, 5 window-col, 6 col-in-window, 7 x, 8 c
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # [t, wr, wc, mr, mc, c, tau, y, x]
    patches = np.ascontiguousarray(x).reshape(gt * gh * gw, channels * tp * p * p)
    return patches, (gt, gh, gw)


def preprocess_image(image: Image.Image, cfg: VisionPreprocessConfig) -> ProcessedVisual:
    """One still image -> encoder input; the image is treated as a T-frame clip of itself."""
    height, width = image.height, image.width
    size_hw = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    frame = _resize(image, size_hw)  # [H, W, 3] uint8
    levels, grid = _patchify(frame[None], cfg, 1)  # the frame once; the encoder input repeats it T times
    return ProcessedVisual(levels, grid, cfg.merge_size, _normalize_lut(cfg), cfg.temporal_patch_size)


def preprocess_video(
    frames: list[Image.Image], cfg: VisionPreprocessConfig, size_hw: tuple[int, int] | None = None
) -> ProcessedVisual:
    """A video given as frames -> encoder input (docs/models.md, Qwen2-VL: video patches).

    Every frame is resized to the size smart_resize picks for the first frame under the video
    pixel budget (frames of other sizes are stretched to it), and the frame count is padded to a
    multiple of T by repeating the last frame. `size_hw` is that size when the caller chose it
    already (a decoded video file, whose frames come resized to it under the video's total budget).
    """
    if not frames:
        raise InvalidRequest("A video needs at least one frame.", "messages")
    first = frames[0]
    if size_hw is None:
        size_hw = smart_resize(first.height, first.width, cfg.factor, cfg.video_min_pixels, cfg.video_max_pixels)
    tp = cfg.temporal_patch_size
    n = len(frames)
    padded = n + (-n) % tp
    out = np.empty((padded, size_hw[0], size_hw[1], 3), dtype=np.uint8)  # [n', H, W, 3]
    for i, frame in enumerate(frames):
        out[i] = _resize(frame, size_hw)
    out[n:] = out[n - 1]
    levels, grid = _patchify(out, cfg, tp)
    return ProcessedVisual(levels, grid, cfg.merge_size, _normalize_lut(cfg))
