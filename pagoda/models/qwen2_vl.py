"""Qwen2-VL (Qwen2VLForConditionalGeneration): a ViT + patch merger feeding a Qwen2 decoder with M-RoPE.

See docs/models.md, Qwen2-VL. The decoder is our Qwen2 (`models/llama.py` layers with q/k/v bias);
what differs:
- placeholder tokens (<|image_pad|>, <|video_pad|>) take the vision encoder's output rows instead of
  their embeddings (`StepAttention.mm_embeds`, gathered by the runner per chunk);
- rotary positions are (t, h, w) triples (`StepAttention.mrope_positions`, [3, T]); frequency band k
  of `mrope_section` rotates with axis k. Text-only steps pass none and use plain 1-D RoPE, which
  is the same thing when the three positions agree.
Config: flat (official) or nested (`text_config`, transformers >= 5); rope given as
`rope_scaling: {type: mrope | default, mrope_section}` or `rope_parameters`; a partial
`vision_config` gets the vision defaults. Weights: `visual.*`, `model.*`, `lm_head.*`, and the
`model.language_model.*` / `model.visual.*` spellings of transformers 4.5x re-saves.
Tensor parallelism: the decoder is split as Qwen2's (`models/llama.py`); the vision tower is
replicated (plain `Linear` layers, whole weights on every rank), so `encode` gives the same rows on
every rank and each rank merges them into its own, identical, embeddings.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pagoda.errors import ModelLoadError
from pagoda.layers.attention import StepAttention
from pagoda.layers.norm import RMSNorm
from pagoda.layers.pipeline import MissingLayer, PipelineStage, StageHidden
from pagoda.layers.rotary import RotaryEmbedding, multimodal_cos_sin
from pagoda.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from pagoda.models.base import CausalLM, ModelCapabilities
from pagoda.models.llama import LlamaDecoderLayer
from pagoda.models.qwen2_vl_vision import (
    Qwen2VisionTransformer,
    SegmentLayout,
    TowerPlan,
    vision_config_with_defaults,
)

IMAGE_TOKEN_ID = 151655
VIDEO_TOKEN_ID = 151656


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's fields, flat, whichever layout config.json uses (nested text_config wins)."""
    flat = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    flat.update(cfg.get("text_config") or {})
    return flat


def mrope_section(text_cfg: dict[str, Any]) -> list[int]:
    for key in ("rope_scaling", "rope_parameters"):
        section = (text_cfg.get(key) or {}).get("mrope_section")
        if section:
            return [int(s) for s in section]
    raise ModelLoadError("Qwen2-VL config.json has no mrope_section (in rope_scaling or rope_parameters).")


def rope_theta(text_cfg: dict[str, Any]) -> float:
    return float(text_cfg.get("rope_theta") or (text_cfg.get("rope_parameters") or {}).get("rope_theta") or 1e6)


