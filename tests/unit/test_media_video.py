"""Video files in content parts: qwen-vl-utils' frame sampling (docs/models.md, Qwen2-VL: video frame
sampling) checked against
hand-computed indices, decoding with PyAV (tiny videos made in memory, frame i painted so the sampled
frames can be told apart), the loading paths images use (data:, file://, http(s)), the limits (bytes,
duration, frames, frame size) and bad files as 400s, and the chat parser's single-URL video forms."""

from __future__ import annotations

import asyncio
import base64
import io
import threading

import av
import httpx
import numpy as np
import pytest
from PIL import Image

from pagoda.errors import InvalidRequest
from pagoda.frontend.multimodal import media, video
from pagoda.frontend.multimodal.chat import MediaRef, MultiModalServing, build_inputs, split_content
from pagoda.frontend.multimodal.image_processor import VisionPreprocessConfig, preprocess_video
from pagoda.frontend.multimodal.media import MediaPolicy
from pagoda.frontend.multimodal.prompt import PlaceholderIds
from pagoda.frontend.multimodal.video import (
    decode_video,
    frame_pixel_budget,
    load_video,
    sample_frame_count,
    sample_indices,
)

WHERE = "messages[0].content[1]"
CFG = VisionPreprocessConfig()
W, H = 48, 32


def _gray(i: int) -> np.ndarray:
    """Frame i of the lossy test videos: a flat gray of level 8*i (survives YUV 4:2:0 within a few levels)."""
    return np.full((H, W, 3), 8 * i, np.uint8)


def _noise(i: int) -> np.ndarray:
    """Frame i of the lossless test videos: seeded noise, so a frame is identified exactly."""
    return np.random.default_rng(i).integers(0, 256, (H, W, 3), dtype=np.uint8)


