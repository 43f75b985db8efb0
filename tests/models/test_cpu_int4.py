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


def _k_quant_blocks(rows: int, cols: int, bits: int = 4, seed: int = 0) -> torch.Tensor:
    """A [rows, cols] weight stored as Q4_K (bits 4) or Q5_K (bits 5) super-blocks written here byte by byte (the
    `gguf` package reads them but has no K-quant quantizer), dequantized by gguf. Like llama.cpp's quantizer, each
    32-value group uses only part of its levels (they need not reach 0 or the top) and a group of positive values
    has no minimum (mn = 0)."""
    rng = np.random.default_rng(seed)
    n, top = rows * cols // 256, 2**bits - 1
    d = rng.uniform(1e-4, 3e-3, n).astype(np.float16)
    dmin = rng.uniform(1e-4, 3e-3, n).astype(np.float16)
    sc = rng.integers(1, 64, (n, 8)).astype(np.uint8)
    mn = rng.integers(0, 64, (n, 8)).astype(np.uint8)
    mn[:, 0] = 0
    low = rng.integers(0, top // 3, (n, 8, 1))
    high = low + rng.integers(3, top + 1 - low)  # at least four levels apart, never past the top
    q = rng.integers(low, high + 1, (n, 8, 32)).astype(np.uint8)
    scales = np.empty((n, 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    nibbles = q & 15
    qs = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).reshape(n, 128)  # 32 bytes per pair of groups: low first
    parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales]
    if bits == 5:  # the fifth bits: byte i holds value i of group j in bit j
        parts.append(sum(((q[:, j] >> 4) & 1) << j for j in range(8)).astype(np.uint8))
    qtype = GGMLQuantizationType.Q4_K if bits == 4 else GGMLQuantizationType.Q5_K
    blocks = np.concatenate([*parts, qs], -1)
    weight = dequantize(blocks.reshape(rows, -1), qtype)
    return torch.from_numpy(weight.reshape(rows, cols).copy())


def test_q4_k_groups_come_back_to_float32_rounding():
    weight = _k_quant_blocks(64, 512)
    grid = cpu_int4.find_int4_grid(weight)
    assert grid is not None
    q, d, m = grid
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    blocks = (_rebuilt(q, d, m) - weight).abs().reshape(64, -1, cpu_int4.GROUP)
    scale = weight.abs().reshape(64, -1, cpu_int4.GROUP).amax(-1, keepdim=True)
    assert bool((blocks <= 4 * torch.finfo(torch.float32).eps * scale).all())
    # Q4_1's reading alone (levels from the minimum, d = span / 15) does not give these groups back.
    w = weight.reshape(64, -1, cpu_int4.GROUP)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    assert not bool(cpu_int4._levels(w, (high - low) / 15, low)[1].all())


@pytest.mark.parametrize("rows", [1, policy.CPU_INT4_MAX_ROWS + 1])
def test_a_q4_k_layer_multiplies_like_its_float_weight(rows):
    weight = _k_quant_blocks(192, 512, seed=rows)
    layer = _linear(weight)
    x = torch.randn(rows, 512)
    expected = F.linear(x, weight)  # float32, over gguf's own dequantization
    assert cpu_int4.pack_int4_layers(torch.nn.Sequential(layer)) == (1, 0, 0)
    got = layer(x)
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q6_K, GGMLQuantizationType.F32])
def test_weights_on_no_grid_stay_float(qtype):
    if qtype == GGMLQuantizationType.F32:
        weight = torch.randn(64, 256)
    else:  # gguf has no Q6_K quantizer: random bytes with finite scales are valid Q6_K blocks
        blocks = np.random.default_rng(0).integers(0, 256, (64, 210), dtype=np.uint8)
        blocks[:, 208:] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
        weight = torch.from_numpy(dequantize(blocks, qtype).reshape(64, 256).copy())
    assert cpu_int4.find_int4_grid(weight) is None and cpu_int4.find_wide_grid(weight) is None
    layer = torch.nn.Sequential(_linear(weight))
    assert cpu_int4.pack_int4_layers(layer) == (0, 0, 1) and layer[0].quant is None


WIDE = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q5_K]
WIDE_SHAPES = [(1, 192), (policy.CPU_INT4_MAX_ROWS, 96), (policy.CPU_INT4_MAX_ROWS + 1, 192)]


