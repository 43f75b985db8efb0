"""Video files (mp4, webm, mov, mkv, avi, gif, ...) -> the sampled, resized frames Qwen2-VL sees.

A video given as one URL (`{"type": "video_url", "video_url": {"url": ...}}` or `{"type": "video",
"video": url}`) is loaded like an image (`media.py`: the same URL schemes, SSRF guard, byte cap and
fetch deadline; data URIs must say `data:video/...`), then decoded with PyAV in a worker thread.

Sampling follows qwen-vl-utils, the Qwen team's reference (docs/models.md, Qwen2-VL: video frame
sampling): with N frames at
f frames/s, n = N / f * fps clamped to [ceil_even(min_frames), floor_even(min(max_frames, N))] and
rounded to even (or a given `nframes`, rounded to even); frame indices are n values evenly spaced from
0 to N-1, rounded; every frame gets the size smart_resize picks under the per-frame budget
max(min(video_max_pixels, video_total_pixels / n * 2), int(video_min_pixels * 1.05)). The knobs live in
`VisionPreprocessConfig` (server and request `mm_processor_kwargs`: fps, nframes, min_frames, max_frames,
video_min_pixels, video_max_pixels, video_total_pixels).

Limits (`MediaPolicy`; each failure is a 400 naming the limit): the file's bytes (`max_bytes`), its
duration (`max_video_seconds`, --max-video-seconds), the frames it holds (`max_video_frames`; the count
the stream declares is checked before any packet is read), the frame size (`max_video_frame_pixels`), the
pixels to decode (`max_video_decode_pixels`: the frames decoding takes, below, times the frame size,
checked before any frame is decoded), the CPU time decoding may take (`max_video_decode_cpu_s`, one
budget for all of a request's video files (`CpuBudget`), measured on the decoding thread; a video whose
first frames show it would need more than is left is refused then) and its wall time
(`max_video_decode_s`). Only the frames up to the last sampled one are decoded, and of those only
from the key frame before each sampled frame where seeking there skips some (the packets' timestamps,
read while probing, say where frames and key frames are; without them, or when the decoded frames'
timestamps disagree, every frame in order). Each sampled frame is resized as soon as it is decoded, so
memory is bounded by the model's pixel budget, not by the file's resolution.

Decoding runs on a pool of its own (`_DECODE_THREADS` threads, each decoding single-threaded), not on
asyncio's default one: however many videos arrive at once, they take at most that many cores, and the
images, data URIs and preprocessing of other requests never queue behind them.

The demuxers allowed are listed (`_FORMATS`): playlist and concat formats, which would make FFmpeg open
other URLs or local files behind the URL policy's back, are not among them.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures as cf
import math
import threading
import time
from dataclasses import dataclass
from io import BytesIO
from typing import Any

import numpy as np
from PIL import Image

from pagoda.errors import InvalidRequest
from pagoda.frontend.multimodal.image_processor import VisionPreprocessConfig, smart_resize
from pagoda.frontend.multimodal.media import MediaPolicy, _fail, _load_bytes

FRAME_FACTOR = 2  # frames per temporal patch: the sampled count is always even
# Demuxers that read only the bytes given (names as FFmpeg spells them; format_whitelist matches any of a
# demuxer's comma-separated names).
_FORMATS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,flv,mpeg,mpegts,ogg,gif,apng,asf,nut,ivf,m4v,h264,hevc,mjpeg"
_OPEN_OPTIONS = {"format_whitelist": _FORMATS, "protocol_whitelist": "none"}
_DECODE_THREADS = 2
_DECODE_POOL = cf.ThreadPoolExecutor(max_workers=_DECODE_THREADS, thread_name_prefix="pagoda-video")
_ESTIMATE_AFTER = 8  # frames decoded before their CPU time is extrapolated to the whole decode


@dataclass(frozen=True)
class DecodedVideo:
    """The frames sampled from one video file, RGB and already resized to `size_hw`."""

    frames: list[Image.Image]
    size_hw: tuple[int, int]  # (height, width) every frame has, a multiple of the patch factor
    indices: tuple[int, ...]  # which source frames (0-based, decode order)
    total_frames: int  # N
    fps: float  # f, the stream's average frame rate
    source_size: tuple[int, int]  # (width, height) of the source frames


# ----------------------------------------------------------------------------------------------
# Sampling (pure functions of the counts; qwen-vl-utils' rules)


def _round_even(x: float) -> int:
    return round(x / FRAME_FACTOR) * FRAME_FACTOR


def _ceil_even(x: float) -> int:
    return math.ceil(x / FRAME_FACTOR) * FRAME_FACTOR


def _floor_even(x: float) -> int:
    return math.floor(x / FRAME_FACTOR) * FRAME_FACTOR


def sample_frame_count(total_frames: int, video_fps: float, cfg: VisionPreprocessConfig) -> int:
    """How many frames qwen-vl-utils samples from `total_frames` frames at `video_fps` (may be out of
    [2, total_frames]: `sample_indices`' caller checks)."""
    if cfg.video_nframes is not None:
        return _round_even(cfg.video_nframes)
    min_frames = _ceil_even(cfg.video_min_frames)
    max_frames = _floor_even(min(cfg.video_max_frames, total_frames))
    n = total_frames / video_fps * cfg.video_fps
    return _round_even(min(max(n, min_frames), max_frames))


def sample_indices(total_frames: int, n: int) -> list[int]:
    """n frame indices evenly spaced over 0..total_frames-1, rounded (half to even, like torch)."""
    return [int(i) for i in np.linspace(0, total_frames - 1, n).round()]


def frame_pixel_budget(cfg: VisionPreprocessConfig, n: int) -> float:
    """Most pixels per sampled frame when n frames share the video's total budget."""
    return max(min(cfg.video_max_pixels, cfg.video_total_pixels / n * FRAME_FACTOR), int(cfg.video_min_pixels * 1.05))


# ----------------------------------------------------------------------------------------------
# Loading and decoding


class CpuBudget:
    """The CPU seconds one request's videos may take to decode, together (they may decode at once)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._spent = 0.0
        self._lock = threading.Lock()

    def left(self) -> float:
        with self._lock:
            return self.seconds - self._spent

    def spend(self, seconds: float) -> None:
        with self._lock:
            self._spent += seconds


async def load_video(
    url: str, policy: MediaPolicy, cfg: VisionPreprocessConfig, where: str, budget: CpuBudget | None = None
) -> DecodedVideo:
    """Fetch the video file behind `url` and decode its sampled frames (on the decoding pool). `budget`:
    the request's, shared by its videos (one of `max_video_decode_cpu_s` for this one alone if None)."""
    try:
        data = await _load_bytes(url, policy, where, kind="video")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_DECODE_POOL, decode_video, data, policy, cfg, where, budget)
    except InvalidRequest:
        raise
    except Exception as e:  # the boundary: nothing raw reaches the server's 500 handler
        raise _fail(where, f"could not load the video: {type(e).__name__}: {e}") from e


