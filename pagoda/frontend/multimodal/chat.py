"""OpenAI chat content parts with images and video → template messages, loaded media, engine inputs.

Accepted parts (OpenAI's, Qwen's and vLLM's spellings), in any order and any turn:
  {"type": "text", "text": ...}
  {"type": "image_url", "image_url": {"url": ...}} (or a bare string url), Qwen's {"type": "image", "image": url}
  {"type": "video", "video": [frame urls]}, {"type": "video_url", "video_url": {"url": [frame urls]}}
  {"type": "video", "video": url}, {"type": "video_url", "video_url": {"url": url}}: one video file
  (mp4, webm, mov, ...), decoded and frame-sampled by `multimodal/video.py` (docs/models.md, Qwen2-VL:
  video frame sampling)
A part without "type" gets it from its keys. Per item, an image may carry OpenAI's `image_url.detail` and an
image or video part Qwen's own settings (qwen-vl-utils' keys, below); any other key in a media part but vLLM's
`uuid` is refused, so a setting is never silently dropped. The chat template sees {"type": "image"|"video"} and
{"type": "text"} parts in the order sent, so it writes one placeholder per item where it was.
Media are fetched concurrently (`multimodal/media.py` enforces the URL policy and decoding limits),
preprocessed in a worker thread (never on the event loop), then each placeholder is expanded to its
item's token count (`multimodal/prompt.py`).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field, replace
from typing import Any

from pagoda.config.multimodal import DEFAULT_LIMITS, MultiModalConfig, shown
from pagoda.errors import ConfigError, InvalidRequest
from pagoda.frontend.chat_template import check_template_kwargs, render_chat
from pagoda.frontend.multimodal.image_processor import VisionPreprocessConfig, preprocess_image, preprocess_video
from pagoda.frontend.multimodal.media import MediaPolicy, load_image, load_video_frames
from pagoda.frontend.multimodal.prompt import PlaceholderIds, expand_prompt
from pagoda.frontend.multimodal.video import CpuBudget, load_video
from pagoda.frontend.prompt_work import PromptWork, text_size
from pagoda.frontend.template_sandbox import render_request_template
from pagoda.inputs import MultiModalInputs

MAX_IMAGE_PIXELS = 16384 * 28 * 28  # Qwen2-VL's largest image: 16384 placeholder tokens

# OpenAI's `image_url.detail`. "low" is OpenAI's low-resolution 512x512 version of the image: here the image is
# sized as if max_pixels were at most 512 * 512 (aspect ratio kept; Qwen2-VL: at most 334 tokens). "high" and
# "auto" keep the model's settings.
IMAGE_DETAILS = ("auto", "low", "high")
LOW_DETAIL_PIXELS = 512 * 512
# Settings one media part may carry for itself (qwen-vl-utils' spelling) -> the mm_processor_kwargs key it sets.
IMAGE_PART_SETTINGS = {"min_pixels": "min_pixels", "max_pixels": "max_pixels"}
VIDEO_PART_SETTINGS = {
    "min_pixels": "video_min_pixels",
    "max_pixels": "video_max_pixels",
    "total_pixels": "video_total_pixels",
    "fps": "fps",
    "nframes": "nframes",
    "min_frames": "min_frames",
    "max_frames": "max_frames",
}


@dataclass(frozen=True)
class MediaRef:
    modality: str  # "image" | "video"
    urls: tuple[str, ...]  # one image url, or the frame urls of a video, or one video file's url
    where: str  # "messages[i].content[j]", for error messages
    video_file: bool = False  # urls[0] is a video file to decode and sample (not a one-frame video)
    detail: str = "auto"  # an image's OpenAI detail level (IMAGE_DETAILS)
    settings: tuple[tuple[str, Any], ...] = ()  # this item's own mm_processor_kwargs, from its part's keys


@dataclass
class MultiModalServing:
    """What the server knows about a vision-language model's inputs (None on a text-only model)."""

    placeholders: PlaceholderIds
    merge_size: int
    preprocess: Any  # multimodal.image_processor.VisionPreprocessConfig
    policy: MediaPolicy
    limits: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_LIMITS))  # most items per prompt