@pytest.mark.parametrize("qtype", WIDE)
def test_wider_levels_come_back_to_float32_rounding(qtype):
    if qtype == GGMLQuantizationType.Q5_K:
        weight = _k_quant_blocks(64, 512, bits=5)
    else:
        weight = _gguf_blocks(64, 512, qtype)
    assert cpu_int4.find_int4_grid(weight) is None  # more than 16 levels
    q, d, m = cpu_int4.find_wide_grid(weight)
    assert q.dtype == torch.uint8
    rebuilt = (q.float().reshape(64, -1, cpu_int4.GROUP) * d[..., None] + m[..., None]).reshape(64, -1)
    blocks = (rebuilt - weight).abs().reshape(64, -1, cpu_int4.GROUP)
    scale = weight.abs().reshape(64, -1, cpu_int4.GROUP).amax(-1, keepdim=True)
    assert bool((blocks <= 4 * torch.finfo(torch.float32).eps * scale).all())


@pytest.mark.parametrize("qtype", WIDE)
@pytest.mark.parametrize("rows, outputs", WIDE_SHAPES)
def test_a_layer_of_wider_levels_multiplies_like_its_float_weight(qtype, rows, outputs):
    if qtype == GGMLQuantizationType.Q5_K:
        weight = _k_quant_blocks(outputs, 512, bits=5, seed=rows)[:, :320]
    else:
        weight = _gguf_blocks(outputs, 320, qtype, seed=rows)
    layer = _linear(weight, bias=True)
    x = torch.randn(rows, 320)
    expected = F.linear(x, weight, layer.bias)  # float32, over gguf's own dequantization
    assert cpu_int4.pack_int4_layers(torch.nn.Sequential(layer)) == (0, 1, 0)
    assert isinstance(layer.quant, cpu_int4.CpuWideMethod) and getattr(layer, "weight", None) is None
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()  # bf16 activations and scales
    # The two nibble layers hold the levels exactly: q·d + m rebuilt from them in float32 and rounded once is
    # within bf16's rounding of each weight (the many-row path's weight).
    rebuilt = layer.quant.dequantized_t().float().t()
    assert bool(((rebuilt - weight).abs() <= 2**-8 * weight.abs() + 1e-7).all())


def _linear(weight: torch.Tensor, bias: bool = False):
    from pagoda.layers.linear import Linear

    layer = Linear(weight.shape[1], weight.shape[0], bias=bias)
    layer.weight.data.copy_(weight)
    if bias:
        layer.bias.data.normal_()
    return layer


# 192 outputs: whole blocks of the int4 kernel's 64 columns; 96 and 80: a narrower last block.
SHAPES = [(1, 192), (7, 192), (policy.CPU_INT4_MAX_ROWS, 192), (policy.CPU_INT4_MAX_ROWS + 1, 192), (300, 192)]


