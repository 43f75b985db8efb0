"""The record every doctor check returns, what earlier checks found for the later ones, and small helpers."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["ok", "warn", "FAIL"]

_GIB = 1 << 30


@dataclass
class Check:
    name: str
    status: Status
    detail: str
    fix: str | None = None


@dataclass
class State:
    """What earlier checks found, for the later ones (a check whose input failed is left out)."""

    model: str | None
    tokenizer_path: str | None
    source: Any = None  # ModelSource once config.json / the GGUF header parsed
    weight_format: str | None = None  # "safetensors" | "bin" | "gguf"
    weight_files: list[str] = field(default_factory=list)  # what the loader reads, in order
    unreadable: set[str] = field(default_factory=set)
    headers: dict[str, dict[str, Any]] = field(default_factory=dict)  # safetensors file -> header
    shards_ok: bool = False  # the shard set is complete and consistent with its index
    headers_complete: bool = False
    tokenizer: Any = None
    tokenizer_from: str | None = None  # the path `tokenizer` was loaded from

    @property
    def folder(self) -> str | None:
        return self.source.folder if self.source is not None else None

    @property
    def hf_config(self) -> dict[str, Any]:
        return self.source.hf_config if self.source is not None else {}

    @property
    def weights_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.weight_files if os.path.isfile(p))


def unreadable_reason(path: str) -> str | None:
    if not os.path.lexists(path):
        return "does not exist"
    if not os.path.exists(path):
        return "is a broken symlink"
    if os.path.isdir(path):
        return "is a directory, not a file"
    if not os.path.isfile(path):
        return "is not a regular file"
    if not os.access(path, os.R_OK):
        return f"is not readable by this user (uid {os.getuid()})"
    return None


def read_fix(path: str) -> str:
    return f"make {path} a readable file (`chmod a+r`), or re-download it"


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def is_yuan_config(cfg: dict[str, Any]) -> bool:
    from pagoda.models.families import YUAN2, family_of

    return family_of(cfg) is YUAN2


def is_qwen2_vl_config(cfg: dict[str, Any]) -> bool:
    return "Qwen2VLForConditionalGeneration" in (cfg.get("architectures") or []) or cfg.get("model_type") == "qwen2_vl"


def format_size(n: float) -> str:
    for unit, scale in (("GiB", _GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