def multimodal_serving(
    hf_config: dict[str, Any], model_folder: str | None, mm: MultiModalConfig
) -> MultiModalServing | None:
    """The server's image/video settings for a vision-language model (None for text-only models), from the
    parsed `mm` (`MultiModalConfig`: no strings to parse here). Settings this model rejects (preprocessor
    overrides against its preprocessor_config.json, the media folder) raise ConfigError before the engine starts.
    """
    architecture = (hf_config.get("architectures") or [""])[0]
    if architecture != "Qwen2VLForConditionalGeneration":
        return None
    text = {**hf_config, **(hf_config.get("text_config") or {})}
    placeholders = PlaceholderIds(int(text.get("image_token_id", 151655)), int(text.get("video_token_id", 151656)))
    vision = hf_config.get("vision_config") or {}
    try:
        preprocess = VisionPreprocessConfig.from_model_folder(model_folder).with_overrides(
            mm.mm_processor_kwargs, "mm_processor_kwargs"
        )
    except InvalidRequest as exc:
        raise ConfigError(
            f"--mm-processor-kwargs {shown(mm.mm_processor_kwargs)}: {exc}", "mm_processor_kwargs"
        ) from None
    path = mm.allowed_local_media_path
    if path is not None and not os.path.isdir(path):
        raise ConfigError(f"--allowed-local-media-path {path!r} is not a folder.", "allowed_local_media_path")
    policy = MediaPolicy(
        allowed_local_media_path=path,
        allow_private_urls=mm.allow_private_media_urls,
        max_video_seconds=mm.max_video_seconds,
    )
    return MultiModalServing(placeholders, int(vision.get("spatial_merge_size", 2)), preprocess, policy, mm.limits)


def _part_kind(part: dict[str, Any]) -> str:
    kind = part.get("type")
    if kind:
        return str(kind)
    for key in ("text", "image_url", "image", "video_url", "video"):
        if key in part:
            return key
    return "<missing>"


def _known_keys(keys: Any, allowed: Any, where: str, what: str) -> None:
    unknown = sorted(str(k) for k in keys if k not in allowed)
    if unknown:
        raise InvalidRequest(
            f"{where}: {what} has unknown key(s) {', '.join(map(repr, unknown))}; supported: "
            f"{', '.join(sorted(allowed))}. Pagoda refuses what it does not implement rather than ignore it.",
            "messages",
        )


def _part_settings(part: dict[str, Any], kind: str, settings: dict[str, str], where: str) -> tuple:
    """The part's own preprocessing keys as (mm_processor_kwargs key, value) pairs; other keys are refused but
    vLLM's `uuid`, a client's name for the item in vLLM's caches: it changes no output, and Pagoda's caches go
    by the item's content, so it is accepted (vLLM clients send it) and not used."""
    if not isinstance(part.get("uuid"), (str, type(None))):
        raise InvalidRequest(f"{where}: uuid must be a string.", "messages")
    _known_keys(part, {"type", kind, "uuid", *settings}, where, f"a {kind!r} part")
    return tuple((settings[k], part[k]) for k in settings if k in part)


def _image_of(part: dict[str, Any], kind: str, where: str) -> MediaRef:
    value = part.get(kind)
    detail = "auto"
    if isinstance(value, dict):
        _known_keys(value, ("url", "detail"), where, kind)
        detail = value.get("detail") or "auto"
        if detail not in IMAGE_DETAILS:
            raise InvalidRequest(
                f"{where}: {kind}.detail must be one of {', '.join(IMAGE_DETAILS)}, got {detail!r}.", "messages"
            )
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where}: an image needs a url string (image_url.url).", "messages")
    return MediaRef(
        "image", (url,), where, detail=detail, settings=_part_settings(part, kind, IMAGE_PART_SETTINGS, where)
    )


def _video_of(part: dict[str, Any], kind: str, where: str) -> MediaRef:
    """A video part's value: one video file url, or a list of frame image urls."""
    value = part.get(kind)
    settings = _part_settings(part, kind, VIDEO_PART_SETTINGS, where)
    if isinstance(value, dict):
        _known_keys(value, ("url", "frames"), where, kind)
    frames = value.get("url", value.get("frames")) if isinstance(value, dict) else value
    if isinstance(frames, str) and frames.strip():
        return MediaRef("video", (frames,), where, video_file=True, settings=settings)
    if not isinstance(frames, list) or not frames or not all(isinstance(f, str) and f for f in frames):
        raise InvalidRequest(
            f"{where}: a video must be a video file url (mp4, webm, ...) or a non-empty list of frame image urls.",
            "messages",
        )
    return MediaRef("video", tuple(frames), where, settings=settings)