@pytest.mark.parametrize("rows, outputs", [*SHAPES, (300, 96), (65, 80)])
def test_both_matmul_paths_equal_the_float_matmul(rows, outputs):
    weight = _gguf_blocks(outputs, 320, GGMLQuantizationType.Q4_1, seed=rows)
    layer = _linear(weight, bias=True)
    x = torch.randn(rows, 320)
    expected = F.linear(x, weight, layer.bias)  # float32, over gguf's own dequantization
    assert cpu_int4.pack_int4_layers(torch.nn.Sequential(layer)) == (1, 0, 0)
    assert not hasattr(layer, "weight") or layer.weight is None
    assert layer.quant.nibbles is None  # the many-row path reads the kernel's own packed levels
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # bf16 activations and scales: within bf16's rounding of the output scale, not exact.
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()
    reference = cpu_int4.int4_reference(x, *cpu_int4.find_int4_grid(weight), layer.bias)
    assert torch.allclose(reference, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("outputs", [192, 80])
def test_many_row_weight_is_the_levels_rebuilt_in_the_prefill_dtype(outputs, monkeypatch):
    """The many-row path's Wᵀ, unpacked from the kernel's packing and from the plain two-to-a-byte copy a torch
    with another packing keeps instead, against the weight rebuilt from the grid in float32 and then rounded
    once: q·d + m in float32 from d and m in the prefill dtype."""
    weight = _gguf_blocks(outputs, 320, GGMLQuantizationType.Q4_1, seed=outputs)
    q, d, m = cpu_int4.find_int4_grid(weight)
    for bf16 in (True, False):
        monkeypatch.setattr(cpu_int4, "native_bf16", lambda bf16=bf16: bf16)
        method = cpu_int4.CpuInt4Method(q, d, m)
        assert method.nibbles is None  # this torch's packing is the one `_unpack_levels_t` reads
        dtype = method.prefill_dtype
        expected = _rebuilt(q, d.to(dtype).float(), m.to(dtype).float()).to(dtype).t()
        assert torch.equal(method.dequantized_t(), expected)
        method.nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        assert torch.equal(method.dequantized_t(), expected)


@pytest.mark.parametrize("rows", [1, policy.CPU_INT8_HEAD_MAX_ROWS, policy.CPU_INT8_HEAD_MAX_ROWS + 1, 33])
def test_bf16_lm_head_is_within_bf16_rounding_of_the_float_head(rows, monkeypatch):
    """Up to policy.CPU_INT8_HEAD_MAX_ROWS rows the head's int8 copy multiplies, above it the bf16 copy: both
    within their rounding of the float head, and the largest logits the float head's own."""
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


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.F32])
def test_q8_0_embedding_rows_come_back_exactly(qtype):
    from pagoda.layers.vocab_parallel import VocabParallelEmbedding

    weight = _gguf_blocks(300, 96, qtype) if qtype != GGMLQuantizationType.F32 else torch.randn(300, 96)
    embedding = VocabParallelEmbedding(300, 96)
    embedding.weight.data = weight.clone()
    ids = torch.tensor([[0, 299, 5], [17, 17, 150]])
    expected = F.embedding(ids, weight)
    grid = cpu_int4.find_int8_grid(weight, chunk=64)  # several chunks
    if qtype != GGMLQuantizationType.Q8_0:
        assert grid is None and cpu_int4.int8_embeddings(torch.nn.Sequential(embedding)) == 0
        return
    assert grid is not None and grid[0].dtype == torch.int8
    assert cpu_int4.int8_embeddings(torch.nn.Sequential(embedding)) == 1
    assert not hasattr(embedding, "weight")
    assert torch.equal(embedding(ids), expected)  # bit for bit gguf's dequantization


@pytest.mark.parametrize("bf16_head", [True, False])
def test_tied_q8_0_embedding_drops_its_float_matrix_only_beside_the_bf16_head(bf16_head, monkeypatch):
    from pagoda.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

    monkeypatch.setattr(cpu_int4, "native_bf16", lambda: bf16_head)
    embedding, head = VocabParallelEmbedding(1000, 64), ParallelLMHead(1000, 64)
    embedding.weight.data = _gguf_blocks(1000, 64, GGMLQuantizationType.Q8_0, seed=3)
    head.weight = embedding.weight  # tied
    model = torch.nn.ModuleDict({"embed": embedding, "head": head})
    hidden = torch.randn(5, 64)
    float_head = F.linear(hidden, embedding.weight)
    assert cpu_int4.bf16_lm_heads(model) == int(bf16_head)
    before = head(hidden)
    assert cpu_int4.int8_embeddings(model) == int(bf16_head)
    assert hasattr(head, "weight") != bf16_head  # a float32 head still multiplies by the float matrix
    after = head(hidden)
    assert torch.equal(after, before)  # the exact top logits come from the int8 rows, bit for bit
    best = float_head.argmax(-1, keepdim=True)
    assert torch.equal(after.gather(-1, best), before.gather(-1, best))


def test_embedded_model_keeps_its_greedy_tokens_with_4bit_layers(default_llm, monkeypatch, caplog):
    from pagoda import SamplingParams
    from tests.conftest import build_default_llm

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "Water boils at"]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1)
    layers = default_llm.llm_engine.runner.model.model.layers
    assert isinstance(layers[0].mlp.down_proj.quant, cpu_int4.CpuInt4Method)  # the default is 4-bit
    head = default_llm.llm_engine.runner.model.lm_head
    assert isinstance(head.quant, cpu_int4.Bf16LMHead) == cpu_int4.native_bf16()  # and so is the bf16 head
    embedding = default_llm.llm_engine.runner.model.model.embed_tokens
    assert isinstance(embedding.rows, cpu_int4.Int8Rows) == cpu_int4.native_bf16()  # its Q8_0 levels beside it
    fast = default_llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv("PAGODA_CPU_INT4", "0")
    reference = build_default_llm().generate(prompts, params, use_tqdm=False)
    for got, want in zip(fast, reference, strict=True):
        got, want = got.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids, (got.text, want.text)
        gaps = [abs(a[t].logprob - b[t].logprob) for a, b, t in zip(got.logprobs, want.logprobs, got.token_ids)]
        assert max(gaps) < 0.15  # bf16 activations in the 4-bit matmuls; measured up to ~0.07
