"""Configuration: one frozen dataclass per concern, built once from the flags (or `LLM(...)`'s keywords)
and handed to every process.

- `engine.py`: `EngineArgs` (the engine knobs) resolved by `EngineConfig.create` into the model, cache,
  scheduler and device sections.
- `knobs.py`: `knob`, one user-facing field with its default and `--flag` help (cli/args.py makes the flags).
- `multimodal.py`: `MultiModalConfig` (image/video limits, preprocessing defaults, media URL policy).
- `server.py`: `ServerConfig` (the serve-only flags).
"""

from pagoda.config.engine import (
    DEFAULT_CPU_KV_CACHE_GIB,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KV_CACHE_DTYPES,
    KV_CACHE_STORAGE,
    CacheConfig,
    DeviceConfig,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    derived_max_model_len,
    resolve_kv_cache_dtype,
    text_field,
)
from pagoda.config.knobs import knob
from pagoda.config.multimodal import MultiModalConfig

__all__ = [
    "DEFAULT_CPU_KV_CACHE_GIB",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "KV_CACHE_DTYPES",
    "KV_CACHE_STORAGE",
    "CacheConfig",
    "DeviceConfig",
    "EngineArgs",
    "EngineConfig",
    "ModelConfig",
    "MultiModalConfig",
    "SchedulerConfig",
    "derived_max_model_len",
    "knob",
    "resolve_kv_cache_dtype",
    "text_field",
]