def item_config(base: VisionPreprocessConfig, ref: MediaRef) -> VisionPreprocessConfig:
    """The preprocessing of one item: the request's settings, then its part's own keys, then its detail level."""
    cfg = base
    if ref.settings:
        try:
            cfg = cfg.with_overrides(dict(ref.settings), ref.where)
        except InvalidRequest as exc:
            raise InvalidRequest(exc.message, "messages") from None
    if ref.detail == "low" and cfg.max_pixels > LOW_DETAIL_PIXELS:
        cfg = replace(cfg, max_pixels=LOW_DETAIL_PIXELS, min_pixels=min(cfg.min_pixels, LOW_DETAIL_PIXELS))
    if ref.modality == "image" and cfg.max_pixels > MAX_IMAGE_PIXELS:
        raise InvalidRequest(
            f"{ref.where}: max_pixels {cfg.max_pixels} is over the model's limit {MAX_IMAGE_PIXELS} "
            "(16384 tokens per image).",
            "messages",
        )
    return cfg


def split_content(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[MediaRef]]:
    """Messages for the chat template (media replaced by {"type": image|video} markers, order kept)
    and the media they reference, in prompt order."""
    refs: list[MediaRef] = []
    rendered = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = _part_kind(part)
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind in ("image_url", "image"):
                refs.append(_image_of(part, kind, where))
                parts.append({"type": "image"})
            elif kind in ("video", "video_url"):
                refs.append(_video_of(part, kind, where))
                parts.append({"type": "video"})
            else:
                raise InvalidRequest(
                    f"{where}: content part type {kind!r} is not supported (text, image_url, image, video, video_url).",
                    "messages",
                )
        rendered.append({**message, "content": parts})
    return rendered, refs


def check_limits(refs: list[MediaRef], limits: dict[str, int]) -> None:
    for modality in ("image", "video"):
        count = sum(1 for r in refs if r.modality == modality)
        if count > limits.get(modality, 0):
            raise InvalidRequest(
                f"At most {limits.get(modality, 0)} {modality}(s) may be provided in one prompt, "
                f"got {count} (server flag --limit-mm-per-prompt).",
                "messages",
            )


async def render_chat_prompt(
    tokenizer: Any,
    mm: MultiModalServing | None,
    messages: list[dict[str, Any]],
    chat_template: str | None,
    add_generation_prompt: bool,
    model_label: str,
    template_kwargs: dict[str, Any] | None = None,
    processor_kwargs: dict[str, Any] | None = None,
    *,
    continue_final_message: bool = False,
    request_template: str | None = None,
    add_special_tokens: bool = False,
    work: PromptWork | None = None,
) -> tuple[str, list[int], Any]:
    """Messages (OpenAI parts allowed) → (rendered text, prompt ids with placeholders expanded,
    MultiModalInputs or None). `mm` is None for a text-only model, which refuses media parts.
    `chat_template` is trusted (the server's); `request_template`, a request's own template, is
    rendered in the bounded sandbox instead (`frontend/template_sandbox.py`). The template writes the
    special tokens (BOS...); `add_special_tokens` adds the tokenizer's own on top (vLLM's request field).
    `work` (the server's): large messages are rendered and tokenized off the event loop, and a rendered
    prompt over the character bound is refused untokenized; without it (offline) both run here."""
    dicts, refs = split_content(messages)
    if refs and mm is None:
        article = "an image" if refs[0].modality == "image" else "a video"
        raise InvalidRequest(
            f"Model {model_label} does not accept images or video ({refs[0].where} is {article} part).", "messages"
        )
    if mm is None:  # text-only templates expect string content
        dicts = [
            {**d, "content": "".join(part["text"] for part in d["content"])}
            if isinstance(d.get("content"), list)
            else d
            for d in dicts
        ]
    elif refs:
        check_limits(refs, mm.limits)
    template_kwargs = check_template_kwargs(template_kwargs, tokenizer)
    if request_template is not None:
        variables = {**(getattr(tokenizer, "special_tokens_map", None) or {}), **template_kwargs}
        text = await render_request_template(
            request_template, dicts, variables, add_generation_prompt, continue_final_message
        )
    elif work is not None:
        size = text_size(dicts) + text_size(template_kwargs)
        text = await work.run(
            size,
            "messages",
            render_chat,
            tokenizer,
            dicts,
            chat_template,
            add_generation_prompt,
            template_kwargs,
            continue_final_message,
        )
    else:
        text = render_chat(
            tokenizer, dicts, chat_template, add_generation_prompt, template_kwargs, continue_final_message
        )
    try:
        if work is not None:
            token_ids = await work.encode(text, add_special_tokens, "messages")
        else:
            token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except InvalidRequest:
        raise
    except Exception:
        _check_encodable(text)
        raise
    mm_inputs = None
    if refs:
        assert mm is not None  # media for a text-only model were refused above
        token_ids, mm_inputs = await build_inputs(mm, token_ids, refs, processor_kwargs)
    return text, token_ids, mm_inputs