def decode_video(
    data: bytes, policy: MediaPolicy, cfg: VisionPreprocessConfig, where: str, budget: CpuBudget | None = None
) -> DecodedVideo:
    """A video file's bytes -> its sampled frames; every failure is an InvalidRequest naming it."""
    budget = budget if budget is not None else CpuBudget(policy.max_video_decode_cpu_s)
    if len(data) > policy.max_bytes:
        raise _fail(where, f"the video is {len(data)} bytes, over the limit of {policy.max_bytes} bytes.")
    deadline = time.monotonic() + policy.max_video_decode_s
    total, fps, source_size, timeline = _probe(data, policy, where, deadline)
    for _attempt in range(2):
        n = sample_frame_count(total, fps, cfg)
        if not FRAME_FACTOR <= n <= total:
            raise _fail(
                where,
                f"cannot sample {n} frames from a video of {total} frame(s) (at least {FRAME_FACTOR} frames "
                "are needed; nframes must not exceed the video's frame count).",
            )
        indices = sample_indices(total, n)
        width, height = source_size
        if timeline is not None and len(timeline.pts) != total:
            timeline = None  # the count came from decoding: the packets' timeline does not describe it
        needed = _frames_to_decode(indices, timeline)
        _check_decode_pixels(needed, width, height, policy, where)
        size_hw = smart_resize(height, width, cfg.factor, cfg.video_min_pixels, frame_pixel_budget(cfg, n))
        frames = None
        if timeline is not None:  # seeking to the key frame before each sampled frame, where that skips some
            frames = _decode_frames(data, indices, size_hw, policy, where, deadline, budget, timeline, needed)[0]
        if frames is None:  # no timeline, or its timestamps did not match the frames: every frame in order
            frames, decoded = _decode_frames(data, indices, size_hw, policy, where, deadline, budget)
        if frames is not None:
            return DecodedVideo(frames, size_hw, tuple(indices), total, fps, source_size)
        total = decoded  # the container promised more frames than it holds: sample the real count
    raise _fail(where, f"the video's frame count is inconsistent ({total} frames decode); it may be corrupt.")


def _av() -> Any:
    import av  # lazy: av (FFmpeg's libraries load only when a video file is decoded)

    return av


