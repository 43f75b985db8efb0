"""FP8 (e4m3) weights with a scale per output channel: W[n, :] ≈ Wq[n, :] · s_w[n].

Why: decode is bound by the bytes it reads, and an fp8 weight is half a bf16 one. From a bf16/fp16
checkpoint (`--quantization fp8`) each output row is scaled so its largest magnitude lands on e4m3's
448 at load; an FP8 checkpoint's weights load as they are, its per-tensor (one per fused part) or
per-channel scales widened to one per output row. The scales stay in float32.

The matmul, by rows of x (tokens in the step):
- at most `policy.FP8_GEMV_MAX_ROWS` rows (decode at small batch): the activations stay in the model dtype and the
  fp8 weight is widened inside the few-row GEMV (`pagoda/kernels/gemv.py`, its scale applied to the
  fp32 sum): "W8A16", one pass over half the bytes;
- more rows: x is quantized per token to e4m3 (a scale per row, `pagoda/kernels/fp8_quant.py`),
  multiplied on the fp8 tensor cores by `torch._scaled_mm` with unit scales (cuBLASLt's kernel; the
  one for scale vectors is slower than bf16 on these shapes), and both scale vectors and the bias are
  applied to the bf16 product in one epilogue: "W8A8" with dynamic per-token activation scales. A
  checkpoint's static `input_scale` is not used (per token is at least as exact; the entries are
  skipped at load).
On the CPU (and wherever those kernels do not apply) `fp8_linear_reference` computes the same
function in float32: the quantized values, widened, times their scales.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import dispatch, policy
from pagoda.layers.linear import Linear, MergedColumnParallelLinear, ParamLayout, with_layout

if TYPE_CHECKING:  # the config is built above the models; here only its fields are read
    from pagoda.config.quantization import QuantConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row or channel: any scale reproduces it; avoid dividing by zero


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → (e4m3 [N, K], float32 scales [N]) with w ≈ q · s per row; each row's max → ±448."""
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (e4m3 [M, K], float32 scales [M, 1]): the reference of `fp8_quant.per_token_quant`."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear_reference(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, quantize_input: bool
) -> torch.Tensor:
    """y [..., N] in x's dtype: x (quantized per token when quantize_input) times dequantized w, in float32."""
    x2 = x.reshape(-1, x.shape[-1])
    if quantize_input:
        xq, x_scale = quantize_per_token_reference(x2)
        xf = xq.float() * x_scale
    else:
        xf = x2.float()
    y = F.linear(xf, wq.float() * w_scale.float()[:, None], None if bias is None else bias.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], wq.shape[0])


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1.0 on `device`, made once (a fresh tensor per call would be a copy in every graph)."""
    one = _UNIT_SCALES.get(device)
    if one is None:
        one = _UNIT_SCALES[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, wq · w_scale, bias) by the rules in the module docstring. x [..., K], wq [N, K] e4m3,
    w_scale [N] float32, bias [N] (x's dtype) → [..., N] in x's dtype."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if x.is_cuda:
        if rows <= policy.FP8_GEMV_MAX_ROWS:  # CPU and GPU alike: the CPU tests compute what the GPU does
            gemv = dispatch.gemv_module()
            if gemv is not None and gemv.supports(x, wq, max_rows=policy.FP8_GEMV_MAX_ROWS, weight_scale=w_scale):
                return gemv.gemv(x, wq, bias, weight_scale=w_scale)
        else:
            quant = dispatch.fp8_quant_module()
            if quant is not None and quant.supports(x) and wq.shape[0] % 16 == 0 and k % 16 == 0:
                x2 = x.reshape(-1, k)
                xq, x_scale = quant.per_token_quant(x2 if x2.stride(1) == 1 else x2.contiguous())
                one = _unit_scale(x.device)
                y = torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=x.dtype)
                quant.scale_epilogue(y, x_scale, w_scale, bias)
                return y.reshape(*x.shape[:-1], wq.shape[0])
    return fp8_linear_reference(x, wq, w_scale, bias, quantize_input=rows > policy.FP8_GEMV_MAX_ROWS)


class Fp8LinearMethod:
    """Parameters: `weight` [N, K] (the model dtype while loading a bf16 checkpoint, e4m3 for an FP8
    one; e4m3 after `process_after_loading`), `weight_scale` float32 [N] after loading."""

    def __init__(self, config: QuantConfig):
        self.config = config

    def create_weights(self, layer: Linear, dtype: torch.dtype, device: torch.device) -> None:
        n, k = layer.output_size, layer.input_size
        if not self.config.serialized:
            return  # the model-dtype weight loads as usual and is quantized after loading
        layer.weight = nn.Parameter(torch.empty(n, k, dtype=FP8, device=device), requires_grad=False)
        if self.config.fp8_weight_strategy == "channel":
            scale = torch.empty(n, 1, dtype=torch.float32, device=device)  # compressed-tensors writes [N, 1]
            layer.weight_scale = with_layout(nn.Parameter(scale, requires_grad=False), ParamLayout(input=None))
        else:
            parts = len(layer.output_sizes) if isinstance(layer, MergedColumnParallelLinear) else 1
            scale = torch.empty(parts, dtype=torch.float32, device=device)
            layout = ParamLayout(output=None, input=None, per_part=parts > 1)
            layer.weight_scale = with_layout(nn.Parameter(scale, requires_grad=False), layout)

    def process_after_loading(self, layer: Linear) -> None:
        weight = layer.weight.data
        if not self.config.serialized:
            wq, scale = quantize_per_channel(weight)
        else:
            wq, stored = weight, layer.weight_scale.data.float()
            if self.config.fp8_weight_strategy == "channel":
                scale = stored.reshape(-1)
            else:  # a scale per fused part: one per output row of that part
                sizes = layer.output_sizes if isinstance(layer, MergedColumnParallelLinear) else [layer.output_size]
                scale = torch.repeat_interleave(stored.reshape(-1), torch.tensor(sizes, device=stored.device))
        layer.weight = nn.Parameter(wq.contiguous(), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale.contiguous(), requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def gemv_operands(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.weight, layer.weight_scale
