"""LoRA adapters (`pagoda/lora/`): vLLM's knobs, resolved and checked once."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.errors import ConfigError

LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    max_loras: int  # adapters in one step (device slots)
    max_lora_rank: int  # the largest rank an adapter may have (slots are this wide)
    max_cpu_loras: int  # adapters kept read on the host, least recently used dropped first
    lora_dtype: str  # "auto" (the model's) or a dtype name
    tower_connector: bool = False  # slots on the multimodal encoder's adaptable layers too

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
) -> LoRAConfig | None:
    """None without enable_lora; else the checked knobs (max_cpu_loras defaults to max_loras)."""
    if not enable_lora:
        return None
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
    )