def _open(data: bytes, where: str) -> Any:
    av = _av()
    try:
        return av.open(BytesIO(data), mode="r", options=dict(_OPEN_OPTIONS), metadata_errors="ignore")
    except av.FFmpegError as e:
        raise _fail(where, _not_a_video(data, e)) from e


def _not_a_video(data: bytes, error: Exception) -> str:
    """Why FFmpeg would not open the data: an image sent as a video says so."""
    try:
        with Image.open(BytesIO(data)) as image:
            kind = image.format or "image"
        return f"the data is a {kind} image, not a video file; send it as an image part or a list of frames."
    except Exception:  # noqa: BLE001 - not an image either: report FFmpeg's reason
        return f"the data is not a video file in a supported container or is corrupt ({error})."


def _video_stream(container: Any, where: str) -> Any:
    for stream in container.streams.video:
        if not stream.disposition & _av().stream.Disposition.attached_pic:  # cover art is not a video
            return stream
    raise _fail(where, f"the file ({container.format.name}) has no video stream.")


@dataclass(frozen=True)
class _Timeline:
    """Where each frame (by presentation index) and each key frame is, from the packets: what seeking needs."""

    pts: list[int]  # frame i's presentation timestamp, ascending
    keys: list[int]  # presentation indices of the key frames, ascending

    def key_before(self, index: int) -> int:
        """The last key frame at or before frame `index` (-1: none)."""
        return self.keys[bisect.bisect_right(self.keys, index) - 1] if self.keys and self.keys[0] <= index else -1


def _probe(
    data: bytes, policy: MediaPolicy, where: str, deadline: float
) -> tuple[int, float, tuple[int, int], _Timeline | None]:
    """(frame count N, frame rate f, (width, height), the timeline or None when the packets lack
    timestamps), checking every limit before any frame is decoded.

    N is the count of the stream's packets (demuxing only): one per frame in the containers we allow.
    """
    with _open(data, where) as container:
        stream = _video_stream(container, where)
        width, height = stream.codec_context.width, stream.codec_context.height
        if width <= 0 or height <= 0:
            raise _fail(where, "the video stream has no frame size; the file may be corrupt.")
        _check_frame_size(width, height, policy, where)
        if stream.frames and stream.frames > policy.max_video_frames:
            raise _fail(where, f"the video has {stream.frames} frames, over the limit of {policy.max_video_frames}.")
        declared = _declared_seconds(container, stream)
        if declared is not None and declared > policy.max_video_seconds:
            raise _too_long(declared, policy, where)
        total = 0
        stamps: list[tuple[int, bool]] | None = []
        for packet in container.demux(stream):
            if packet.size:
                total += 1
                if packet.pts is None:
                    stamps = None
                elif stamps is not None:
                    stamps.append((packet.pts, packet.is_keyframe))
                if total > policy.max_video_frames:
                    raise _fail(where, f"the video has more than the limit of {policy.max_video_frames} frames.")
                if total % 256 == 0:
                    _check_deadline(deadline, policy, where)
        rate = stream.average_rate or stream.guessed_rate
    if total == 0:
        raise _fail(where, "the video has no frames.")
    fps = float(rate) if rate else (total / declared if declared else 0.0)
    if not fps > 0 or not math.isfinite(fps):
        raise _fail(where, "cannot tell the video's frame rate (the container declares neither it nor a duration).")
    timeline = None
    if stamps is not None and len({pts for pts, _ in stamps}) == total:
        stamps.sort()
        timeline = _Timeline([pts for pts, _ in stamps], [i for i, (_, key) in enumerate(stamps) if key])
    if total / fps > policy.max_video_seconds:
        raise _too_long(total / fps, policy, where)
    return total, fps, (width, height), timeline


