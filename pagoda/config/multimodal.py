"""Image/video settings of a vision-language model: one frozen `MultiModalConfig`, typed values only.

`LLM(...)` takes the dicts directly (`limit_mm_per_prompt={"image": 4}`); the CLI's string spellings
(JSON, or `image=4,video=1`) are parsed once, by `MultiModalConfig.from_cli` (which `cli.args.config_from`
calls for a config with such flags), with the flag named in every error.
`frontend/multimodal/chat.py:multimodal_serving` turns the config into the serving state (it checks what
needs the model: the preprocessor overrides against its preprocessor_config.json, the media folder). On a
text-only model the config is parsed and validated, then unused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.config.knobs import knob
from pagoda.errors import ConfigError

DEFAULT_LIMITS: Mapping[str, int] = {"image": 16, "video": 2}  # items per prompt when not limited otherwise
DEFAULT_MAX_VIDEO_SECONDS = 600.0  # also `frontend.multimodal.media.MediaPolicy`'s default


@dataclass(frozen=True)
class MultiModalConfig:
    limit_mm_per_prompt: dict[str, int] | None = knob(
        None,
        'most images/videos per prompt: JSON \'{"image": 4, "video": 1}\' or image=4,video=1 '
        f"(default {', '.join(f'{k}={v}' for k, v in DEFAULT_LIMITS.items())})",
        cli_type=str,
    )
    mm_processor_kwargs: dict[str, Any] | None = knob(
        None,
        "image preprocessing defaults, JSON, e.g. '{\"max_pixels\": 1003520}' "
        "(default: the model's preprocessor_config.json)",
        cli_type=str,
    )
    allowed_local_media_path: str | None = knob(
        None, "folder from which file:// image urls may be read (default: none)"
    )
    allow_private_media_urls: bool = knob(
        False, "allow image urls that resolve to loopback/private/link-local addresses", store_true=True
    )
    max_video_seconds: float = knob(
        DEFAULT_MAX_VIDEO_SECONDS,
        f"longest video file a request may send, in seconds (default {DEFAULT_MAX_VIDEO_SECONDS:g})",
    )

    def __post_init__(self) -> None:
        if self.limit_mm_per_prompt is not None:
            object.__setattr__(
                self, "limit_mm_per_prompt", _checked_limits(self.limit_mm_per_prompt, shown(self.limit_mm_per_prompt))
            )
        seconds = self.max_video_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
            raise ConfigError(f"--max-video-seconds {seconds!r}: expected a positive number", "max_video_seconds")
        kwargs = self.mm_processor_kwargs
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ConfigError(f"--mm-processor-kwargs {shown(kwargs)}: expected a JSON object", "mm_processor_kwargs")

    @property
    def limits(self) -> dict[str, int]:
        """Most items per prompt for each modality: the defaults, with `limit_mm_per_prompt` applied."""
        return {**DEFAULT_LIMITS, **(self.limit_mm_per_prompt or {})}

    @classmethod
    def from_cli(cls, **values: Any) -> MultiModalConfig:
        """The config from the flags' values (`cli.args.config_from`): `--limit-mm-per-prompt` as JSON or
        `image=4,video=1`, `--mm-processor-kwargs` as a JSON object, an empty string as not given; the other
        knobs as given, and the dataclass's defaults for those left out. A bad value raises ConfigError
        naming the flag."""
        limits = values.pop("limit_mm_per_prompt", None)
        if isinstance(limits, str):
            limits = _checked_limits(_parse_limits(limits), repr(limits)) if limits else None
        kwargs = values.pop("mm_processor_kwargs", None)
        if isinstance(kwargs, str):
            kwargs = _parse_kwargs(kwargs) if kwargs else None
        return cls(limit_mm_per_prompt=limits, mm_processor_kwargs=kwargs, **values)


def shown(value: Any) -> str:
    """A typed value as an error message quotes it: the JSON a user would have written on the command line."""
    try:
        return repr(json.dumps(value))
    except (TypeError, ValueError):
        return repr(value)


def _parse_limits(value: str) -> Any:
    try:
        if value.strip().startswith("{"):
            return json.loads(value)
        return {k.strip(): v for k, v in (item.split("=", 1) for item in value.split(",") if item.strip())}
    except ValueError as exc:
        raise ConfigError(f"--limit-mm-per-prompt {value!r}: {exc}", "limit_mm_per_prompt") from None


def _parse_kwargs(value: str) -> dict[str, Any]:
    try:
        kwargs = json.loads(value)
        if not isinstance(kwargs, dict):
            raise ValueError("expected a JSON object")
    except ValueError as exc:
        raise ConfigError(f"--mm-processor-kwargs {value!r}: {exc}", "mm_processor_kwargs") from None
    return kwargs


def _checked_limits(parsed: Any, shown_value: str) -> dict[str, int]:
    """The per-modality limits as ints (the CLI's `image=4` gives strings), checked."""
    limits: dict[str, int] = {}
    try:
        if not isinstance(parsed, Mapping):
            raise ValueError("expected a JSON object ('{\"image\": 4}') or image=4,video=1")
        for key, number in parsed.items():
            if key not in DEFAULT_LIMITS:
                raise ValueError(f"unknown modality {key!r} (image, video)")
            limits[key] = int(number)
            if limits[key] < 0:
                raise ValueError(f"{key} limit must be >= 0")
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"--limit-mm-per-prompt {shown_value}: {exc}", "limit_mm_per_prompt") from None
    return limits
