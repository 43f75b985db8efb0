"""AWQ and GPTQ 4-bit weights: loaded in the checkpoint's own layout, converted once to Pagoda's.

Loading mirrors the checkpoint tensors (names and shapes as AutoAWQ / AutoGPTQ write them), each with
a `ParamLayout` so tensor parallelism and the fused q/k/v and gate/up projections slice them like
plain weights (`pagoda/layers/linear.py`):
- AWQ: qweight int32 [K, N/8] (packed along the output), qzeros int32 [K/G, N/8], scales [K/G, N];
- GPTQ: qweight int32 [K/8, N] (packed along the input), qzeros int32 [K/G, N/8], scales [K/G, N],
  g_idx int32 [K] (the group of each input row; act-order checkpoints permute it).
After loading, both become the one layout the kernels read (`int4_formats`): qweight packed along
K [K/8, N], scales and integer zero points [groups, N] in the model dtype, g_idx [K]:
W[n, k] = (q[k, n] - zeros[g_idx[k], n]) · scales[g_idx[k], n].

Groups over a row-parallel shard: each rank holds its K/N input rows and their K/(N·G) groups; an
act-order checkpoint's groups are scattered over all of K, so there every rank keeps all scales and
zero points, and g_idx (narrowed like the rows) indexes them as it is. One group over the whole
input (group_size -1) is likewise whole on every rank.

The matmul: `pagoda/kernels/int4_gemm.py` on CUDA (a GEMV at few rows, a dequantizing `tl.dot`
GEMM above), `int4_matmul_reference` elsewhere (the dequantized weight, then F.linear).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagoda.distributed import parallel_state
from pagoda.kernels import dispatch
from pagoda.layers.linear import Linear, ParamLayout, RowParallelLinear, with_layout
from pagoda.layers.quantization.int4_formats import awq_to_internal, gptq_to_internal, int4_matmul_reference

if TYPE_CHECKING:  # the config is built above the models; here only its fields are read
    from pagoda.config.quantization import QuantConfig

PACK = 8  # 4-bit values per int32


class Int4LinearMethod:
    """AWQ (config.method "awq") or GPTQ ("gptq") for one linear layer."""

    def __init__(self, config: QuantConfig):
        self.config = config

    def _groups(self, layer: Linear) -> tuple[int, int, bool]:
        """(group size in rows, groups this rank holds, whether they are split with the input rows)."""
        k = layer.input_size
        split = isinstance(layer, RowParallelLinear) and parallel_state.tp_world_size() > 1
        full_k = layer.full_input_size if isinstance(layer, RowParallelLinear) else k
        group = self.config.group_size if self.config.group_size > 0 else full_k
        if full_k % group:
            raise ValueError(f"input size {full_k} is not a multiple of the group size {group}")
        whole = not split or self.config.group_size <= 0 or self.config.desc_act
        if not whole and k % group:
            raise ValueError(
                f"a rank's {k} input rows are not whole groups of {group}; use a lower tensor_parallel_size"
            )
        return group, (full_k // group if whole else k // group), not whole

    def create_weights(self, layer: Linear, dtype: torch.dtype, device: torch.device) -> None:
        n, k = layer.output_size, layer.input_size
        if n % PACK or k % PACK:
            raise ValueError(f"a {k} → {n} projection cannot hold 4-bit weights packed by {PACK} (per rank)")
        group, groups, split = self._groups(layer)
        group_input = (0, group) if split else None

        def param(shape: tuple[int, int] | tuple[int], dt: torch.dtype, layout: ParamLayout) -> nn.Parameter:
            return with_layout(nn.Parameter(torch.empty(shape, dtype=dt, device=device), requires_grad=False), layout)

        del layer.weight
        if self.config.method == "awq":
            layer.qweight = param((k, n // PACK), torch.int32, ParamLayout(output=(1, PACK), input=(0, 1)))
        else:
            layer.qweight = param((k // PACK, n), torch.int32, ParamLayout(output=(1, 1), input=(0, PACK)))
            g_idx = param((k,), torch.int32, ParamLayout(output=None, input=(0, 1)))
            g_idx.optional = True  # type: ignore[attr-defined]  # some exports omit it: rows in order then
            g_idx.data.copy_(torch.arange(k, device=device) // group)
            layer.g_idx = g_idx
        layer.qzeros = param((groups, n // PACK), torch.int32, ParamLayout(output=(1, PACK), input=group_input))
        layer.scales = param((groups, n), torch.float32, ParamLayout(output=(1, 1), input=group_input))
        layer.int4_dtype = dtype

    def process_after_loading(self, layer: Linear) -> None:
        group, _, _ = self._groups(layer)
        if self.config.method == "awq":
            qweight, scales, zeros, g_idx = awq_to_internal(
                layer.qweight.data, layer.qzeros.data, layer.scales.data, group
            )
        else:
            stored_g_idx = layer.g_idx.data if self.config.desc_act else None  # else: rows in order, locally
            qweight, scales, zeros, g_idx = gptq_to_internal(
                layer.qweight.data,
                layer.qzeros.data,
                layer.scales.data,
                stored_g_idx,
                bits=4,
                sym=self.config.sym,
                checkpoint_format=self.config.checkpoint_format,
                group_size=group,
            )
            del layer.g_idx
        for name in ("qweight", "qzeros", "scales"):
            delattr(layer, name)
        dtype = layer.int4_dtype
        layer.qweight = nn.Parameter(qweight.contiguous(), requires_grad=False)
        layer.scales = nn.Parameter(scales.to(dtype).contiguous(), requires_grad=False)
        layer.zeros = nn.Parameter(zeros.to(dtype).contiguous(), requires_grad=False)
        layer.g_idx = nn.Parameter(g_idx.to(torch.int32).contiguous(), requires_grad=False)
        # Rows in order (not act-order): the kernel computes each row's group, no g_idx load. A group
        # at least this rank's K (group -1, or a whole group held by each rank) is one group.
        layer.int4_group = None if self.config.desc_act else min(group, layer.input_size)

    def gemv_operands(self, layer: Linear) -> None:
        return None  # packed int4: its own kernels (`int4_gemm`), not the fp8/bf16 GEMV

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        args = (layer.qweight, layer.scales, layer.zeros, layer.g_idx)
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        kernels = dispatch.int4_gemm_module() if x.is_cuda else None
        if kernels is not None and kernels.supports(x2, layer.qweight):
            x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
            y = kernels.int4_matmul(x2, *args, bias=bias, group_size=layer.int4_group)
        else:
            y = int4_matmul_reference(x2, *args, bias=bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])
