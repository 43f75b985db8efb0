"""Which decoder layers each pipeline stage holds: plain arithmetic, shared by the ranks (`parallel_state`),
`pagoda plan` and `pagoda doctor` (no torch here, so the tools import it without one)."""

from __future__ import annotations


def stage_layer_range(num_layers: int, stage: int, pipeline_size: int) -> range:
    """The decoder layers pipeline `stage` of `pipeline_size` holds: contiguous, balanced by count, the earlier
    stages taking one more when they do not divide, so stage 0 (the driver's, whose KV cache spec sizes every
    stage's pool) holds the most. ValueError when there are fewer layers than stages."""
    if num_layers < pipeline_size:
        raise ValueError(f"{num_layers} decoder layers cannot be split into {pipeline_size} pipeline stages")
    base, extra = divmod(num_layers, pipeline_size)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))