def _check_encodable(text: str) -> None:
    """A prompt the tokenizer refuses because it is not valid Unicode (a lone surrogate such as
    "\\ud800", which JSON allows in a string) is the request's fault: 400, not 500."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"The prompt is not valid Unicode text: {text[exc.start : exc.end]!r} at character "
            f"{exc.start} (a lone UTF-16 surrogate) comes from the messages or "
            "chat_template_kwargs.",
            "messages",
        ) from None


def preprocess_items(
    mm: MultiModalServing,
    token_ids: list[int],
    media: list[tuple[str, Any]],
    processor_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], MultiModalInputs]:
    """Already-loaded media (PIL images, or lists of frames for videos) for a prompt whose ids hold one
    placeholder per item: the offline API's `multi_modal_data`."""
    config = (
        mm.preprocess.with_overrides(processor_kwargs, "mm_processor_kwargs") if processor_kwargs else mm.preprocess
    )
    check_limits([MediaRef(modality, (), f"multi_modal_data[{modality}]") for modality, _ in media], mm.limits)
    visuals = [
        (modality, preprocess_image(item, config) if modality == "image" else preprocess_video(item, config))
        for modality, item in media
    ]
    return expand_prompt(token_ids, visuals, mm.placeholders, str(config.cache_key()), mm.merge_size)


async def build_inputs(
    mm: MultiModalServing, token_ids: list[int], refs: list[MediaRef], processor_kwargs: dict[str, Any] | None
) -> tuple[list[int], MultiModalInputs]:
    """Fetch + decode every item (concurrently), preprocess them off the event loop, expand ids."""
    config = (
        mm.preprocess.with_overrides(processor_kwargs, "mm_processor_kwargs") if processor_kwargs else mm.preprocess
    )
    if config.max_pixels > MAX_IMAGE_PIXELS:
        raise InvalidRequest(
            f"mm_processor_kwargs max_pixels {config.max_pixels} is over the model's limit "
            f"{MAX_IMAGE_PIXELS} (16384 tokens per image).",
            "mm_processor_kwargs",
        )
    configs = [item_config(config, r) for r in refs]  # before any fetch: a bad setting costs no download
    budget = CpuBudget(mm.policy.max_video_decode_cpu_s)  # the request's video files share it
    loaded: list[Any] = await asyncio.gather(
        *(
            load_image(r.urls[0], mm.policy, r.where)
            if r.modality == "image"
            else load_video(r.urls[0], mm.policy, cfg, r.where, budget)
            if r.video_file
            else load_video_frames(list(r.urls), mm.policy, r.where)
            for r, cfg in zip(refs, configs)
        )
    )

    def preprocess() -> list[tuple[str, Any]]:
        out = []
        for ref, cfg, media in zip(refs, configs, loaded):
            try:
                if ref.modality == "image":
                    visual = preprocess_image(media, cfg)
                elif ref.video_file:  # a DecodedVideo: frames already sampled and sized (video.py)
                    visual = preprocess_video(media.frames, cfg, media.size_hw)
                else:
                    visual = preprocess_video(media, cfg)
            except InvalidRequest as exc:
                raise InvalidRequest(f"{ref.where}: {exc.message}", "messages") from None
            out.append((ref.modality, visual))
        return out

    visuals = await asyncio.to_thread(preprocess)
    return expand_prompt(token_ids, visuals, mm.placeholders, str(config.cache_key()), mm.merge_size)
