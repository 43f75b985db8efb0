"""Yuan2.0 (YuanForCausalLM): dense 2B/51B/102B and the M32 mixture of experts.

As the official Yuan2 modeling code computes it (docs/models.md, Yuan2). What differs from Llama, and
where it is handled:
- Localized-filtering attention: V from the normed input x; Q and K from the LF gate's
  output y (`layers/localized_filter.py`, with per-sequence state slots).
- The checkpoint's `q_proj`/`k_proj` are the two halves of one fused, per-head interleaved QK
  projection: head i's query is row block [2Di, 2Di+D) of [q_proj; k_proj], its key the next D
  rows. `YuanQKProjection.weight_loader` de-interleaves into [Q (head-major) ; K (head-major)] at
  load time, so the forward is a plain fused projection and a contiguous head split stays valid
  for tensor parallelism.
- Dense MLP with swapped names: SiLU on `up_proj`, times `gate_proj`; fused [up | gate].
- M32: attention router (fp32), top-k experts, `w1` = [activated | linear] halves; head
  dim = attention_projection_size / heads, RoPE on the first hidden/heads dims only, and the
  reference's all-bfloat16 RoPE table unless config.json sets `rope_precision`.
- No remote code: everything is read from config.json; `rotary_emb.inv_freq` buffers are skipped.

Tensor parallelism (docs/models.md, Yuan2: tensor parallelism): heads are split over the ranks.
Rank r of N takes rows [r·2P/N, (r+1)·2P/N) of the fused, interleaved [q_proj; k_proj], which are
the q and k of heads r·NH/N .. (r+1)·NH/N - 1 (`YuanQKProjection`), the same heads' rows of v_proj
and columns of o_proj (summed over the ranks). The LF gate is replicated: whole conv weights on every rank, fed
the same (all-reduced) hidden states, so its state slots stay identical on every rank without
communication. MLP and experts: up/gate (w1's [activated | linear] halves) split as merged
columns, down (w2) by rows; M32's router is replicated and the expert sum is reduced once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed import parallel_state
from pagoda.errors import ModelLoadError
from pagoda.kernels import policy
from pagoda.layers.activation import SiluAndMul
from pagoda.layers.attention import Attention, StepAttention
from pagoda.layers.linear import (
    ColumnParallelLinear,
    Linear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    Weight,
    gathered_rows,
    read_weight,
    reads_shards,
)
from pagoda.layers.localized_filter import LocalizedFilter
from pagoda.layers.norm import RMSNorm
from pagoda.layers.pipeline import MissingLayer, PipelineStage, StageHidden
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.layers.side_stream import Branch
from pagoda.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from pagoda.models.base import CausalLM, ModelCapabilities

YUAN_ROPE_THETA = 10000.0  # never in the config: 10000 for every released model


class YuanShape:
    """The dimensions Yuan's config implies (docs/models.md, Yuan2: reading config.json), validated once."""

    def __init__(self, cfg: dict[str, Any]):
        self.hidden = int(cfg["hidden_size"])
        self.num_heads = int(cfg["num_attention_heads"])
        projection = cfg.get("attention_projection_size") or self.hidden
        self.projection = int(projection)
        moe = cfg.get("moe_config") or {}
        self.use_moe = bool(cfg.get("use_moe")) or int(moe.get("moe_num_experts") or 0) > 0
        problems = []
        if cfg.get("use_shareqk"):
            problems.append(
                "use_shareqk=true (a shared-QK attention variant no released Yuan2 model uses; set it to false)"
            )
        if self.hidden % self.num_heads or self.projection % self.num_heads:
            problems.append(
                f"hidden_size {self.hidden} / attention_projection_size {self.projection} "
                f"must divide by num_attention_heads {self.num_heads}"
            )
        if self.hidden % 2:
            problems.append(f"hidden_size {self.hidden} must be even (the LF gate halves it)")
        if cfg.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act {cfg.get('hidden_act')!r} (Yuan2 uses silu)")
        if cfg.get("num_key_value_heads") not in (None, self.num_heads):
            problems.append("num_key_value_heads (Yuan2 attention is plain multi-head)")
        self.head_dim = self.projection // self.num_heads
        self.rotary_dim = self.hidden // self.num_heads
        if self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            problems.append(
                f"rotary dims per head ({self.rotary_dim} = hidden/heads) must be even and at most "
                f"the head dim {self.head_dim}"
            )
        if self.use_moe:
            self.num_experts = int(moe.get("moe_num_experts") or 0)
            self.top_k = int(moe.get("moe_top_k") or 0)
            self.ffn_hidden = int(moe.get("ffn_hidden_size") or 0)
            self.gated = bool(moe.get("gated_linear_unit", True))
            self.norm_topk = bool(moe.get("norm_topk_prob", True))
            if not (0 < self.top_k <= self.num_experts) or self.ffn_hidden <= 0:
                problems.append(f"moe_config {moe} needs 0 < moe_top_k <= moe_num_experts and ffn_hidden_size > 0")
        precision = cfg.get("rope_precision", "bfloat16" if self.use_moe else "float32")
        if precision not in ("float32", "bfloat16"):
            problems.append(f"rope_precision {precision!r} (use float32 or bfloat16)")
        # float32 references get our float64-built table (agrees with float32 to ~1e-7).
        self.rope_table_precision = "bfloat16" if precision == "bfloat16" else "float64"
        if problems:
            raise ModelLoadError("Unsupported Yuan2 config.json: " + "; ".join(problems) + ".")


