"""What every causal LM here is to the runner: the shared methods, and a record of what it can do.

A model class says what it is in `capabilities`, read once by the runner (`worker/model_runner.py`)
and the cache sizing (`worker/memory.py`); nothing probes a model for attributes. The shared methods:
`forward(input_ids [T], positions [T], step) -> hidden [T, H]` over the flattened batch,
`compute_logits(hidden [N, H]) -> [N, V]` (the whole vocabulary on every tensor-parallel rank),
`attention_layers()` (the runner binds their KV caches), `sequence_state_layers()` (layers that keep
per-sequence state beside the KV cache; the runner binds their slots), and the loader's hooks
(`packed_modules_mapping`, `map_weight_name`, `skip_weight`, `tie_weights`, `stage_weight_name`).

Under pipeline parallelism the decoder (`self.model`) holds one stage's layers (`layers/pipeline.py`,
`self.model.stage`); `forward` then returns `StageHidden` on every stage but the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from pagoda.layers.attention import Attention, StepAttention
from pagoda.layers.pipeline import PipelineStage, StageHidden


@dataclass(frozen=True)
class ModelCapabilities:
    # Per-sequence recurrent state beside the KV cache (Yuan2's LF gate): the runner keeps a state slot
    # per running sequence and, with prefix caching, a snapshot per block (`sequence_state_layers`).
    stateful: bool = False
    # A multimodal encoder: `encode(pixels, grid_thw)` gives placeholder embeddings, and
    # `encoder_profile_input(num_tokens, dtype, device)` its largest input for the memory profile.
    encoder: bool = False
    # Rotary positions are (t, h, w) triples (`StepAttention.mrope_positions`).
    mrope: bool = False
    # The forward has fixed shapes and no host syncs, so a step can be captured in a CUDA graph.
    cuda_graphs: bool = True


class CausalLM(nn.Module):
    """Subclasses build `self.model` (the decoder, called as forward is) and `self.lm_head`."""

    capabilities: ModelCapabilities = ModelCapabilities()
    # HF projection name → (our fused parameter, its shard name), for the loader.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str]]] = {}
    tie_word_embeddings: bool = False
    # Parameter prefixes only the first / the last pipeline stage holds (besides decoder layers by index).
    first_stage_prefixes: ClassVar[tuple[str, ...]] = ("model.embed_tokens.",)
    last_stage_prefixes: ClassVar[tuple[str, ...]] = ("model.norm.", "lm_head.")
    # Module-name prefixes of an encoder's layer groups that take adapters (`lora/manager.py`); each group's rows
    # are mapped to adapters by `encoder_lora_rows`.
    encoder_lora_groups: ClassVar[tuple[str, ...]] = ()
    model: nn.Module
    lm_head: nn.Module
    weight_streamer: Any = None  # --cpu-offload-gb: the layers whose weights stream in (models/weight_offload.py)

    @property
    def stage(self) -> PipelineStage:
        return self.model.stage

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after `to_empty`, which unties them). A last
        pipeline stage without the embedding keeps its own head, loaded from the embedding's entry."""
        if self.tie_word_embeddings and self.stage.whole:
            self.lm_head.weight = self.model.embed_tokens.weight

    def encoder_lora_rows(self, grid_thw: list[tuple[int, int, int]], item_slots: list[int]) -> dict[str, np.ndarray]:
        """{group in `encoder_lora_groups`: the adapter slot (-1: none) of each row the group's layers see} for one
        encoder call over items of these grids whose adapters sit in item_slots. `LoRAManager` asks only a model
        that names groups, and such a model must say how its encoder orders their rows: no default order is safe
        (Qwen2-VL's blocks regroup the patch rows, its merger sees one row per window)."""
        raise NotImplementedError(
            f"{type(self).__name__} names encoder_lora_groups {self.encoder_lora_groups} but does not map their rows"
        )

    def stage_weight_name(self, name: str) -> str | None:
        """The parameter a checkpoint entry (this class's spelling) fills on this pipeline stage, or
        None when another stage holds it."""
        stage = self.stage
        if self.tie_word_embeddings and stage.last and not stage.first and name == "model.embed_tokens.weight":
            return "lm_head.weight"
        return name if stage.holds(name, self.first_stage_prefixes, self.last_stage_prefixes) else None

    def map_weight_name(self, name: str) -> str:
        """A checkpoint name as this class names the parameter (identity unless a checkpoint differs)."""
        return name

    def skip_weight(self, name: str) -> bool:
        """Checkpoint entries with no parameter here (rotary buffers, a duplicate tied head)."""
        return "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight")

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepAttention
    ) -> torch.Tensor | StageHidden:
        return self.model(input_ids, positions, step)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        """This stage's attention layers (every layer's without pipeline parallelism)."""
        return [layer.self_attn.attn for layer in self.stage.own(self.model.layers)]

    def sequence_state_layers(self) -> list[Any]:
        return []
