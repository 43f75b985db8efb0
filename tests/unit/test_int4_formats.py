"""AWQ and GPTQ checkpoints into Pagoda's int4 layout (`pagoda/layers/quantization/int4_formats.py`).

Each checkpoint is built by the module's quantizers, then read two ways: directly from the checkpoint
layout, one element per word and nibble (`dequantize_*_checkpoint`), and through the conversion
(`*_to_internal`, then `dequantize`). The two must agree exactly, and both must be within half a
quantization step of the weight quantized. The AWQ interleaving and GPTQ's v1 zero-point offset are also
checked on words packed by hand here, so a layout both sides got wrong the same way still fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.layers.quantization.int4_formats import (
    AWQ_PACK_ORDER,
    awq_to_internal,
    dequantize,
    dequantize_awq_checkpoint,
    dequantize_gptq_checkpoint,
    gptq_to_internal,
    int4_matmul_reference,
    quantize_awq,
    quantize_gptq,
)

N, K = 24, 128


def weight(seed: int = 0, n: int = N, k: int = K) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def assert_within_half_a_step(w_hat: torch.Tensor, w: torch.Tensor, step: torch.Tensor) -> None:
    """|w_hat − w| ≤ step / 2 per element (step: each element's scale), with fp32 rounding slack."""
    excess = (w_hat - w).abs() - step / 2 * (1 + 1e-5)
    assert float(excess.max()) <= 1e-6, float(excess.max())


def word(nibbles: list[int]) -> int:
    """Python ints packed as nibble i = nibbles[i], as the signed int32 a checkpoint holds."""
    value = sum(v << (4 * i) for i, v in enumerate(nibbles))
    return value - 2**32 if value >= 2**31 else value


def internal_values(qweight: torch.Tensor) -> list[list[int]]:
    """Pagoda's qweight [K/8, N] read back as q [K][N], nibble j of word [r, n] = q[8r + j][n]."""
    words = qweight.tolist()
    return [[(words[k // 8][n] >> (4 * (k % 8))) & 15 for n in range(len(words[0]))] for k in range(8 * len(words))]


@pytest.mark.parametrize("group", [32, -1])
def test_awq_round_trip(group):
    w = weight(1)
    qweight, qzeros, scales = quantize_awq(w, group)
    groups = 1 if group == -1 else K // group
    assert qweight.shape == (K, N // 8) and qweight.dtype == torch.int32
    assert qzeros.shape == (groups, N // 8) and qzeros.dtype == torch.int32
    assert scales.shape == (groups, N) and scales.dtype == torch.float16
    w_hat = dequantize_awq_checkpoint(qweight, qzeros, scales, group)
    rows = torch.arange(K) // (K if group == -1 else group)
    assert_within_half_a_step(w_hat, w, scales.float()[rows].t())

    internal = awq_to_internal(qweight, qzeros, scales, group)
    q, s, z, g_idx = internal
    assert q.shape == (K // 8, N) and q.dtype == torch.int32
    assert s is scales and z.shape == (groups, N) and g_idx.dtype == torch.int32
    assert torch.equal(g_idx, rows.to(torch.int32))
    assert torch.equal(dequantize(*internal), w_hat)


@pytest.mark.parametrize("group", [32, -1])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_round_trip(group, sym, act_order, checkpoint_format):
    w = weight(2)
    qweight, qzeros, scales, g_idx = quantize_gptq(
        w, group, sym=sym, act_order=act_order, checkpoint_format=checkpoint_format, seed=5
    )
    groups = 1 if group == -1 else K // group
    assert qweight.shape == (K // 8, N) and qzeros.shape == (groups, N // 8) and scales.shape == (groups, N)
    assert g_idx.shape == (K,) and g_idx.dtype == torch.int32
    assert torch.equal(torch.bincount(g_idx, minlength=groups), torch.full((groups,), K // groups))
    in_order = torch.equal(g_idx, (torch.arange(K) // (K // groups)).to(torch.int32))
    assert in_order == (not act_order or groups == 1)
    stored_g_idx = g_idx if act_order else None  # exports in row order may omit g_idx
    w_hat = dequantize_gptq_checkpoint(
        qweight, qzeros, scales, stored_g_idx, group_size=group, checkpoint_format=checkpoint_format
    )
    assert_within_half_a_step(w_hat, w, scales.float()[g_idx.long()].t())

    internal = gptq_to_internal(
        qweight, qzeros, scales, stored_g_idx, bits=4, sym=sym, checkpoint_format=checkpoint_format, group_size=group
    )
    assert torch.equal(internal[0], qweight)  # GPTQ packs along K already
    assert torch.equal(internal[3], g_idx)
    if sym:
        assert torch.equal(internal[2], torch.full((groups, N), 8.0))
    assert torch.equal(dequantize(*internal), w_hat)


def test_awq_words_packed_by_hand():
    """Columns 0..7 holding 0..7 pack to 0x75316420 in AutoAWQ's order (nibble i: column
    AWQ_PACK_ORDER[i]); a full 8x16 example with nibble values ≥ 8 (negative words) comes back exact.
    (The quantizer's packing is checked through `test_awq_round_trip`: the direct reader checked here
    must read it back.)"""
    assert AWQ_PACK_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    assert word([c for c in AWQ_PACK_ORDER]) == 0x75316420

    k, n = 8, 16
    q = [[(5 * row + 3 * col + 9) % 16 for col in range(n)] for row in range(k)]
    zeros = [[(7 * col + 2) % 16 for col in range(n)]]
    qweight = torch.tensor(
        [[word([q[row][8 * c + AWQ_PACK_ORDER[i]] for i in range(8)]) for c in range(n // 8)] for row in range(k)],
        dtype=torch.int32,
    )
    qzeros = torch.tensor([[word([zeros[0][8 * c + AWQ_PACK_ORDER[i]] for i in range(8)]) for c in range(n // 8)]])
    qzeros = qzeros.to(torch.int32)
    scales = torch.linspace(0.5, 2.0, n).half()[None, :]
    assert bool((qweight < 0).any())  # the sign bit is a nibble like the others
    internal_q, _, internal_zeros, g_idx = awq_to_internal(qweight, qzeros, scales, -1)
    assert internal_values(internal_q) == q
    assert internal_zeros.tolist() == [[float(z) for z in zeros[0]]]
    expected = (torch.tensor(q).float() - torch.tensor(zeros).float()) * scales.float()
    assert torch.equal(dequantize_awq_checkpoint(qweight, qzeros, scales, -1), expected.t())
    assert torch.equal(dequantize(internal_q, scales, internal_zeros, g_idx), expected.t())


def test_gptq_words_packed_by_hand_and_the_v1_zero_offset():
    """qweight nibble j of word r is row 8r + j; qzeros plain order, v1 storing zero − 1."""
    k, n = 16, 8
    q = [[(3 * row + 5 * col) % 16 for col in range(n)] for row in range(k)]
    qweight = torch.tensor([[word([q[8 * r + j][col] for j in range(8)]) for col in range(n)] for r in range(2)])
    qweight = qweight.to(torch.int32)
    zeros = [2, 15, 8, 1, 9, 16, 4, 11]  # v1 can hold 16 (stored 15), not 0
    scales = torch.full((1, n), 0.25, dtype=torch.float16)
    for checkpoint_format, stored in (("gptq", [z - 1 for z in zeros]), ("gptq_v2", [z % 16 for z in zeros])):
        qzeros = torch.tensor([[word(stored)]], dtype=torch.int32)
        out = gptq_to_internal(
            qweight, qzeros, scales, None, bits=4, sym=False, checkpoint_format=checkpoint_format, group_size=-1
        )
        assert internal_values(out[0]) == q
        assert out[2].tolist() == [[float(z if checkpoint_format == "gptq" else z % 16) for z in zeros]]
        assert torch.equal(out[3], torch.zeros(k, dtype=torch.int32))
        checkpoint = dequantize_gptq_checkpoint(
            qweight, qzeros, scales, None, group_size=-1, checkpoint_format=checkpoint_format
        )
        assert torch.equal(dequantize(*out), checkpoint)


def test_gptq_v1_has_no_zero_point_0_so_such_a_group_moves_to_1():
    """A group of non-negative weights would get zero point 0, which v1 cannot store; the quantizer
    moves its grid, and the weights still come back within half a step. v2 keeps the 0."""
    w = weight(3).abs()
    for checkpoint_format in ("gptq", "gptq_v2"):
        qweight, qzeros, scales, g_idx = quantize_gptq(w, 32, sym=False, checkpoint_format=checkpoint_format)
        out = gptq_to_internal(
            qweight, qzeros, scales, None, bits=4, sym=False, checkpoint_format=checkpoint_format, group_size=32
        )
        assert float(out[2].min()) == (1.0 if checkpoint_format == "gptq" else 0.0)
        w_hat = dequantize(*out)
        assert_within_half_a_step(w_hat, w, scales.float()[g_idx.long()].t())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_reference_matmul(dtype):
    """int4_matmul_reference is F.linear on the dequantized weight: exact in float64, and in lower
    precision within the rounding of W and of the result to the dtype."""
    w = weight(4)
    qweight, qzeros, scales, g_idx = quantize_gptq(w, 32, sym=False, act_order=True, seed=1)
    internal = gptq_to_internal(
        qweight, qzeros, scales, g_idx, bits=4, sym=False, checkpoint_format="gptq", group_size=32
    )
    w_hat = dequantize_gptq_checkpoint(qweight, qzeros, scales, g_idx, group_size=32).double()
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    bias = torch.randn(N, dtype=torch.float64)
    exact = F.linear(x, w_hat, bias)
    y = int4_matmul_reference(x.to(dtype), *internal, bias=bias.to(dtype))
    assert y.shape == (5, N) and y.dtype == dtype
    if dtype == torch.float64:
        torch.testing.assert_close(y, exact, rtol=1e-12, atol=1e-12)
    else:
        eps = torch.finfo(dtype).eps
        bound = 4 * eps * (x.abs() @ w_hat.abs().t() + bias.abs()) + 1e-6
        assert bool(((y.double() - F.linear(x.to(dtype).double(), w_hat, bias)).abs() <= bound).all())


def test_rejects_what_it_cannot_convert():
    qweight, qzeros, scales, g_idx = quantize_gptq(weight(), 32)
    with pytest.raises(ValueError, match="4-bit"):
        gptq_to_internal(qweight, qzeros, scales, None, bits=8, sym=True, checkpoint_format="gptq", group_size=32)
    with pytest.raises(ValueError, match="checkpoint_format"):
        gptq_to_internal(qweight, qzeros, scales, None, bits=4, sym=True, checkpoint_format="marlin", group_size=32)
    with pytest.raises(ValueError, match="g_idx"):
        gptq_to_internal(qweight, qzeros, scales, g_idx[:8], bits=4, sym=True, checkpoint_format="gptq", group_size=32)
    with pytest.raises(ValueError, match="groups"):
        gptq_to_internal(qweight, qzeros, scales, None, bits=4, sym=True, checkpoint_format="gptq", group_size=16)
    with pytest.raises(ValueError, match="disagree"):
        awq_to_internal(*quantize_awq(weight(), 32)[:2], scales[:, :8], 32)
    with pytest.raises(ValueError, match="cannot quantize"):
        quantize_awq(weight(k=96), 64)
