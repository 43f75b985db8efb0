"""OpenAI chat content parts with images and video → template messages, loaded media, engine inputs.

Accepted parts (OpenAI's, Qwen's and vLLM's spellings), in any order and any turn:
  {"type": "text", "text": ...}
  {"type": "image_url", "image_url": {"url": ...}} (or a bare string url), Qwen's {"type": "image", "image": url}
  {"type": "video", "video": [frame urls]}, {"type": "video_url", "video_url": {"url": [frame urls]}}
  {"type": "video", "video": url}, {"type": "video_url", "video_url": {"url": url}}: one video file
  (mp4, webm, mov, ...), decoded and frame-sampled by `multimodal/video.py` (docs/models.md, Qwen2-VL:
  video frame sampling)
A part without "type" gets it from its keys. The chat template sees {"type": "image"|"video"} and
{"type": "text"} parts in the order sent, so it writes one placeholder per item where it was.
Media are fetched concurrently (`multimodal/media.py` enforces the URL policy and decoding limits),
preprocessed in a worker thread (never on the event loop), then each placeholder is expanded to its
item's token count (`multimodal/prompt.py`).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class MediaRef:
    modality: str  # "image" | "video"
    urls: tuple[str, ...]  # one image url, or the frame urls of a video, or one video file's url
    where: str  # "messages[i].content[j]", for error messages
    video_file: bool = False  # urls[0] is a video file to decode and sample (not a one-frame video)


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


def _url_of(value: Any, where: str) -> str:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where}: an image needs a url string (image_url.url).", "messages")
    return url


def _video_of(value: Any, where: str) -> MediaRef:
    """A video part's value: one video file url, or a list of frame image urls."""
    frames = value.get("url", value.get("frames")) if isinstance(value, dict) else value
    if isinstance(frames, str) and frames.strip():
        return MediaRef("video", (frames,), where, video_file=True)
    if not isinstance(frames, list) or not frames or not all(isinstance(f, str) and f for f in frames):
        raise InvalidRequest(
            f"{where}: a video must be a video file url (mp4, webm, ...) or a non-empty list of frame image urls.",
            "messages",
        )
    return MediaRef("video", tuple(frames), where)


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
                refs.append(MediaRef("image", (_url_of(part.get(kind), where),), where))
                parts.append({"type": "image"})
            elif kind in ("video", "video_url"):
                refs.append(_video_of(part.get(kind), where))
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
    budget = CpuBudget(mm.policy.max_video_decode_cpu_s)  # the request's video files share it
    loaded: list[Any] = await asyncio.gather(
        *(
            load_image(r.urls[0], mm.policy, r.where)
            if r.modality == "image"
            else load_video(r.urls[0], mm.policy, config, r.where, budget)
            if r.video_file
            else load_video_frames(list(r.urls), mm.policy, r.where)
            for r in refs
        )
    )

    def preprocess() -> list[tuple[str, Any]]:
        out = []
        for ref, media in zip(refs, loaded):
            try:
                if ref.modality == "image":
                    visual = preprocess_image(media, config)
                elif ref.video_file:  # a DecodedVideo: frames already sampled and sized (video.py)
                    visual = preprocess_video(media.frames, config, media.size_hw)
                else:
                    visual = preprocess_video(media, config)
            except InvalidRequest as exc:
                raise InvalidRequest(f"{ref.where}: {exc.message}", "messages") from None
            out.append((ref.modality, visual))
        return out

    visuals = await asyncio.to_thread(preprocess)
    return expand_prompt(token_ids, visuals, mm.placeholders, str(config.cache_key()), mm.merge_size)
