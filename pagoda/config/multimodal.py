"""Image/video settings of a vision-language model: one frozen `MultiModalConfig`, typed values only.

`LLM(...)` takes the dicts directly (`limit_mm_per_prompt={"image": 4}`); the CLI's string spellings
(JSON, or `image=4,video=1`) are parsed once, by `MultiModalConfig.from_cli`, with the flag named in
every error. `frontend/multimodal/chat.py:multimodal_serving` turns the config into the serving state
(it checks what needs the model: the preprocessor overrides against its preprocessor_config.json, the
media folder). On a text-only model the config is parsed and validated, then unused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagoda.config.engine import knob
from pagoda.errors import ConfigError

DEFAULT_LIMITS: Mapping[str, int] = {"image": 16, "video": 2}  # items per prompt when not limited otherwise


@dataclass(frozen=True)
class MultiModalConfig:
    limit_mm_per_prompt: dict[str, int] | None = knob(
        None,
        'most images/videos per prompt: JSON \'{"image": 4, "video": 1}\' or image=4,video=1 '
        "(default image=16, video=2)",
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
    max_video_seconds: float = knob(600.0, "longest video file a request may send, in seconds (default 600)")

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
    def from_cli(
        cls,
        limit_mm_per_prompt: str | None = None,
        mm_processor_kwargs: str | None = None,
        allowed_local_media_path: str | None = None,
        allow_private_media_urls: bool = False,
        max_video_seconds: float = 600.0,
    ) -> MultiModalConfig:
        """The config from the flags' strings: `--limit-mm-per-prompt` as JSON or `image=4,video=1`,
        `--mm-processor-kwargs` as a JSON object. A bad value raises ConfigError naming the flag."""
        limits = None
        if limit_mm_per_prompt:
            limits = _checked_limits(_parse_limits(limit_mm_per_prompt), repr(limit_mm_per_prompt))
        kwargs = None
        if mm_processor_kwargs:
            try:
                kwargs = json.loads(mm_processor_kwargs)
                if not isinstance(kwargs, dict):
                    raise ValueError("expected a JSON object")
            except ValueError as exc:
                raise ConfigError(
                    f"--mm-processor-kwargs {mm_processor_kwargs!r}: {exc}", "mm_processor_kwargs"
                ) from None
        return cls(
            limit_mm_per_prompt=limits,
            mm_processor_kwargs=kwargs,
            allowed_local_media_path=allowed_local_media_path,
            allow_private_media_urls=bool(allow_private_media_urls),
            max_video_seconds=max_video_seconds,
        )

    @classmethod
    def from_namespace(cls, ns: Any) -> MultiModalConfig:
        """`from_cli` with the flags `cli.args.add_config_args(parser, MultiModalConfig)` added to `ns`."""
        return cls.from_cli(
            getattr(ns, "limit_mm_per_prompt", None),
            getattr(ns, "mm_processor_kwargs", None),
            getattr(ns, "allowed_local_media_path", None),
            getattr(ns, "allow_private_media_urls", False),
            getattr(ns, "max_video_seconds", 600.0),
        )


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
