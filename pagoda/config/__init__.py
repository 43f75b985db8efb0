"""Configuration: one frozen dataclass per concern, built once from the flags (or `LLM(...)`'s keywords)
and handed to every process.

- `engine.py`: `EngineArgs` (the engine knobs) resolved by `EngineConfig.create` into the model, cache,
  scheduler and device sections.
"""

from pagoda.config.engine import (
    DEFAULT_CPU_KV_CACHE_GIB,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    CacheConfig,
    DeviceConfig,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    _derived_max_model_len,
    knob,
    text_field,
)

__all__ = [
    "DEFAULT_CPU_KV_CACHE_GIB", "DEFAULT_GPU_MEMORY_UTILIZATION", "DEFAULT_MAX_NUM_BATCHED_TOKENS", "CacheConfig",
    "DeviceConfig", "EngineArgs", "EngineConfig", "ModelConfig", "SchedulerConfig", "_derived_max_model_len", "knob",
    "text_field",
]