class Qwen2VLTextModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_positions: int):
        super().__init__()
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or hidden // heads
        self.sections = mrope_section(cfg)
        if 2 * sum(self.sections) != head_dim:
            raise ModelLoadError(f"mrope_section {self.sections} must sum to head_dim/2 = {head_dim // 2}.")
        n = cfg["num_hidden_layers"]
        self.stage = stage = PipelineStage.current(n)
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], hidden) if stage.first else MissingLayer()
        # M-RoPE is plain RoPE (theta from the config, no scaling) applied per axis band.
        self.rotary_emb = RotaryEmbedding(head_dim, max_positions, rope_theta(cfg), None)
        layer_cfg = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_parameters")}
        self.layers = stage.build(n, lambda: LlamaDecoderLayer(layer_cfg, qkv_bias=True))
        self.norm = RMSNorm(hidden, cfg.get("rms_norm_eps", 1e-6)) if stage.last else MissingLayer()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepAttention
    ) -> torch.Tensor | StageHidden:
        if self.stage.first:
            x, residual = self.embed_tokens(input_ids), None  # the layers hand the residual stream on
            if step.mm_embeds is not None:
                index, embeds = step.mm_embeds
                x = x.index_copy(0, index, embeds.to(x.dtype))
        else:
            x, residual = step.stage_input
        if step.mrope_positions is not None:
            rope = multimodal_cos_sin(self.rotary_emb, step.mrope_positions, self.sections)
        else:
            rope = self.rotary_emb.cos_sin(positions)
        for layer in self.stage.own(self.layers):
            x, residual = layer(rope, x, step, residual)
        if not self.stage.last:
            return StageHidden(x, residual)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class Qwen2VLForConditionalGeneration(CausalLM):
    """input_ids [T], positions [T] (+ step.mrope_positions [3, T], step.mm_embeds) → hidden [T, H].

    `encode(pixel_values, grid_thw)` runs the vision tower for whole items (never a part of one)."""

    capabilities = ModelCapabilities(encoder=True, mrope=True)
    first_stage_prefixes = ("model.embed_tokens.", "visual.")
    # The patch embedding is a Conv3d in transformers (and so in PEFT): its adapters' conv kernels flatten to the
    # [r, C·T·p·p] / [out, r] pair of the Linear it is here (`lora/peft.py`).
    encoder_lora_groups = ("visual.patch_embed.", "visual.blocks.", "visual.merger.")
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: dict[str, Any], max_positions: int):
        super().__init__()
        text = text_config(cfg)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        self.image_token_id = int(cfg.get("image_token_id", text.get("image_token_id", IMAGE_TOKEN_ID)))
        self.video_token_id = int(cfg.get("video_token_id", text.get("video_token_id", VIDEO_TOKEN_ID)))
        self.vision_config = vision_config_with_defaults(dict(cfg.get("vision_config") or {}), text["hidden_size"])
        self.merge_size = int(self.vision_config["spatial_merge_size"])
        positions = max(max_positions, int(text.get("max_position_embeddings", max_positions)))
        self.model = Qwen2VLTextModel(text, positions)
        # The vision tower feeds the embeddings: it lives on the first pipeline stage.
        self.visual = Qwen2VisionTransformer(self.vision_config) if self.stage.first else MissingLayer()
        self.lm_head = ParallelLMHead(text["vocab_size"], text["hidden_size"]) if self.stage.last else MissingLayer()
        self.tie_weights()

    def map_weight_name(self, name: str) -> str:
        """transformers 4.5x re-saves nest the decoder and the vision tower under `model.`."""
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model.") :]
        if name.startswith("model.visual."):
            return name[len("model.") :]
        return name

    def encode(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """Whole items → [sum(t*h*w/merge**2), H] placeholder embeddings, in item order."""
        return self.visual(pixel_values.to(self.encoder_dtype), grid_thw)

    @property
    def encoder_dtype(self) -> torch.dtype:
        return self.visual.patch_embed.proj.weight.dtype

    def encoder_lora_rows(self, grid_thw: list[tuple[int, int, int]], item_slots: list[int]) -> dict[str, np.ndarray]:
        """For adapters on the tower: {group in `encoder_lora_groups`: the adapter slot of each row its layers see}
        for items whose adapters sit in item_slots (-1: none). The patch embedding runs the patch rows in the items'
        order, the blocks in the tower's (`SegmentLayout`, grouped by segment length), the merger one row per window
        of merge² of the blocks' rows."""
        patches = np.repeat(np.asarray(item_slots, dtype=np.int64), [t * h * w for t, h, w in grid_thw])
        layout = SegmentLayout.of(list(grid_thw), self.merge_size**2)
        rows = patches if layout.rows is None else patches[layout.rows]
        return {"visual.patch_embed.": patches, "visual.blocks.": rows, "visual.merger.": rows[:: self.merge_size**2]}

    def encoder_plan(self, grid_thw: list[tuple[int, int, int]], device: torch.device) -> TowerPlan:
        """What `encode_planned` needs beside the pixels (device tensors made once, kept by a CUDA graph)."""
        return self.visual.plan(grid_thw, device)

    def encode_planned(self, pixel_values: torch.Tensor, plan: TowerPlan) -> torch.Tensor:
        """`encode` of pixels (in `encoder_dtype`) whose items' `encoder_plan` is made: kernels only, no host copy."""
        return self.visual.run(pixel_values, plan)

    def encoder_profile_input(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The vision tower's largest input for a step of up to `num_tokens` placeholder tokens, for
        the memory profile: one image, a square grid (capped at 16384 tokens, the largest image the
        checkpoint defaults allow)."""
        side = max(1, int(min(num_tokens, 16384) ** 0.5))
        grid = (1, side * self.merge_size, side * self.merge_size)
        width = self.visual.patch_embed.proj.weight.shape[1]
        return torch.zeros(grid[1] * grid[2], width, dtype=dtype, device=device), [grid]
