"""A GGUF's 4-bit layers kept 4-bit on the CPU (`layers/quantization/cpu_int4.py`), against references:
the `gguf` package's own quantizer and dequantizer for the blocks, a float32 matmul over the weight it
dequantizes for both matmul paths and for the bf16 LM head, and the embedded model loaded with float32
weights (PAGODA_CPU_INT4=0) for greedy tokens and their log-probabilities."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pagoda.kernels import policy
from pagoda.layers.quantization import cpu_int4


def _gguf_blocks(rows: int, cols: int, qtype: GGMLQuantizationType, seed: int = 0) -> torch.Tensor:
    """A [rows, cols] float32 weight as llama.cpp's quantizer stores it in `qtype`, dequantized by gguf."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return torch.from_numpy(dequantize(quantize(w, qtype), qtype).reshape(rows, cols).copy())


def _rebuilt(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.float().reshape(n, -1, cpu_int4.GROUP) * d[..., None] + m[..., None]).reshape(n, k)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_0])
def test_4bit_blocks_come_back_exactly(qtype):
    weight = _gguf_blocks(96, 192, qtype)
    grid = cpu_int4.find_int4_grid(weight)
    assert grid is not None
    q, d, m = grid
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert torch.equal(_rebuilt(q, d, m), weight)  # bit for bit: nothing lost in going back to 4 bits


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.F32])
def test_weights_on_no_4bit_grid_stay_float(qtype):
    weight = _gguf_blocks(64, 128, qtype) if qtype != GGMLQuantizationType.F32 else torch.randn(64, 128)
    assert cpu_int4.find_int4_grid(weight) is None
    layer = torch.nn.Sequential(_linear(weight))
    assert cpu_int4.pack_int4_layers(layer) == (0, 1) and layer[0].quant is None


def _linear(weight: torch.Tensor, bias: bool = False):
    from pagoda.layers.linear import Linear

    layer = Linear(weight.shape[1], weight.shape[0], bias=bias)
    layer.weight.data.copy_(weight)
    if bias:
        layer.bias.data.normal_()
    return layer


@pytest.mark.parametrize("rows", [1, 7, policy.CPU_INT4_MAX_ROWS, policy.CPU_INT4_MAX_ROWS + 1, 300])
def test_both_matmul_paths_equal_the_float_matmul(rows):
    weight = _gguf_blocks(192, 320, GGMLQuantizationType.Q4_1, seed=rows)
    layer = _linear(weight, bias=True)
    x = torch.randn(rows, 320)
    expected = F.linear(x, weight, layer.bias)  # float32, over gguf's own dequantization
    assert cpu_int4.pack_int4_layers(torch.nn.Sequential(layer)) == (1, 0)
    assert not hasattr(layer, "weight") or layer.weight is None
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # bf16 activations and scales: within bf16's rounding of the output scale, not exact.
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()
    reference = cpu_int4.int4_reference(x, *cpu_int4.find_int4_grid(weight), layer.bias)
    assert torch.allclose(reference, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 4, 33])
def test_bf16_lm_head_is_within_bf16_rounding_of_the_float_head(rows, monkeypatch):
    from pagoda.layers.vocab_parallel import ParallelLMHead

    monkeypatch.setattr(cpu_int4, "native_bf16", lambda: True)  # the CPU's bf16 speed is not what is tested
    head = ParallelLMHead(1000, 64)
    head.weight.data = _gguf_blocks(1000, 64, GGMLQuantizationType.Q8_0, seed=rows)
    hidden = torch.randn(rows, 64)
    expected = F.linear(hidden, head.weight)
    assert cpu_int4.bf16_lm_heads(torch.nn.Sequential(head)) == 1
    got = head(hidden)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()  # bf16 weights and activations
    assert not torch.equal(got, expected)  # it is the bf16 copy that multiplied
    best = expected.argmax(-1, keepdim=True)  # the largest logits are the float32 head's own
    assert torch.equal(got.argmax(-1, keepdim=True), best)
    assert torch.allclose(got.gather(-1, best), expected.gather(-1, best), rtol=1e-5, atol=1e-5)
    assert head.weight.dtype == torch.float32  # kept: a tied embedding looks its rows up


def test_embedded_model_keeps_its_greedy_tokens_with_4bit_layers(default_llm, monkeypatch, caplog):
    from pagoda import SamplingParams
    from tests.conftest import build_default_llm

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "Water boils at"]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1)
    layers = default_llm.llm_engine.runner.model.model.layers
    assert isinstance(layers[0].mlp.down_proj.quant, cpu_int4.CpuInt4Method)  # the default is 4-bit
    head = default_llm.llm_engine.runner.model.lm_head
    assert isinstance(head.quant, cpu_int4.Bf16LMHead) == cpu_int4.native_bf16()  # and so is the bf16 head
    fast = default_llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv("PAGODA_CPU_INT4", "0")
    reference = build_default_llm().generate(prompts, params, use_tqdm=False)
    for got, want in zip(fast, reference, strict=True):
        got, want = got.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids, (got.text, want.text)
        gaps = [abs(a[t].logprob - b[t].logprob) for a, b, t in zip(got.logprobs, want.logprobs, got.token_ids)]
        assert max(gaps) < 0.15  # bf16 activations in the 4-bit matmuls; measured up to ~0.07