def _make_video(
    frames: int = 30,
    fps: int = 10,
    fmt: str = "mp4",
    codec: str = "libx264",
    pix_fmt: str = "yuv420p",
    paint=_gray,
) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = W, H, pix_fmt
        for i in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(paint(i), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _lossless(frames: int = 30, fps: int = 10) -> bytes:
    return _make_video(frames, fps, "matroska", "ffv1", "bgr0", _noise)


MP4 = _make_video()  # 30 frames at 10 fps: 3 s


def _uri(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _load(url: str, policy: MediaPolicy | None = None, cfg: VisionPreprocessConfig = CFG) -> video.DecodedVideo:
    return asyncio.run(load_video(url, policy or MediaPolicy(), cfg, WHERE))


def _refused(data_or_url: bytes | str, match: str, policy: MediaPolicy | None = None, cfg=CFG) -> str:
    url = data_or_url if isinstance(data_or_url, str) else _uri(data_or_url)
    with pytest.raises(InvalidRequest, match=match) as info:
        _load(url, policy, cfg)
    assert str(info.value).startswith(f"{WHERE}: "), str(info.value)
    return str(info.value)


def _levels(clip: video.DecodedVideo) -> list[int]:
    """Which gray frame each decoded frame is (frame i has level 8*i)."""
    return [round(float(np.asarray(f).mean()) / 8) for f in clip.frames]


# ----------------------------------------------------------------------------------------------
# Sampling: hand-computed from qwen-vl-utils' rule (n = N/f*fps clamped to [ceil_even(4), floor_even(min(768, N))],
# rounded to even; indices = round(linspace(0, N-1, n)))


@pytest.mark.parametrize(
    ("total", "fps", "n", "indices"),
    [
        # 3 s at 10 fps: 30/10*2 = 6; linspace(0, 29, 6) = 0, 5.8, 11.6, 17.4, 23.2, 29
        (30, 10, 6, [0, 6, 12, 17, 23, 29]),
        # 1 s: 10/10*2 = 2 -> raised to min_frames 4; linspace(0, 9, 4) = 0, 3, 6, 9
        (10, 10, 4, [0, 3, 6, 9]),
        # 25 frames at 25 fps: 2 -> 4; step 24/3 = 8
        (25, 25, 4, [0, 8, 16, 24]),
        # 3 frames: max_frames = floor_even(min(768, 3)) = 2 wins over min_frames
        (3, 10, 2, [0, 2]),
        # 4.5 s at 10 fps: 9 -> round(9/2) = round(4.5) = 4 (half to even) -> 8; step 44/7
        (45, 10, 8, [0, 6, 13, 19, 25, 31, 38, 44]),
        # 5.5 s: 11 -> round(5.5) = 6 -> 12; step 54/11
        (55, 10, 12, [0, 5, 10, 15, 20, 25, 29, 34, 39, 44, 49, 54]),
    ],
)
def test_sampling_matches_the_formula(total, fps, n, indices):
    assert sample_frame_count(total, fps, CFG) == n
    assert sample_indices(total, n) == indices


def test_sampling_caps_and_overrides():
    assert sample_frame_count(18000, 30, CFG) == 768  # 600 s at 30 fps: 1200 -> max_frames 768
    assert sample_frame_count(300, 30, CFG) == 20  # docs/models.md's example: 10 s at 30 fps
    assert sample_indices(300, 20)[:5] == [0, 16, 31, 47, 63]  # 299/19 = 15.74 per step
    assert sample_indices(300, 20)[-1] == 299
    fps5 = CFG.with_overrides({"fps": 5}, "mm_processor_kwargs")
    assert sample_frame_count(30, 10, fps5) == 16  # 15 -> round(7.5) = 8 -> 16
    assert sample_frame_count(30, 10, CFG.with_overrides({"nframes": 7}, "k")) == 8  # round(3.5) = 4 -> 8
    assert sample_frame_count(30, 10, CFG.with_overrides({"nframes": 5}, "k")) == 4  # round(2.5) = 2 -> 4
    bounded = CFG.with_overrides({"min_frames": 5, "max_frames": 9}, "k")
    assert sample_frame_count(10, 10, bounded) == 6  # 2 -> ceil_even(5) = 6
    assert sample_frame_count(100, 10, bounded) == 8  # 20 -> floor_even(9) = 8


def test_frame_pixel_budget():
    assert frame_pixel_budget(CFG, 20) == 768 * 784  # 24576*784/20*2 is above video_max_pixels
    assert frame_pixel_budget(CFG, 768) == int(128 * 784 * 1.05)  # 64*784 is below the 1.05*min floor
    assert frame_pixel_budget(CFG, 100) == 24576 * 784 / 100 * 2


def test_sampling_overrides_are_checked():
    def bad(kwargs, match):
        with pytest.raises(InvalidRequest, match=match):
            CFG.with_overrides(kwargs, "mm_processor_kwargs")

    bad({"fps": 2, "nframes": 8}, "either fps or nframes")
    bad({"fps": 0}, "fps must be a number")
    bad({"fps": True}, "fps must be a number")
    bad({"fps": 1000}, "fps must be a number")
    bad({"nframes": 2.5}, "nframes must be a positive integer")
    bad({"max_frames": 769}, "at most 768")
    bad({"min_frames": 10, "max_frames": 8}, "min_frames .10. must not exceed max_frames .8.")
    # A later layer's fps replaces an earlier layer's nframes (server default, then the request).
    server = CFG.with_overrides({"nframes": 8}, "--mm-processor-kwargs")
    assert server.with_overrides({"fps": 1.0}, "mm_processor_kwargs").video_nframes is None
    # Sampling knobs choose frames; they are not part of the pixel settings' cache key.
    assert server.cache_key() == CFG.cache_key()


# ----------------------------------------------------------------------------------------------
# Decoding


def test_mp4_data_uri_samples_the_expected_frames():
    clip = _load(_uri(MP4))
    assert (clip.total_frames, clip.fps, clip.source_size) == (30, 10.0, (W, H))
    assert clip.indices == (0, 6, 12, 17, 23, 29)
    assert _levels(clip) == [0, 6, 12, 17, 23, 29]
    assert clip.size_hw == (280, 392)  # smart_resize(32, 48) grown to video_min_pixels 128*784
    assert all(f.size == (392, 280) and f.mode == "RGB" for f in clip.frames)


def test_request_fps_changes_the_sampling():
    clip = _load(_uri(MP4), cfg=CFG.with_overrides({"fps": 1}, "mm_processor_kwargs"))
    assert clip.indices == (0, 10, 19, 29)  # 3 -> 4 frames (min), step 29/3
    assert _levels(clip) == [0, 10, 19, 29]
    clip = _load(_uri(MP4), cfg=CFG.with_overrides({"nframes": 10}, "mm_processor_kwargs"))
    assert _levels(clip) == [round(i * 29 / 9) for i in range(10)]


def test_lossless_frames_equal_the_source_frames():
    data = _lossless()
    clip = decode_video(data, MediaPolicy(), CFG, WHERE)
    assert clip.indices == (0, 6, 12, 17, 23, 29)
    h, w = clip.size_hw
    for frame, index in zip(clip.frames, clip.indices):
        expected = Image.fromarray(_noise(index)).resize((w, h), Image.Resampling.BICUBIC)
        assert np.array_equal(np.asarray(frame), np.asarray(expected)), index


def test_seeking_to_key_frames_gives_the_frames_decoding_everything_gives():
    """Key frames every 4 frames (B-frames between): each sampled frame is decoded from the key frame
    before it, the skipped ones never, and each is the frame the sequential decode gives."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=10, options={"g": "4", "keyint_min": "4", "bframes": "2"})
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for i in range(31):
            for packet in stream.encode(av.VideoFrame.from_ndarray(_gray(i), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    data = buf.getvalue()
    cfg = CFG.with_overrides({"fps": 1}, "mm_processor_kwargs")
    clip = decode_video(data, MediaPolicy(), cfg, WHERE)
    assert clip.indices == (0, 10, 20, 30) and _levels(clip) == [0, 10, 20, 30]
    total, _, _, timeline = video._probe(data, MediaPolicy(), WHERE, float("inf"))
    assert timeline is not None and total == 31 and 0 < timeline.keys[1] <= 4
    # Hand count: from the last key frame at or before each sampled frame up to it.
    expected = sum(i - max(k for k in timeline.keys if k <= i) + 1 for i in clip.indices)
    needed = video._frames_to_decode(list(clip.indices), timeline)
    assert needed == expected < 16
    # The pixel limit counts only those.
    decode_video(data, MediaPolicy(max_video_decode_pixels=needed * W * H), cfg, WHERE)
    with pytest.raises(InvalidRequest, match=f"decoding {needed} frames"):
        decode_video(data, MediaPolicy(max_video_decode_pixels=(needed - 1) * W * H), cfg, WHERE)


def test_webm_and_gif_decode():
    webm = _make_video(fmt="webm", codec="libvpx-vp9")
    assert _levels(_load(_uri(webm, "video/webm"))) == [0, 6, 12, 17, 23, 29]
    gif = _make_video(fmt="gif", codec="gif", pix_fmt="rgb8")
    assert decode_video(gif, MediaPolicy(), CFG, WHERE).indices == (0, 6, 12, 17, 23, 29)


def test_decoding_runs_off_the_event_loop(monkeypatch):
    threads = []
    real = video.decode_video

    def spy(*args):
        threads.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(video, "decode_video", spy)
    _load(_uri(MP4))
    assert threads and threads[0] != threading.get_ident()


# ----------------------------------------------------------------------------------------------
# Where the bytes come from: the image rules


def test_file_urls_only_under_the_allowed_path(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "clip.mp4").write_bytes(MP4)
    (tmp_path / "outside.mp4").write_bytes(MP4)
    policy = MediaPolicy(allowed_local_media_path=str(allowed))
    assert _levels(_load(f"file://{allowed}/clip.mp4", policy)) == [0, 6, 12, 17, 23, 29]
    _refused(f"file://{tmp_path}/outside.mp4", "outside the directory allowed", policy)
    _refused(f"file://{allowed}/../outside.mp4", "outside the directory allowed", policy)
    _refused(f"file://{allowed}/clip.mp4", "file:// URLs are disabled")  # no allowed path at all


def test_data_uri_must_say_video():
    _refused(_uri(MP4, "image/png"), "'image/png' is not a video; use data:video/")
    _refused("data:video/mp4;base64,!!!", "invalid base64")
    _refused("ftp://example.com/a.mp4", "unsupported URL scheme 'ftp'.*data:video/")


def test_http_fetch_and_its_byte_cap(monkeypatch):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=MP4, headers={"content-type": "video/mp4"})

    monkeypatch.setattr(media, "_http_client", lambda policy: httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    trusted = MediaPolicy(allow_private_urls=True)
    assert _load("http://videos.test/clip.mp4", trusted).indices == (0, 6, 12, 17, 23, 29)
    small = MediaPolicy(allow_private_urls=True, max_bytes=1000)
    _refused("http://videos.test/clip.mp4", "the video at .* over the limit of 1000 bytes", small)
    _refused("http://127.0.0.1/clip.mp4", "non-public address 127.0.0.1")  # the SSRF guard, as for images


# ----------------------------------------------------------------------------------------------
# Limits and bad files: 400s that name the problem


def test_corrupt_and_non_video_data():
    _refused(np.random.default_rng(0).bytes(4000), "not a video file")
    _refused(MP4[: len(MP4) // 2], "not a video file|corrupt")  # truncated: moov atom cut
    png = io.BytesIO()
    Image.fromarray(_gray(3)).save(png, format="PNG")
    _refused(png.getvalue(), "PNG image, not a video file")
    _refused(b"", "the data URI is empty")


def test_limits():
    _refused(MP4, f"over the limit of {len(MP4) - 1} bytes", MediaPolicy(max_bytes=len(MP4) - 1))
    _refused(MP4, r"3\.0 s long, over the limit of 2 s \(--max-video-seconds\)", MediaPolicy(max_video_seconds=2))
    _refused(MP4, "the video has 30 frames, over the limit of 20", MediaPolicy(max_video_frames=20))  # declared
    _refused(MP4, "frames of 48x32 .* over the limit of 7680 pixels", MediaPolicy(max_video_decode_pixels=7680))
    _refused(MP4, r"more than the limit of 1e-09 s of CPU", MediaPolicy(max_video_decode_cpu_s=1e-9))
    # One budget for a request's videos: what the first took is not there for the second.
    budget = video.CpuBudget(10.0)
    decode_video(MP4, MediaPolicy(), CFG, WHERE, budget)
    spent = 10.0 - budget.left()
    assert 0 < spent < 10
    budget.spend(budget.left() - spent / 100)  # room left for about a hundredth of that decode
    with pytest.raises(InvalidRequest, match="s of CPU for a request's videos"):
        decode_video(MP4, MediaPolicy(), CFG, WHERE, budget)
    _refused(
        MP4, "48x32 = 1536 pixels, over the limit of 1000 pixels per frame", MediaPolicy(max_video_frame_pixels=1000)
    )
    assert decode_video(MP4, MediaPolicy(max_video_seconds=3, max_video_frames=30), CFG, WHERE).total_frames == 30


def test_too_few_frames_for_the_sampling():
    _refused(_make_video(frames=1), "cannot sample 0 frames from a video of 1 frame")
    _refused(MP4, "cannot sample 32 frames", cfg=CFG.with_overrides({"nframes": 32}, "mm_processor_kwargs"))


# ----------------------------------------------------------------------------------------------
# The chat parser and the prompt


def test_chat_parser_accepts_a_single_video_url():
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": "https://x.test/a.mp4"}},
                {"type": "video", "video": "data:video/webm;base64,AAAA"},
                {"type": "video", "video": ["https://x.test/f0.png", "https://x.test/f1.png"]},
                {"type": "video_url", "video_url": {"url": ["https://x.test/f0.png"]}},
                {"type": "text", "text": "Compare."},
            ],
        }
    ]
    rendered, refs = split_content(messages)
    assert [p["type"] for p in rendered[0]["content"]] == ["video", "video", "video", "video", "text"]
    assert refs == [
        MediaRef("video", ("https://x.test/a.mp4",), "messages[0].content[0]", video_file=True),
        MediaRef("video", ("data:video/webm;base64,AAAA",), "messages[0].content[1]", video_file=True),
        MediaRef("video", ("https://x.test/f0.png", "https://x.test/f1.png"), "messages[0].content[2]"),
        MediaRef("video", ("https://x.test/f0.png",), "messages[0].content[3]"),
    ]
    for bad in ("", 5, [], {"url": None}):
        with pytest.raises(InvalidRequest, match="video file url .* or a non-empty list of frame image urls"):
            split_content([{"role": "user", "content": [{"type": "video", "video": bad}]}])


def _serving() -> MultiModalServing:
    return MultiModalServing(PlaceholderIds(151655, 151656), 2, CFG, MediaPolicy())


def test_video_file_gives_the_frame_list_prompt():
    """A lossless file and the PNGs of its sampled source frames expand to the same tokens and pixels."""
    data = _lossless()
    mm = _serving()
    ids = [1, 151656, 2]
    file_ids, file_inputs = asyncio.run(
        build_inputs(mm, ids, [MediaRef("video", (_uri(data, "video/x-matroska"),), WHERE, video_file=True)], None)
    )
    frames = []
    for index in (0, 6, 12, 17, 23, 29):
        png = io.BytesIO()
        Image.fromarray(_noise(index)).save(png, format="PNG")
        frames.append(f"data:image/png;base64,{base64.b64encode(png.getvalue()).decode()}")
    list_ids, list_inputs = asyncio.run(build_inputs(mm, ids, [MediaRef("video", tuple(frames), WHERE)], None))
    (file_item,), (list_item,) = file_inputs.items, list_inputs.items
    assert file_item.length == list_item.length == 3 * 10 * 14 == file_ids.count(151656)  # (3, 20, 28) grid
    assert file_ids == list_ids
    assert np.array_equal(file_item.pixel_values, list_item.pixel_values)
    assert file_item.content_hash == list_item.content_hash


def test_preprocess_video_keeps_a_given_size():
    frames = [Image.fromarray(_gray(i)).resize((56, 28)) for i in range(2)]
    assert preprocess_video(frames, CFG, (28, 56)).grid_thw == (1, 2, 4)
    assert preprocess_video(frames, CFG).grid_thw == (1, 16, 32)  # without it: grown to 224x448 (video_min_pixels)
