"""The multimodal encoder's part of a step: placeholder rows from the vision tower, through the cache.

One entry point, `EncoderRunner.embeds(states, inputs)`: the encoder rows for every placeholder token
in the step and their flat token indices (host), which the eager forward hands the model as
`StepAttention.mm_embeds` and a mixed-step CUDA graph reads from its static buffers. Every item overlapping a row's
scheduled range needs its whole encoder output (the vision tower is never run on part of an item):
taken from the encoder cache (`worker/encoder_cache.py`), or computed now for all missing items in
one batched call (replayed from a CUDA graph where one is held for those items' shapes). A chunk boundary
may cut an item; each chunk takes its slice of the rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pagoda import envs
from pagoda.device_copy import to_device
from pagoda.inputs import expand_temporal
from pagoda.worker.encoder_cache import EncoderCache
from pagoda.worker.encoder_graphs import CapturePolicy, EncoderGraphs
from pagoda.worker.request_states import RunnerRequestState
from pagoda.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from pagoda.lora.manager import LoRAManager


class EncoderRunner:
    def __init__(
        self, model: nn.Module, device: torch.device, cache_tokens: int, active: bool, lora: LoRAManager | None = None
    ):
        self.model = model
        self.device = device
        self.lora = lora  # adapters, some of which may adapt the encoder (`lora/manager.py`)
        self.cache = EncoderCache(cache_tokens)
        self.active = active  # the model has an encoder, on this pipeline stage
        self.graphs: EncoderGraphs | None = None  # `enable_graphs`

    def enable_graphs(self, max_patches: int | None = None) -> None:
        """Replay forwards of up to `max_patches` patch rows (default: PAGODA_ENCODER_GRAPH_PATCHES) from CUDA
        graphs (`worker/encoder_graphs.py`) where the model can plan its encoder's inputs ahead; 0: eager."""
        if max_patches is None:
            max_patches = envs.ENCODER_GRAPH_PATCHES.value
        if self.active and max_patches > 0 and hasattr(self.model, "encoder_plan"):
            policy = CapturePolicy(max_patches)
            self.graphs = EncoderGraphs(self.model, self.device, policy, envs.ENCODER_CAPTURE_THREAD.value)

    def embeds(self, states: list[RunnerRequestState], inputs: StepInputs) -> tuple[np.ndarray, torch.Tensor] | None:
        """(flat token indices [P] int64, encoder rows [P, H]) of the step's placeholder tokens, or None (none, or
        no encoder on this stage)."""
        if not (self.active and inputs.needs_encoder):
            return None
        starts, ends, query_start_loc = inputs.starts.tolist(), inputs.seq_lens.tolist(), inputs.query_start_loc
        needed = [
            (row, item)
            for row, (s, a, e) in enumerate(zip(states, starts, ends))
            if s.mm_inputs is not None
            for item in s.mm_inputs.items
            if item.overlaps(a, e)
        ]
        if not needed:
            return None
        # An item's output is the base model's, or its request's adapter's where that adapts the encoder.
        keys = [
            item.content_hash + (self.lora.encoder_key(states[row].lora_request) if self.lora else b"")
            for row, item in needed
        ]
        outputs: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, tuple[int, Any]] = {}  # key -> (row, item)
        for key, (row, item) in zip(keys, needed):
            if key in outputs or key in missing:
                continue
            cached = self.cache.get(key)
            if cached is not None:
                outputs[key] = cached
            else:
                missing[key] = (row, item)
        if missing:
            items = [item for _, item in missing.values()]
            pixels = torch.cat(
                [encoder_pixels(m.pixel_values, m.pixel_lut, self.device, m.temporal_repeat) for m in items]
            )
            grids = [m.grid_thw for m in items]
            adapted = self.lora is not None and self.lora.prepare_encoder(
                grids, [states[row].lora_request for row, _ in missing.values()]
            )
            try:
                if self.graphs is None or adapted:
                    encoded = self.model.encode(pixels, grids)
                else:
                    encoded = self.graphs.encode(pixels, grids)
            finally:
                if self.lora is not None:
                    self.lora.clear_encoder()
            for key, rows in zip(missing, encoded.split([m.length for m in items])):
                outputs[key] = rows
                self.cache.put(key, rows)
        index, embeds = [], []
        for key, (row, item) in zip(keys, needed):
            lo, hi = max(starts[row], item.offset), min(ends[row], item.end)
            first = int(query_start_loc[row]) + lo - starts[row]
            index.append(np.arange(first, first + hi - lo))
            embeds.append(outputs[key][lo - item.offset : hi - item.offset])
        return np.concatenate(index).astype(np.int64, copy=False), torch.cat(embeds)

    def profile(self, num_tokens: int, dtype: torch.dtype) -> None:
        """Run the encoder on the largest input a step of `num_tokens` placeholder tokens can bring
        (the model says what that is), for the memory profile."""
        pixels, grids = self.model.encoder_profile_input(num_tokens, dtype, self.device)
        self.model.encode(pixels, grids)


def encoder_pixels(
    pixel_values: np.ndarray, pixel_lut: np.ndarray | None, device: torch.device, temporal_repeat: int = 1
) -> torch.Tensor:
    """One item's encoder input on `device`, float32 [P, C * T * p * p]: uint8 levels cross to the device
    as they are (a quarter of float32's bytes, no host-device sync; a still image's one frame per temporal
    patch, repeated T times there) and are normalised there by a gather from the per-channel table, bit for
    bit what the host's `normalize_levels` gives; float32 patches (`pixel_lut` None) are copied as they are."""
    if pixel_lut is None:
        return expand_temporal(to_device(pixel_values, device), temporal_repeat).contiguous()
    levels = expand_temporal(to_device(pixel_values, device), temporal_repeat, pixel_lut.shape[0])  # uint8 [P, D]
    table = to_device(pixel_lut.astype(np.float32, copy=False), device).reshape(-1)  # [C * 256]
    channels, width = pixel_lut.shape[0], levels.shape[1]
    column_base = (torch.arange(width, device=levels.device) // (width // channels)) * 256  # [D]
    return table[levels.long() + column_base]
