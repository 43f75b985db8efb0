"""LoRA adapters (`pagoda/lora/`): vLLM's knobs, resolved and checked once."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagoda.errors import ConfigError

LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")
MODALITIES = ("image", "video")


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    max_loras: int  # adapters in one step (device slots)
    max_lora_rank: int  # the largest rank an adapter may have (slots are this wide)
    max_cpu_loras: int  # adapters kept read on the host, least recently used dropped first
    lora_dtype: str  # "auto" (the model's) or a dtype name
    tower_connector: bool = False  # slots on the multimodal encoder's adaptable layers too
    # --default-mm-loras: (modality, PEFT folder) pairs, in the order given; a prompt with that modality (and only
    # one such) and no adapter of its own runs with that folder's adapter, named after the modality.
    default_mm_loras: tuple[tuple[str, str], ...] = ()
    # --lora-target-modules: the layer names (a module path's last part, checkpoint or fused) that take slots;
    # () = every adaptable layer.
    target_modules: tuple[str, ...] = ()

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras


def resolve_lora(
    enable_lora: bool,
    max_loras: int,
    max_lora_rank: int,
    max_cpu_loras: int | None,
    lora_dtype: str,
    tower_connector: bool = False,
    default_mm_loras: str | dict[str, str] | None = None,
    target_modules: tuple[str, ...] | list[str] | None = None,
) -> LoRAConfig | None:
    """None without enable_lora; else the checked knobs (max_cpu_loras defaults to max_loras)."""
    defaults = parse_default_mm_loras(default_mm_loras)
    targets = tuple(target_modules or ())
    if not enable_lora:
        for given, flag in ((defaults, "--default-mm-loras"), (targets, "--lora-target-modules")):
            if given:
                raise ConfigError(f"{flag} needs --enable-lora", flag[2:].replace("-", "_"))
        return None
    if not all(isinstance(t, str) and t and "." not in t for t in targets):
        raise ConfigError(
            f"--lora-target-modules {list(targets)}: each is a layer's name (q_proj, o_proj, w1, ...), not a path",
            "lora_target_modules",
        )
    if max_loras < 1:
        raise ConfigError(f"max_loras must be >= 1, got {max_loras}", "max_loras")
    if not 1 <= max_lora_rank <= 512:
        raise ConfigError(f"max_lora_rank must be in [1, 512], got {max_lora_rank}", "max_lora_rank")
    cpu = max_loras if max_cpu_loras is None else max_cpu_loras
    if cpu < max_loras:
        raise ConfigError(f"max_cpu_loras ({cpu}) must be >= max_loras ({max_loras})", "max_cpu_loras")
    if lora_dtype not in LORA_DTYPES:
        raise ConfigError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}; got {lora_dtype!r}", "lora_dtype")
    return LoRAConfig(
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        max_cpu_loras=cpu,
        lora_dtype=lora_dtype,
        tower_connector=tower_connector,
        default_mm_loras=defaults,
        target_modules=targets,
    )


def parse_default_mm_loras(value: str | dict[str, Any] | None) -> tuple[tuple[str, str], ...]:
    """vLLM's `--default-mm-loras '{"image": "path/to/adapter"}'` (or the dict offline), checked: keys among the
    modalities, values non-empty folder paths."""
    if value is None or value == "":
        return ()
    shown = value if isinstance(value, str) else json.dumps(value, default=str)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"--default-mm-loras {shown!r} is not valid JSON ({exc.msg} at column {exc.colno})", "default_mm_loras"
            ) from None
    if not isinstance(value, dict):
        raise ConfigError(
            f'--default-mm-loras {shown!r}: expected a JSON object, e.g. \'{{"image": "path/to/adapter"}}\'',
            "default_mm_loras",
        )
    for modality, path in value.items():
        if modality not in MODALITIES:
            raise ConfigError(
                f"--default-mm-loras: unknown modality {modality!r} ({', '.join(MODALITIES)})", "default_mm_loras"
            )
        if not isinstance(path, str) or not path:
            raise ConfigError(
                f"--default-mm-loras {modality}: expected the adapter's folder as a non-empty string, got {path!r}",
                "default_mm_loras",
            )
    return tuple(value.items())
