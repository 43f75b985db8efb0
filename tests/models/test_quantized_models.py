"""Quantized weights end to end on CPU: the engine's logits against transformers running the same
quantized function, written here from the formats' definitions (float32 model, tiny random Llama).

- fp8 at load (`--quantization fp8`): each projection's rows scaled to e4m3's ±448, activations of a
  multi-row step quantized per token. The reference replaces each HF projection by that function.
- FP8 checkpoints as `quant_method: fp8` (a scale per tensor) and compressed-tensors (per channel)
  write them: the reference dequantizes the stored tensors.
- AWQ and GPTQ int4 checkpoints written from the model's weights: the reference runs the
  dequantized weights (`dequantize_*_checkpoint`, unpacked element by element from the checkpoint).
What the formats cost in accuracy is measured on real weights instead (this random model's large
initialization amplifies any perturbation): benchmarks/quantization_accuracy.py.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from benchmarks.quantization_accuracy import write_int4_checkpoint
from pagoda import LLM
from pagoda.layers.quantization.int4_formats import dequantize_awq_checkpoint, dequantize_gptq_checkpoint
from tests.models.test_llama_parity import PROMPTS, _hf_model, _our_prefill_logits
from tests.unit.test_quantization_config import with_quantization_config

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0


def _e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3 and widened back (times scale)."""
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


class _Fp8Reference(nn.Module):
    """y = e4m3(x per token) · W_deqᵀ (+ b); x kept as it is for one-row inputs (the GEMV path)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        if x2.shape[0] > 1:
            x2 = _e4m3(x2, (x2.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(1e-12))
        y = x2 @ self.weight.T + (0 if self.bias is None else self.bias)
        return y.reshape(*x.shape[:-1], -1)


def _reference(folder: str, weights: dict[str, torch.Tensor], quantize_input: bool):
    """transformers' model from `folder` with each projection's weight replaced by weights[name]."""
    hf = _hf_model(folder)
    for name, module in list(hf.named_modules()):
        for proj in PROJECTIONS:
            child = getattr(module, proj, None)
            if isinstance(child, nn.Linear):
                w = weights[f"{name}.{proj}.weight"].float()
                new = _Fp8Reference(w, child.bias) if quantize_input else None
                if new is None:
                    child.weight.data.copy_(w)
                else:
                    setattr(module, proj, new)
    return hf


def _load(folder: str, **kwargs) -> LLM:
    return LLM(
        model=folder, skip_tokenizer_init=True, num_gpu_blocks_override=64, max_model_len=256, dtype="float32", **kwargs
    )


# On CPU the engine computes exactly the reference's function (float32, one summation order apart).
# On a GPU, attention and matmuls sum in other orders; an activation a hair from an e4m3 rounding
# boundary then rounds the other way, and this random model (initializer_range 0.3) amplifies such
# a flip to ~0.5 in the logits. A wrong scale or layout moves them by ~10.
EXACT = 1e-4 if not torch.cuda.is_available() else 2.0


def _prefill_close(llm: LLM, hf, atol: float = EXACT) -> float:
    """Max |ours - reference| over PROMPTS (asserted ≤ atol); returns it."""
    worst = 0.0
    for prompt in PROMPTS:
        ours = _our_prefill_logits(llm, prompt)
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt])).logits[0]
        worst = max(worst, (ours - ref).abs().max().item())
    assert worst <= atol
    return worst


def _projection_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [n[: -len(".weight")] for n in tensors if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]


def test_fp8_at_load_matches_the_quantized_reference(tiny_llama):
    tensors = load_file(os.path.join(tiny_llama, "model.safetensors"))
    deq = {}
    for prefix in _projection_names(tensors):
        w = tensors[f"{prefix}.weight"].float()
        deq[f"{prefix}.weight"] = _e4m3(w, (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(1e-12))
    llm = _load(tiny_llama, quantization="fp8")
    _prefill_close(llm, _reference(tiny_llama, deq, quantize_input=True))


@pytest.mark.parametrize("layout", ["fp8-tensor", "compressed-tensors-channel"])
def test_fp8_checkpoints_load_as_written(tiny_llama, tmp_path, layout):
    folder = shutil.copytree(tiny_llama, str(tmp_path / "fp8"))
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    deq = {}
    for prefix in _projection_names(tensors):
        w = tensors[f"{prefix}.weight"].float()
        per_channel = layout.endswith("channel")
        scale = (w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()) / E4M3_MAX
        tensors[f"{prefix}.weight"] = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        tensors[f"{prefix}.weight_scale"] = scale.reshape(-1, 1) if per_channel else scale.reshape(())
        tensors[f"{prefix}.input_scale"] = torch.tensor(0.02)  # static activation scale: not used
        deq[f"{prefix}.weight"] = tensors[f"{prefix}.weight"].float() * scale
    for layer in range(2):  # KV-cache scales as llm-compressor writes them: read, not a projection
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(1.0)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(1.0)
    save_file(tensors, path, metadata={"format": "pt"})
    if layout == "fp8-tensor":
        with_quantization_config(folder, {"quant_method": "fp8", "activation_scheme": "dynamic"})
    else:
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
        with_quantization_config(
            folder,
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
                "ignore": ["lm_head"],
            },
        )
    _prefill_close(_load(folder), _reference(tiny_llama, deq, quantize_input=True))


@pytest.mark.parametrize("method", ["awq", "gptq"])  # gptq: act-order (g_idx permutes the groups), symmetric
def test_int4_checkpoints_match_their_dequantized_weights(tiny_llama, tmp_path, method):
    group = 32  # hidden 64 and intermediate 128: 2 and 4 groups along the input
    folder = write_int4_checkpoint(tiny_llama, method, group, str(tmp_path / method))
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    deq = {}
    for name in tensors:
        if name.endswith(".qweight"):
            prefix = name[: -len(".qweight")]
            q, z, sc = tensors[name], tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"]
            if method == "awq":
                deq[f"{prefix}.weight"] = dequantize_awq_checkpoint(q, z, sc, group)
            else:
                deq[f"{prefix}.weight"] = dequantize_gptq_checkpoint(
                    q, z, sc, tensors[f"{prefix}.g_idx"], group_size=group
                )
    assert len(deq) == 2 * len(PROJECTIONS)
    _prefill_close(_load(folder), _reference(tiny_llama, deq, quantize_input=False))
