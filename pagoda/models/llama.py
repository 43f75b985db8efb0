"""Llama-family decoder (LlamaForCausalLM, Qwen2ForCausalLM; covers SmolLM2) over paged attention.

Parameter names follow the HF checkpoints except where projections are fused (`qkv_proj`,
`gate_up_proj`); `packed_modules_mapping` tells the loader how HF names map onto them.
Qwen2 differs from Llama only by biases on q/k/v.

Tensor parallelism (`layers/linear.py`, `layers/vocab_parallel.py`): each rank holds its share of
the attention heads (KV heads replicated where there are fewer than ranks) and of the MLP's
intermediate features; o_proj and down_proj sum the ranks' partial outputs, so every layer's output
and the residual stream are whole and identical on every rank; the embedding and LM head are split
by vocabulary rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagoda.layers.activation import SiluAndMul
from pagoda.layers.attention import Attention, StepAttention
from pagoda.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagoda.layers.norm import RMSNorm
from pagoda.layers.pipeline import MissingLayer, PipelineStage, StageHidden
from pagoda.layers.rotary import RotaryEmbedding, rope_parameters
from pagoda.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from pagoda.models import llama_cpu_decode
from pagoda.models.base import CausalLM


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], qkv_bias: bool):
        super().__init__()
        hidden = cfg["hidden_size"]
        total_heads = cfg["num_attention_heads"]
        total_kv_heads = cfg.get("num_key_value_heads") or total_heads
        self.head_dim = cfg.get("head_dim") or hidden // total_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv_heads, bias=qkv_bias)
        # This rank's heads (all of them at world size 1).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, hidden, bias=bool(cfg.get("attention_bias", False)) and not qkv_bias
        )
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, attn: StepAttention) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, attn, rope=rope))  # RoPE inside (fused with the KV store)


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], shard_names=("gate", "up"))
        self.down_proj = RowParallelLinear(intermediate, hidden)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act.of_projection(self.gate_up_proj, x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], qkv_bias: bool):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(cfg, qkv_bias)
        self.mlp = LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"])
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        attn: StepAttention,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, not yet added to `residual` (the residual stream);
        the first layer gets the embeddings and no residual. Returns (MLP output, residual stream):
        each residual add happens inside the next norm (`RMSNorm(x, residual)`, one fused kernel on
        the GPU), the last one in the model's final norm. Same sums, same rounding as
        `x = x + attn(norm(x)); x = x + mlp(norm(x))`."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(rope, h, attn), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_positions: int, qkv_bias: bool):
        super().__init__()
        n = cfg["num_hidden_layers"]
        self.stage = stage = PipelineStage.current(n)
        hidden = cfg["hidden_size"]
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], hidden) if stage.first else MissingLayer()
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        theta, scaling = rope_parameters(cfg)
        self.rotary_emb = RotaryEmbedding(head_dim, max_positions, theta, scaling)
        self.layers = stage.build(n, lambda: LlamaDecoderLayer(cfg, qkv_bias))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)) if stage.last else MissingLayer()
        # This stage's layers for the lean CPU decode path (None: the general path), made at the first decode-only
        # step: what `llama_cpu_decode.eligible` checks is fixed once the model is loaded and its KV cache is
        # allocated, and asking it again, and looking the layer's parts up again, cost ~50 µs a layer a step.
        self._lean_layers: list[llama_cpu_decode.LeanLayer | None] | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: StepAttention
    ) -> torch.Tensor | StageHidden:
        x, residual = (self.embed_tokens(input_ids), None) if self.stage.first else attn.stage_input
        rope = self.rotary_emb.cos_sin(positions)
        layers = self.stage.own(self.layers)
        lean = llama_cpu_decode.decode_only(attn, x)  # CPU decode rows only: layers in the fewest calls
        if lean and self._lean_layers is None:
            eligible = llama_cpu_decode.eligible
            self._lean_layers = [llama_cpu_decode.lean_layer(lay) if eligible(lay, rope) else None for lay in layers]
        for i, layer in enumerate(layers):
            plan = self._lean_layers[i] if lean else None  # type: ignore[index]
            if plan is not None:
                x, residual = llama_cpu_decode.layer(plan, rope, x, residual, attn)
            else:
                x, residual = layer(rope, x, attn, residual)
        if not self.stage.last:
            return StageHidden(x, residual)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class LlamaForCausalLM(CausalLM):
    """input_ids [T], positions [T] (flattened batch) → hidden [T, H]; `compute_logits` → [N, V] (the
    whole vocabulary, on every tensor-parallel rank)."""

    qkv_bias = False
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: dict[str, Any], max_positions: int):
        super().__init__()
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        positions = max(max_positions, int(cfg.get("max_position_embeddings", max_positions)))
        self.model = LlamaModel(cfg, positions, self.qkv_bias)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"]) if self.stage.last else MissingLayer()
        self.tie_weights()


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