class YuanQKProjection(Linear):
    """y [T, H] → [q | k] [T, 2P_r], head-major, for this rank's heads, from the checkpoint's
    interleaved q_proj/k_proj halves (P_r = this rank's heads × head dim; P_r = P at world size 1)."""

    def __init__(self, hidden: int, num_heads: int, head_dim: int):
        self.total_heads, self.head_dim = num_heads, head_dim
        first, self.num_heads = parallel_state.shard(num_heads, "num_attention_heads")  # this rank's heads
        # Rows [first_row, first_row + 2·P_r) of the fused [q_proj; k_proj] (2D rows per head).
        self.first_row = 2 * first * head_dim
        super().__init__(hidden, 2 * self.num_heads * head_dim)

    def shard_rows(self, shard_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of the checkpoint's q_proj or k_proj [P, H], the local fused rows they land on) for this rank.

        This tensor's rows in fused-row numbering, [offset, offset + P), meet this rank's rows
        [first_row, first_row + 2·P_r) in one contiguous range (empty on ranks whose heads all sit in the other
        half). Row g of the fused [q_proj; k_proj] belongs to head g // 2D: query if g % 2D < D, else key; on
        this rank it is local row g - first_row of local head (g - first_row) // 2D."""
        d, projection = self.head_dim, self.total_heads * self.head_dim
        offset = 0 if shard_id == "q" else projection
        local = self.num_heads * d
        start = max(offset, self.first_row)
        end = max(start, min(offset + projection, self.first_row + 2 * local))
        fused_rows = torch.arange(start, end) - self.first_row
        head, within = fused_rows // (2 * d), fused_rows % (2 * d)
        target = torch.where(within < d, head * d + within, local + head * d + within - d)
        return torch.arange(start, end) - offset, target

    def lora_row_maps(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]] | None:
        """The checkpoint's q_proj and k_proj interleave into this layer's rows: an adapter's B rows land as
        its weight rows do (`lora/peft.py` stacks the two adapters' ranks into one)."""
        return {shard: (*self.shard_rows(shard), self.total_heads * self.head_dim) for shard in ("q", "k")}

    @reads_shards
    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id: object = None) -> None:
        projection = self.total_heads * self.head_dim
        if tuple(loaded.shape) != (projection, param.shape[1]):
            raise ValueError(
                f"shape mismatch for {shard_id}_proj: expected {(projection, param.shape[1])}, "
                f"got {tuple(loaded.shape)}"
            )
        source, target = self.shard_rows(str(shard_id))
        if not len(source):  # only the contiguous range of this rank's rows is read
            return
        rows = read_weight(loaded.narrow(0, int(source[0]), len(source)), param.dtype)
        param.data[target.to(param.device)] = rows.to(param.device)


class YuanAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], shape: YuanShape):
        super().__init__()
        self.v_proj = ColumnParallelLinear(shape.hidden, shape.projection)
        self.lf_gate = LocalizedFilter(shape.hidden)  # replicated (see the module docstring)
        self.qk_proj = YuanQKProjection(shape.hidden, shape.num_heads, shape.head_dim)
        self.num_heads, self.head_dim = self.qk_proj.num_heads, shape.head_dim  # this rank's heads
        self.projection = self.num_heads * self.head_dim
        self.o_proj = RowParallelLinear(shape.projection, shape.hidden)
        self.attn = Attention(self.num_heads, self.num_heads, shape.head_dim)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        step: StepAttention,
        lf_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        # Values come from x, before the filter: on small decode steps (lf_inputs: the fused CUDA path)
        # v_proj runs on a side stream while conv1 → conv2 → norm → qk run (`side_stream`: there each
        # small matmul is bound by a per-kernel fixed cost, so two side by side cost little more than one).
        v_branch = Branch(self.v_proj, x, enabled=lf_inputs is not None and t <= policy.SIDE_STREAM_MAX_ROWS)
        y = self.lf_gate(x, step.state, lf_inputs)
        q, k = self.qk_proj(y).split([self.projection, self.projection], dim=-1)
        return self.o_proj(self.attn(q, k, v_branch.join(), step, rope=rope))  # RoPE inside, as in Llama


class YuanMLP(nn.Module):
    """down(SiLU(up(x)) * gate(x)): the activated branch is `up_proj`, so it goes first in the fusion."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.up_gate_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], shard_names=("up", "gate"))
        self.down_proj = RowParallelLinear(intermediate, hidden)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act.of_projection(self.up_gate_proj, x))


class YuanAttentionRouter(nn.Module):
    """Router logits r = softmax(q kᵀ) v per token, with q, k, v ∈ R^E (E = experts), in float32."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.query = Linear(hidden, num_experts)
        self.key = Linear(hidden, num_experts)
        self.value = Linear(hidden, num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (proj(x).float() for proj in (self.query, self.key, self.value))  # [T, E] each
        weights = torch.softmax(q.unsqueeze(-1) * k.unsqueeze(-2), dim=-1)  # [T, E, E]
        return (weights @ v.unsqueeze(-1)).squeeze(-1)  # [T, E]


class YuanExpert(nn.Module):
    """w1 split as merged columns (each of its [activated | linear] halves on its own), w2 by rows
    without its reduction: the output is this rank's partial sum, reduced once by `YuanMoE`."""

    def __init__(self, hidden: int, ffn_hidden: int, gated: bool):
        super().__init__()
        self.gated = gated
        self.w1 = MergedColumnParallelLinear(hidden, [ffn_hidden, ffn_hidden] if gated else [ffn_hidden])
        self.w2 = RowParallelLinear(ffn_hidden, hidden, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(x)
        if self.gated:
            a, b = h.chunk(2, dim=-1)  # [activated | linear]
            return self.w2(F.silu(a) * b)
        return self.w2(F.silu(h))


class YuanMoE(nn.Module):
    """Top-k experts per token, weights renormalised over the chosen k (norm_topk_prob).

    A loop over experts with token gather/scatter: exact and simple; a grouped-GEMM kernel is GPU
    work for later (M32 throughput is not tuned yet)."""

    def __init__(self, hidden: int, shape: YuanShape):
        super().__init__()
        self.tp_size = parallel_state.tp_world_size()
        self.top_k, self.norm_topk = shape.top_k, shape.norm_topk
        self.gate = YuanAttentionRouter(hidden, shape.num_experts)
        self.experts = nn.ModuleList(
            YuanExpert(hidden, shape.ffn_hidden, shape.gated) for _ in range(shape.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1)  # [T, E] float32
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for index in torch.unique(chosen).tolist():
            token, slot = torch.nonzero(chosen == index, as_tuple=True)
            with gathered_rows(token):  # which step tokens the expert's rows are (its adapters read them)
                contribution = self.experts[index](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, contribution)
        # Every rank routed the same tokens to the same experts (replicated router, same input) and
        # added its share of each expert's output: one sum over the ranks completes them all.
        return out if self.tp_size == 1 else parallel_state.all_reduce(out)


class YuanDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], shape: YuanShape):
        super().__init__()
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.self_attn = YuanAttention(cfg, shape)
        self.mlp: nn.Module = (
            YuanMoE(shape.hidden, shape) if shape.use_moe else YuanMLP(shape.hidden, int(cfg["intermediate_size"]))
        )
        self.input_layernorm = RMSNorm(shape.hidden, eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden, eps)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        h: torch.Tensor,
        step: StepAttention,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `LlamaDecoderLayer.forward`: h is the previous layer's MLP output, not yet added to
        `residual`; returns (MLP output, residual stream) and each residual add is fused into the
        next norm. The LF gate still sees input_layernorm's output (inside self_attn), as before; on
        CUDA decode steps that norm is fused with the gate's state shifts (`fused_decode_input`)."""
        fused = self.self_attn.lf_gate.fused_decode_input(h, residual, self.input_layernorm, step.state)
        lf_inputs = None
        if fused is not None:
            x, residual, lf_inputs = fused
        elif residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(rope, x, step, lf_inputs), residual)
        return self.mlp(x), residual


class YuanModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], shape: YuanShape, max_positions: int):
        super().__init__()
        n = cfg["num_hidden_layers"]
        self.stage = stage = PipelineStage.current(n)
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], shape.hidden) if stage.first else MissingLayer()
        self.rotary_emb = RotaryEmbedding(
            shape.rotary_dim, max_positions, YUAN_ROPE_THETA, None, shape.rope_table_precision
        )
        self.layers = stage.build(n, lambda: YuanDecoderLayer(cfg, shape))
        self.norm = RMSNorm(shape.hidden, float(cfg.get("rms_norm_eps", 1e-6))) if stage.last else MissingLayer()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepAttention
    ) -> torch.Tensor | StageHidden:
        h, residual = (self.embed_tokens(input_ids), None) if self.stage.first else step.stage_input
        rope = self.rotary_emb.cos_sin(positions)
        for layer in self.stage.own(self.layers):
            h, residual = layer(rope, h, step, residual)
        if not self.stage.last:
            return StageHidden(h, residual)
        return self.norm(h) if residual is None else self.norm(h, residual)[0]


class YuanForCausalLM(CausalLM):
    """input_ids [T], positions [T] (flattened batch) → hidden [T, H]; needs `step.state` (LF slots)."""

    packed_modules_mapping = {
        "q_proj": ("qk_proj", "q"),
        "k_proj": ("qk_proj", "k"),
        "up_proj": ("up_gate_proj", "up"),
        "gate_proj": ("up_gate_proj", "gate"),
    }

    def __init__(self, cfg: dict[str, Any], max_positions: int):
        super().__init__()
        self.shape = YuanShape(cfg)
        # The expert loop reads the chosen experts on the host (a sync): no CUDA-graph capture for MoE.
        self.capabilities = ModelCapabilities(stateful=True, cuda_graphs=not self.shape.use_moe)
        # The config class defaults to tied embeddings; the checkpoints store an identical lm_head.
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))
        positions = max(max_positions, int(cfg.get("max_position_embeddings", max_positions)))
        self.model = YuanModel(cfg, self.shape, positions)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], self.shape.hidden) if self.stage.last else MissingLayer()
        self.tie_weights()

    def skip_weight(self, name: str) -> bool:
        return "rotary_emb." in name or (self.tie_word_embeddings and name == "lm_head.weight")

    def sequence_state_layers(self) -> list[LocalizedFilter]:
        """Layers that keep per-sequence state beside the KV cache (the runner binds their slots)."""
        return [layer.self_attn.lf_gate for layer in self.stage.own(self.model.layers)]