def _declared_seconds(container: Any, stream: Any) -> float | None:
    """The duration the container or the stream declares, if any."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / _av().time_base
    return None


def _frames_to_decode(indices: list[int], timeline: _Timeline | None) -> int:
    """How many frames decoding `indices` takes: every one up to the last sampled without a timeline;
    with one, a jump to the key frame before a sampled frame wherever that skips frames."""
    if timeline is None:
        return indices[-1] + 1
    needed, position = 0, -1  # position: the last frame decoded
    for target in sorted(set(indices)):
        key = timeline.key_before(target)
        start = key if key > position else position + 1
        needed += target - start + 1
        position = target
    return needed


def _decode_frames(
    data: bytes,
    indices: list[int],
    size_hw: tuple[int, int],
    policy: MediaPolicy,
    where: str,
    deadline: float,
    budget: CpuBudget,
    timeline: _Timeline | None = None,
    needed: int | None = None,
) -> tuple[list[Image.Image] | None, int]:
    """(the frames at `indices`, resized to size_hw, or None if the stream ended first; frames decoded).
    Without `timeline`, frame i is the i-th the decoder gives. With it, frames are known by timestamp and
    the decoder seeks to the key frame before a sampled frame wherever that skips frames (`needed` of
    them decoded in all); None when the timestamps do not match (the caller decodes every frame then).
    The CPU time it takes is spent from `budget`, whatever the outcome."""
    wanted: dict[int, list[int]] = {}
    for position, index in enumerate(indices):
        wanted.setdefault(index, []).append(position)
    out: list[Image.Image | None] = [None] * len(indices)
    last = indices[-1]
    needed = needed if needed is not None else last + 1
    index_of = {pts: i for i, pts in enumerate(timeline.pts)} if timeline is not None else {}
    decoded = 0
    started, allowed = time.thread_time(), budget.left()
    try:
        with _open(data, where) as container:
            stream = _video_stream(container, where)
            stream.thread_type = "NONE"  # on this thread, where its CPU time is measured
            try:
                frames = container.decode(stream)
                position = -1  # the last frame decoded
                for target in sorted(wanted):
                    if out[wanted[target][0]] is not None:
                        continue
                    if timeline is not None and (key := timeline.key_before(target)) > position:
                        try:
                            container.seek(timeline.pts[key], stream=stream, backward=True, any_frame=False)
                        except _av().FFmpegError:
                            return None, decoded  # not seekable after all: every frame in order
                        frames = container.decode(stream)
                    for frame in frames:
                        decoded += 1
                        if decoded == _ESTIMATE_AFTER or decoded % 16 == 0:
                            used = time.thread_time() - started
                            _check_cpu(used, decoded, needed, allowed, budget.seconds, where)
                            _check_deadline(deadline, policy, where)
                        _check_frame_size(frame.width, frame.height, policy, where)
                        if timeline is None:
                            index = position + 1
                        elif (index := index_of.get(frame.pts, -1)) < 0:
                            return None, decoded  # a timestamp the packets did not have
                        position = index
                        if index in wanted and out[wanted[index][0]] is None:
                            image = frame.to_image().resize((size_hw[1], size_hw[0]), Image.Resampling.BICUBIC)
                            for slot in wanted[index]:
                                out[slot] = image
                        if index >= target:
                            break
                    if timeline is not None and out[wanted[target][0]] is None:
                        return None, decoded  # passed over or never reached: the timeline was wrong
            except _av().FFmpegError as e:
                raise _fail(where, f"the video is corrupt: decoding failed at frame {decoded} ({e}).") from e
        if any(image is None for image in out):
            if decoded == 0:
                raise _fail(where, "the video has no decodable frames; the file may be corrupt.")
            return None, decoded
        return [image for image in out if image is not None], decoded
    finally:
        budget.spend(time.thread_time() - started)


def _check_frame_size(width: int, height: int, policy: MediaPolicy, where: str) -> None:
    if width * height > policy.max_video_frame_pixels:
        raise _fail(
            where,
            f"video frames are {width}x{height} = {width * height} pixels, over the limit of "
            f"{policy.max_video_frame_pixels} pixels per frame.",
        )


def _check_decode_pixels(frames: int, width: int, height: int, policy: MediaPolicy, where: str) -> None:
    if frames * width * height > policy.max_video_decode_pixels:
        raise _fail(
            where,
            f"sampling it means decoding {frames} frames of {width}x{height} ({frames * width * height} pixels), "
            f"over the limit of {policy.max_video_decode_pixels} pixels; send a shorter or smaller video, a lower "
            "mm_processor_kwargs fps or nframes, or its frames as images.",
        )


def _check_cpu(used: float, decoded: int, needed: int, allowed: float, limit: float, where: str) -> None:
    """Refuse once the decoding has used the CPU time `allowed` (what the request's budget had left when
    it started), or its first frames show it would."""
    if used > allowed or used / decoded * needed > allowed:
        raise _fail(
            where,
            f"decoding the {needed} frames up to the last sampled one would take more than the limit of "
            f"{limit:g} s of CPU for a request's videos ({used / decoded * 1000:.1f} ms a frame); send a shorter "
            "or smaller video, a lower mm_processor_kwargs fps or nframes, or its frames as images.",
        )


def _check_deadline(deadline: float, policy: MediaPolicy, where: str) -> None:
    if time.monotonic() > deadline:
        raise _fail(where, f"decoding the video took longer than the limit of {policy.max_video_decode_s:g} s.")


def _too_long(seconds: float, policy: MediaPolicy, where: str) -> InvalidRequest:
    return _fail(
        where,
        f"the video is {seconds:.1f} s long, over the limit of {policy.max_video_seconds:g} s (--max-video-seconds).",
    )
