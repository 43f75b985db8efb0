"""CPU decode steps: a Llama-family layer in the fewest PyTorch calls.

A CPU decode step of a few running requests (the embedded model answering a handful of users) spends as much time
around its matmuls and attention as in them: the general layer makes ~80 PyTorch calls for an [R, H] activation,
each a few µs of dispatch and Python (module calls, reshapes, dtype round trips, q and k rotated apart). When every
row of a step is a decode row (one query token each), `layer` runs a decoder layer in about half the calls:
- the layer's parts are looked up once (`LeanLayer`, made at the model's first decode-only step), so a step makes
  no `nn.Module` attribute lookups, and each projection is called on its weight directly (`_projection`);
- q and k heads are rotated together, as the one [R, Hq + Hkv, D] slice of the fused qkv output they are;
- the attention is the backend's own store and decode attention, called directly, except for a lone row whose
  blocks are one run (`TorchAttentionMetadata.lone`): its K and V go to its one slot and attention reads the cache
  view straight into o_proj.

Every value comes from the same operations in the same order as the general path, so the layer's output is the
general path's bit for bit (tests/models/test_llama_cpu_decode.py holds it to that, alone and with several rows).

It applies to a layer with float32 activations and cache on the CPU, full-width rotary, no LoRA adapters, no
forward hooks (`--cpu-offload-gb` stages a layer's weights from them), one tensor-parallel rank, float32 norms, and
projections that are plain weights or 4-bit GGUF layers (`CpuInt4Method`); any other layer runs the general path
within the same step, and so does every layer of a step that prefills. Switch: PAGODA_CPU_LEAN_DECODE=0.
Benchmark: `benchmarks/cpu_vs_llamacpp.py --also pagoda-noleandecode`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagoda import envs
from pagoda.distributed import parallel_state
from pagoda.layers.attention import Attention, StepAttention
from pagoda.layers.linear import Linear
from pagoda.layers.quantization.cpu_int4 import CpuInt4Method
from pagoda.layers.torch_attention import TorchAttentionMetadata, attend_in_place

if TYPE_CHECKING:
    from pagoda.models.llama import LlamaDecoderLayer

ENABLED = envs.CPU_LEAN_DECODE.value  # read once: the switch is set before the process starts


def decode_only(attn: StepAttention, x: torch.Tensor) -> bool:
    """Whether `layer` may run this step: decode rows only (one query token each), float32 activations on the CPU,
    one tensor-parallel rank."""
    if not ENABLED or x.dtype != torch.float32 or x.device.type != "cpu":
        return False
    metadata = attn.metadata
    if not isinstance(metadata, TorchAttentionMetadata) or parallel_state.tp_world_size() != 1:
        return False
    return (metadata.decode_blocks is not None or metadata.alone is not None) and not metadata.prefill_rows


def eligible(layer: LlamaDecoderLayer, rope: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether `layer` computes exactly what this layer's general path does (module docstring)."""
    if layer._forward_pre_hooks or layer._forward_hooks:  # e.g. `--cpu-offload-gb` staging its weights: needs a call
        return False
    attention = layer.self_attn
    if 2 * rope[0].shape[-1] != attention.head_dim or attention.attn.k_cache.dtype != torch.float32:
        return False
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(w.dtype != torch.float32 for w in norms):
        return False
    projections = (attention.qkv_proj, attention.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    return all(p.lora is None and (p.quant is None or isinstance(p.quant, CpuInt4Method)) for p in projections)


def _projection(layer: Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """`layer(·)` for x [R, I] float32 (one rank, no adapters) without the module call, its weight, bias and method
    looked up now rather than every step: a 4-bit layer's own `apply` picks its kernel by row count, as the layer
    does."""
    weight, bias, quant = (None if layer.quant is not None else layer.weight), layer.bias, layer.quant
    if quant is None:
        return lambda x: F.linear(x, weight, bias)
    return lambda x: quant.apply(layer, x, bias)


@dataclass(frozen=True, slots=True)
class LeanLayer:
    """One eligible decoder layer's parts, looked up once (a submodule or parameter read through
    `nn.Module.__getattr__` costs ~1-3 µs, a dozen of them a layer a step). The KV cache tensors are read from
    `cache` each step: the worker binds them (`Attention.bind_kv_cache`) after this may have been made."""

    input_norm: tuple[torch.Tensor, float]  # (weight, eps)
    post_norm: tuple[torch.Tensor, float]
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    heads: int
    kv_heads: int
    dim: int
    cache: Attention


def lean_layer(layer: LlamaDecoderLayer) -> LeanLayer:
    attention, mlp = layer.self_attn, layer.mlp
    norms = layer.input_layernorm, layer.post_attention_layernorm
    return LeanLayer(
        *((norm.weight, norm.eps) for norm in norms),
        *(_projection(p) for p in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)),
        attention.num_heads,
        attention.num_kv_heads,
        attention.head_dim,
        attention.attn,
    )


def layer(
    lean: LeanLayer,
    rope: tuple[torch.Tensor, torch.Tensor],
    x: torch.Tensor,
    residual: torch.Tensor | None,
    attn: StepAttention,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`LlamaDecoderLayer.forward` for a step of R decode rows: x, residual [R, H] → (MLP output, residual stream)."""
    residual = x if residual is None else x + residual
    weight, eps = lean.input_norm
    qkv = lean.qkv(F.rms_norm(residual, (residual.shape[-1],), weight, eps))
    heads, kv_heads, dim = lean.heads, lean.kv_heads, lean.dim
    n = qkv.shape[0]
    qk = qkv[:, : (heads + kv_heads) * dim].view(n, heads + kv_heads, dim)
    cos, sin = rope  # [R, 1, D/2]
    x1, x2 = qk.chunk(2, dim=-1)
    qk = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # [R, Hq + Hkv, D]
    v = qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
    cache = lean.cache
    metadata = attn.metadata
    assert isinstance(metadata, TorchAttentionMetadata)
    lone = metadata.lone
    if lone is not None:  # one row in place: its K/V to its one slot, attention over the cache view
        k_cache = cache.k_cache.view(-1, kv_heads, dim)  # [slots, Hkv, D]
        v_cache = cache.v_cache.view(-1, kv_heads, dim)
        slot = lone.first_slot + lone.length - 1  # the blocks are one run: position p sits at first_slot + p
        k_cache[slot], v_cache[slot] = qk[0, heads:], v[0]
        out = attend_in_place(qk[:, :heads, None], k_cache, v_cache, lone, cache.scale)  # [1, Hq, 1, D]
    else:  # the backend's own store and decode attention (in place per row, or one gathered batch)
        caches = (cache.k_cache, cache.v_cache, metadata, cache.scale, cache.k_scale, cache.v_scale)
        out = attn.backend.forward(qk[:, :heads], qk[:, heads:], v, *caches)  # [R, Hq, D]
    residual = lean.o(out.reshape(n, heads * dim)) + residual
    weight, eps = lean.post_norm
    gate_up = lean.gate_up(F.rms_norm(residual, (residual.shape[-1],), weight, eps))
    gate, up = gate_up.chunk(2, dim=-1)
    return lean.down(F.silu(gate) * up), residual
