"""Fused Triton kernels (RMSNorm, add + RMSNorm, RoPE, SiLU-and-mul) against the layers' PyTorch code,
which is what the CPU runs and what the model goldens pin down.

Bit-exact where the operations are the same: the residual sum, RoPE (three rounded fp32 operations
per output, no FMA), and the bf16/fp16 rounding points. Within an ulp where they cannot be: RMSNorm's
fp32 reduction order, and under the interpreter NumPy's `exp` against PyTorch's (Sleef) on the CPU.
On CPU the kernels run under the Triton interpreter (`conftest.py`), so shapes stay tiny.
"""

from __future__ import annotations

import json
import platform
import sys

import pytest
import torch

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("triton")

from pagoda.kernels import activation as activation_kernels
from pagoda.kernels import dispatch, policy
from pagoda.kernels import localized_filter as lf_kernels
from pagoda.kernels import rms_norm as norm_kernels
from pagoda.kernels import rotary as rotary_kernels
from pagoda.layers.activation import SiluAndMul, quick_gelu_reference, silu_and_mul_reference
from pagoda.layers.norm import RMSNorm, rms_norm_reference
from pagoda.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_reference,
    multimodal_cos_sin,
)

# SiLU of ±100 overflows exp under the interpreter (NumPy warns; the result, inf → silu = -0, is right).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

# The fused kernel modules by family, as `dispatch.fused_for` names them.
FUSED = {
    "rms_norm": norm_kernels,
    "rotary": rotary_kernels,
    "activation": activation_kernels,
    "localized_filter": lf_kernels,
}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in units in the last place of their (same) dtype."""
    assert a.dtype == b.dtype and a.shape == b.shape

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(INT_VIEW[t.dtype]).long()
        return torch.where(bits < 0, torch.iinfo(INT_VIEW[t.dtype]).min - bits, bits)  # monotone in value

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def _randn(*shape: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


# ---------------------------------------------------------------------------------------------
# RMSNorm / fused add + RMSNorm
# ---------------------------------------------------------------------------------------------

NORM_SHAPES = [(1, 8), (3, 33), (4, 100), (2, 257)]  # (rows, hidden); odd and non-power-of-2 hiddens


def _check_normed(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Same rounding points; only the fp32 sum of squares is ordered differently, so an fp32 ulp or
    two of the normalized value, which rarely moves a bf16/fp16 result by one ulp."""
    assert ulps(out, ref) <= (4 if out.dtype == torch.float32 else 1)
    if out.dtype != torch.float32:
        assert (out != ref).float().mean() <= 0.02


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
def test_rms_norm(rows, hidden, dtype):
    x = _randn(rows, hidden, dtype=dtype, scale=3.0, seed=1)
    weight = _randn(hidden, dtype=dtype, seed=2) + 1
    out = norm_kernels.rms_norm(x, weight, 1e-6)
    ref = rms_norm_reference(x, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    _check_normed(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
def test_fused_add_rms_norm(rows, hidden, dtype):
    x = _randn(rows, hidden, dtype=dtype, scale=2.0, seed=3)
    residual = _randn(rows, hidden, dtype=dtype, scale=5.0, seed=4)
    weight = _randn(hidden, dtype=dtype, seed=5) + 1
    out, summed = norm_kernels.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_summed = rms_norm_reference(x, weight, 1e-5, residual)
    assert torch.equal(summed, ref_summed)  # the next residual stream: exactly `x + residual`
    assert torch.equal(summed, residual + x)  # the order the model used to add in
    _check_normed(out, ref_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_strided_and_batched_inputs(dtype):
    wide = _randn(5, 80, dtype=dtype, seed=6)
    x = wide[:, 8:56]  # rows strided by 80
    residual = _randn(2, 5, 48, dtype=dtype, seed=7)[1]  # a view into a bigger tensor
    weight = _randn(48, dtype=dtype, seed=8)
    out, summed = norm_kernels.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_summed = rms_norm_reference(x, weight, 1e-6, residual)
    assert torch.equal(summed, ref_summed)
    _check_normed(out, ref_out)
    x3 = _randn(2, 3, 48, dtype=dtype, seed=9)  # [..., H]
    _check_normed(norm_kernels.rms_norm(x3, weight, 1e-6), rms_norm_reference(x3, weight, 1e-6))
    assert norm_kernels.rms_norm(x3[:0], weight, 1e-6).shape == (0, 3, 48)


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------

HEADS = [(4, 4), (6, 2), (3, 1)]  # (Hq, Hkv): MHA, GQA, MQA
DIMS = [(8, 8), (16, 16), (12, 8), (10, 6), (16, 8)]  # (head_dim, rotary_dim): full, partial, odd halves


def _qkv_views(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    """q, k as the models make them: views into one fused qkv projection output (rows strided)."""
    qkv = _randn(t, (hq + 2 * hkv) * d, dtype=dtype, scale=2.0, seed=seed)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,rotary_dim", DIMS)
@pytest.mark.parametrize("hq,hkv", HEADS)
def test_rotary_matches_reference_bit_for_bit(hq, hkv, d, rotary_dim, dtype):
    rope = RotaryEmbedding(rotary_dim, 64, 10000.0, None)
    for t, seed in ((1, 10), (5, 11)):
        q, k = _qkv_views(t, hq, hkv, d, dtype, seed)
        cos_sin = rope.cos_sin(torch.randint(0, 64, (t,), generator=torch.Generator().manual_seed(seed)).to(DEVICE))
        q_out, k_out = rotary_kernels.rotary(q, k, *cos_sin)
        q_ref, k_ref = apply_rotary_reference(q, k, cos_sin)
        assert q_out.is_contiguous() and k_out.is_contiguous()
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_tables_and_head_blocks(dtype, monkeypatch):
    """The bf16-built table (Yuan2-M32), M-RoPE's concatenated table (Qwen2-VL), contiguous q/k, and
    heads split over several programs (a small tile cap), q and k blocks in one launch."""
    t, hq, hkv, d = 4, 6, 3, 16
    positions = torch.tensor([0, 7, 300, 31], device=DEVICE)
    bf16_table = RotaryEmbedding(8, 512, 10000.0, None, table_precision="bfloat16").cos_sin(positions)
    mrope = multimodal_cos_sin(
        RotaryEmbedding(d, 512, 1e6, None), torch.stack([positions, positions.flip(0), positions // 2]), [2, 3, 3]
    )
    for cos_sin, rotary_dim in ((bf16_table, 8), (mrope, d)):
        q, k = _qkv_views(t, hq, hkv, d, dtype, seed=12)
        for qq, kk in ((q, k), (q.contiguous(), k.contiguous())):
            for tile in (rotary_kernels._ROPE_TILE, 8):  # 8 elements: one head per program
                monkeypatch.setattr(rotary_kernels, "_ROPE_TILE", tile)
                q_out, k_out = rotary_kernels.rotary(qq, kk, *cos_sin)
                q_ref, k_ref = apply_rotary_reference(qq, kk, cos_sin)
                assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref), (rotary_dim, tile)
    q, k = _qkv_views(0, hq, hkv, d, dtype, seed=13)
    assert rotary_kernels.rotary(q, k, *RotaryEmbedding(d, 8, 1e4, None).cos_sin(positions[:0]))[0].shape == (0, hq, d)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_on_vision_tower_tables(dtype):
    """The Qwen2-VL vision tower's 2-D RoPE through the kernel: per-patch float32 half tables (rows then
    columns of 40 angles for head_dim 80, a non-power-of-two half), q/k strided views of the fused qkv,
    bit for bit the reference's reading of it: fp32 x·[c|c] + rotate_half(x)·[s|s], rounded once."""
    from pagoda.models.qwen2_vl_vision import _grid_cos_sin

    p, heads, d = 4 * 6, 3, 80
    cos, sin = _grid_cos_sin(4, 6, 2, d, torch.device(DEVICE))  # [P, 1, 40]
    qkv = _randn(p, 3 * heads * d, dtype=dtype, scale=2.0, seed=21).view(p, 3, heads, d)
    q, k, _ = qkv.unbind(dim=1)
    q_out, k_out = rotary_kernels.rotary(q, k, cos, sin)
    full_cos, full_sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)

    def reference(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * full_cos + torch.cat([-x2, x1], -1) * full_sin).to(x.dtype)

    assert torch.equal(q_out, reference(q)) and torch.equal(k_out, reference(k))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,rotary_dim", [(8, 8), (12, 8), (16, 8)])
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
def test_rotary_store_kv_matches_rotary_then_store(hq, hkv, d, rotary_dim, dtype, head_major, monkeypatch):
    """One launch = `rotary` + the backend's `store_kv`, bit for bit: the returned q, every cache slot
    written (k rotated, v copied), padding tokens (slot -1) writing nothing, heads over one or several
    programs, caches stored token-major or head-major (a transposed view)."""
    from pagoda.kernels.attention.store_kv import store_kv

    t, num_blocks, block_size = 5, 6, 4
    qkv = _randn(t, (hq + 2 * hkv) * d, dtype=dtype, scale=2.0, seed=30)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    cos_sin = RotaryEmbedding(rotary_dim, 64, 10000.0, None).cos_sin(torch.tensor([0, 5, 17, 3, 40], device=DEVICE))
    slots = torch.tensor([9, -1, 0, 22, 13], device=DEVICE)

    def caches():
        shape = (num_blocks, hkv, block_size, d) if head_major else (num_blocks, block_size, hkv, d)
        pair = [_randn(*shape, dtype=dtype, seed=31 + i) for i in range(2)]
        return [c.transpose(1, 2) for c in pair] if head_major else pair

    k_ref, v_ref = caches()
    q_ref, k_rot = rotary_kernels.rotary(q, k, *cos_sin)
    store_kv(k_rot, v, k_ref, v_ref, slots)
    for tile in (rotary_kernels._ROPE_TILE, 8):
        monkeypatch.setattr(rotary_kernels, "_ROPE_TILE", tile)
        k_cache, v_cache = caches()
        assert rotary_kernels.supports_rotary_store_kv(q, k, v, *cos_sin, k_cache, v_cache)
        q_out = rotary_kernels.rotary_store_kv(q, k, v, *cos_sin, k_cache, v_cache, slots)
        assert torch.equal(q_out, q_ref) and q_out.is_contiguous()
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), tile


def test_rotary_store_kv_refuses_what_it_cannot_store():
    q, k = _qkv_views(2, 4, 2, 8, torch.float32, seed=32)
    v = torch.zeros_like(k)
    cos_sin = RotaryEmbedding(8, 16, 1e4, None).cos_sin(torch.tensor([1, 2], device=DEVICE))
    cache = torch.zeros(3, 4, 2, 8, device=DEVICE)
    assert rotary_kernels.supports_rotary_store_kv(q, k, v, *cos_sin, cache, cache.clone())
    assert not rotary_kernels.supports_rotary_store_kv(q, k, v, *cos_sin, cache.half(), cache.half())  # dtype
    assert not rotary_kernels.supports_rotary_store_kv(q, k, v, *cos_sin, cache[..., :4], cache[..., :4])  # head_dim
    assert not rotary_kernels.supports_rotary_store_kv(q, k, v[:, :1], *cos_sin, cache, cache)  # v shape
    assert rotary_kernels.rotary_store_kv(
        q[:0],
        k[:0],
        v[:0],
        cos_sin[0][:0],
        cos_sin[1][:0],
        cache,
        cache,
        torch.zeros(0, dtype=torch.long, device=DEVICE),
    ).shape == (0, 4, 8)


# ---------------------------------------------------------------------------------------------
# SiLU-and-mul
# ---------------------------------------------------------------------------------------------

SILU_SHAPES = [(1, 1), (3, 5), (4, 64), (2, 37), (1, 1100)]  # (rows, I); 1100 > one column block


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,inter", SILU_SHAPES)
def test_silu_and_mul(rows, inter, dtype):
    x = _randn(rows, 2 * inter, dtype=dtype, scale=4.0, seed=14)
    x[0, 0] = -100.0  # exp overflows: silu = -0
    x[-1, min(1, inter - 1)] = 100.0
    out = activation_kernels.silu_and_mul(x)
    ref = silu_and_mul_reference(x)
    assert out.shape == (rows, inter) and out.dtype == dtype
    # Same rounding points (silu rounded to the dtype, then the product); only `exp` may differ by
    # an fp32 ulp or two (the CPU reference vectorises exp and the division its own way; on the GPU
    # both are expf and an IEEE division).
    assert ulps(out, ref) <= (4 if dtype == torch.float32 else 1)
    if dtype != torch.float32:
        assert (out != ref).float().mean() <= 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_and_mul_strided_rows_and_column_blocks(dtype, monkeypatch):
    monkeypatch.setattr(activation_kernels, "_SILU_BLOCK", 8)  # I = 21 → three column blocks, the last partial
    x = _randn(3, 50, dtype=dtype, seed=15)[:, 4:46]  # [3, 42], rows strided by 50
    out = activation_kernels.silu_and_mul(x)
    # fp32: exp is not correctly rounded on either side (NumPy under the interpreter, Sleef or CUDA's
    # exp in PyTorch), so a couple of fp32 ulps, as in test_silu_and_mul; bf16 rounds that away
    limit = 4 if dtype == torch.float32 else 1
    assert ulps(out, silu_and_mul_reference(x)) <= limit
    x3 = _randn(2, 2, 10, dtype=dtype, seed=16)
    assert ulps(activation_kernels.silu_and_mul(x3), silu_and_mul_reference(x3)) <= limit
    assert activation_kernels.silu_and_mul(x3[:0]).shape == (0, 2, 5)


# ---------------------------------------------------------------------------------------------
# Layer dispatch
# ---------------------------------------------------------------------------------------------


def test_cpu_tensors_never_take_the_kernels(monkeypatch):
    for family in dispatch.FUSED_FAMILIES:
        assert dispatch.fused_for(family, torch.zeros(2)) is None
    with pytest.raises(ValueError, match="unknown fused kernel family"):
        dispatch.fused_module("fused_ops")
    dispatch.fused_module.cache_clear()
    monkeypatch.setenv("PAGODA_FUSED_OPS", "0")
    try:
        assert all(dispatch.fused_module(family) is None for family in dispatch.FUSED_FAMILIES)
    finally:
        dispatch.fused_module.cache_clear()


# ---------------------------------------------------------------------------------------------
# Yuan2's LF gate on one-token rows: norms fused with the state shifts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hidden, with_residual, with_snapshots", [(6, True, False), (10, False, True), (34, True, True)]
)
def test_lf_decode_kernels_match_the_unfused_gate(hidden, with_residual, with_snapshots, dtype):
    """`lf_decode_input` then `lf_decode_output` against the reference composition: the layer's
    input norm (`rms_norm_reference`, with or without the residual add), the LF gate's gather /
    concatenate / scatter of [x_prev | o1_prev] state rows, and its output norm. Rows sit in
    shuffled slots; snapshot rows include repeats of the null block 0 (whichever row writes it
    last wins, so only distinct real blocks are compared)."""
    rows, num_slots, half = 5, 9, hidden // 2
    width = hidden + half
    h = _randn(rows, hidden, dtype=dtype, seed=40)
    residual = _randn(rows, hidden, dtype=dtype, seed=41) if with_residual else None
    weight, out_weight = _randn(hidden, dtype=dtype, seed=42), _randn(hidden, dtype=dtype, seed=43)
    bias = _randn(half, dtype=dtype, seed=44)
    state = _randn(num_slots, width, dtype=dtype, seed=45)
    slots = torch.tensor([7, 2, 0, 5, 3], device=DEVICE)
    snapshots = _randn(6, width, dtype=dtype, seed=46) if with_snapshots else None
    snap_index = torch.tensor([0, 4, 0, 1, 0], device=DEVICE) if with_snapshots else None
    old_state, old_snapshots = state.clone(), snapshots.clone() if with_snapshots else None

    if with_residual:
        x_ref, summed_ref = rms_norm_reference(h, weight, 1e-6, residual)
    else:
        x_ref, summed_ref = rms_norm_reference(h, weight, 1e-6), h
    in1, in2, summed = lf_kernels.lf_decode_input(h, residual, weight, 1e-6, bias, state, slots, snap_index, snapshots)
    _check_normed(in1[:, hidden:], x_ref)
    assert torch.equal(summed, summed_ref)
    x = in1[:, hidden:]
    assert torch.equal(in1[:, :hidden], old_state[slots, :hidden])
    assert torch.equal(in2, torch.cat([old_state[slots, hidden:], bias.expand(rows, half)], dim=-1))
    want_state = old_state.clone()
    want_state[slots, :hidden] = x
    assert torch.equal(state, want_state)

    o1 = _randn(rows, half, dtype=dtype, seed=47)
    in2[:, half:] = o1  # what conv1 accumulates there
    o2 = _randn(rows, hidden, dtype=dtype, seed=48)
    y = lf_kernels.lf_decode_output(o2, x, out_weight, 1e-6, in2[:, half:], state, slots, snap_index, snapshots)
    _check_normed(y, rms_norm_reference(o2, out_weight, 1e-6, x)[0])
    want_state[slots, hidden:] = o1
    assert torch.equal(state, want_state)
    if with_snapshots:
        for row, block in ((1, 4), (3, 1)):
            assert torch.equal(snapshots[block], torch.cat([x[row], o1[row]]))
        untouched = [2, 3, 5]
        assert torch.equal(snapshots[untouched], old_snapshots[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lf_previous_token_terms_give_the_whole_convolutions(dtype, monkeypatch):
    """A one-row decode step of the gate with `previous_token_terms` (the convolutions' previous-token
    halves in float32, read from the state before the input norm overwrites it) against the same step
    with whole-weight convolutions and against the unfused PyTorch gate: the same x in the state, o1
    within an ulp in bf16 (fp32 summation order), the same output to the dtype's tolerance."""
    from pagoda.kernels import gemv
    from pagoda.layers.localized_filter import LocalizedFilter
    from pagoda.layers.sequence_state import SequenceStateBatch

    hidden, half = 34, 17
    torch.manual_seed(7)
    lf = LocalizedFilter(hidden)
    norm = RMSNorm(hidden)
    for p in (*lf.parameters(), *norm.parameters()):
        p.data.normal_(0, 0.3)
    lf, norm = lf.to(DEVICE, dtype), norm.to(DEVICE, dtype)
    state0 = _randn(5, hidden + half, dtype=dtype, seed=60)
    h, residual = _randn(1, hidden, dtype=dtype, seed=61), _randn(1, hidden, dtype=dtype, seed=62)
    slot = torch.tensor([3], device=DEVICE)
    batch = SequenceStateBatch(
        slots=slot,
        first_token=torch.tensor([0], device=DEVICE),
        last_token=torch.tensor([0], device=DEVICE),
        one_token_per_row=True,
    )

    def step(with_terms: bool):
        lf.bind_state(state0.clone(), torch.empty(0))
        terms = lf.previous_token_terms(slot) if with_terms else None
        x, _, inputs = lf.fused_decode_input(h, residual, norm, batch)
        return lf(x, batch, inputs, terms), lf.state

    with monkeypatch.context() as m:
        m.setattr(dispatch, "fused_for", lambda family, x: FUSED[family])
        m.setattr(dispatch, "gemv_for", lambda x: gemv)
        lf.bind_state(state0.clone(), torch.empty(0))
        assert lf.supports_previous_token_terms(h, batch)
        assert not lf.supports_previous_token_terms(torch.cat([h, h]), batch)
        y_split, state_split = step(True)
        y_whole, state_whole = step(False)
    with monkeypatch.context() as m:  # the PyTorch gate (what the CPU runs)
        m.setattr(dispatch, "fused_for", lambda family, x: None)
        m.setattr(dispatch, "gemv_for", lambda x: None)
        lf.bind_state(state0.clone(), torch.empty(0))
        x_ref, _ = norm(h, residual)
        y_ref, state_ref = lf(x_ref, batch), lf.state

    assert torch.equal(state_split[:, :hidden], state_whole[:, :hidden])
    if dtype == torch.float32:  # nothing rounded to a narrower type: fp32 summation order only
        torch.testing.assert_close(state_split[:, hidden:], state_whole[:, hidden:])
    else:
        assert ulps(state_split[:, hidden:], state_whole[:, hidden:]) <= 1
    assert torch.equal(state_split[[0, 1, 2, 4]], state0[[0, 1, 2, 4]])
    tolerance = {} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(y_split, y_whole, **tolerance)
    torch.testing.assert_close(y_split, y_ref, **tolerance)
    torch.testing.assert_close(state_split, state_ref, **tolerance)


@pytest.fixture
def kernels_everywhere(monkeypatch):
    """Layers use the kernels for every tensor, CPU included (interpreted there)."""
    calls: list[str] = []

    class Spy:
        def __init__(self, family: str) -> None:
            self.kernels = FUSED[family]

        def __getattr__(self, name):
            attr = getattr(self.kernels, name)
            if name in (
                "rms_norm",
                "fused_add_rms_norm",
                "rotary",
                "rotary_store_kv",
                "silu_and_mul",
                "lf_decode_input",
                "lf_decode_output",
            ):

                def wrapped(*args, **kwargs):
                    calls.append(name)
                    return attr(*args, **kwargs)

                return wrapped
            return attr

    monkeypatch.setattr(dispatch, "fused_for", lambda family, x: Spy(family))
    return calls


def test_layers_use_the_kernels_and_fall_back(kernels_everywhere):
    calls = kernels_everywhere
    norm = RMSNorm(24).to(DEVICE)
    x, residual = _randn(3, 24, dtype=torch.float32, seed=17), _randn(3, 24, dtype=torch.float32, seed=18)
    out, summed = norm(x, residual)
    assert torch.equal(summed, x + residual)
    assert ulps(out, rms_norm_reference(x, norm.weight, norm.eps, residual)[0]) <= 4
    norm(x)
    norm(x.to(torch.bfloat16))  # fp32 weight, bf16 input: PyTorch's promotion
    gate_up = _randn(2, 12, dtype=torch.float32, seed=19)
    assert ulps(SiluAndMul()(gate_up), silu_and_mul_reference(gate_up)) <= 4
    q, k = _qkv_views(2, 4, 2, 8, torch.float32, seed=20)
    cos_sin = RotaryEmbedding(8, 16, 1e4, None).cos_sin(torch.tensor([3, 9], device=DEVICE))
    assert all(torch.equal(a, b) for a, b in zip(apply_rotary(q, k, cos_sin), apply_rotary_reference(q, k, cos_sin)))
    assert calls == ["fused_add_rms_norm", "rms_norm", "silu_and_mul", "rotary"]


@pytest.mark.parametrize("with_gemv", [False, True])
def test_yuan_goldens_through_the_fused_kernels(kernels_everywhere, monkeypatch, with_gemv):
    """The whole engine with every norm, residual add, RoPE and SiLU-and-mul in the kernels (the LF
    gate's norms and, on decode steps, its state shifts fused into them) reproduces the official
    code's greedy continuations and logits: Yuan2 dense
    (full rotary) and M32 (partial rotary over a bf16-built table, experts). with_gemv: every
    matmul of at most 8 rows in the few-row GEMV kernel as well (the decode steps: LF conv1
    accumulating in place, conv2, q/k, v, o, down, lm_head), and the requests run one at a time, so
    the dense model's decode steps have one row and its MLP takes the GEMV with SiLU-and-mul fused.
    Those one-row steps compute the LF previous-token terms a layer ahead, so the convolutions run
    as their weights' halves (whole-weight convolutions at one row: `test_lf_previous_token_terms_...`).
    Under the interpreter each GEMV runs as four programs (BLOCK_N a quarter of N; the interpreter's own config,
    two columns a program, made this the suite's slowest test: ~750 launches of up to 256 programs, each
    interpreted one by one): the same kernels, the same K tiles (so the same numerics) and more than one
    program per launch; tests/kernels/test_gemv.py covers the configs themselves."""
    from types import SimpleNamespace

    import triton

    from pagoda.kernels import gemv
    from pagoda.kernels.triton_utils import interpreting

    gemv_calls: list[tuple[str, tuple[int, int]]] = []
    if with_gemv and interpreting():
        product_config = gemv.gemv_config

        def four_programs(m: int, n: int, k: int) -> gemv.GemvConfig:
            config = product_config(m, n, k)
            return gemv.GemvConfig(
                block_n=max(config.block_n, triton.next_power_of_2(n) // 4),
                block_k=config.block_k,
                num_warps=config.num_warps,
            )

        monkeypatch.setattr(gemv, "gemv_config", four_programs)
    if with_gemv:

        def spy(name):
            def call(*args, **kwargs):
                gemv_calls.append((name, tuple(args[1].shape)))
                return getattr(gemv, name)(*args, **kwargs)

            return call

        monkeypatch.setattr(policy, "GEMV_MAX_ROWS", 8)
        monkeypatch.setattr(
            dispatch,
            "gemv_for",
            lambda x: SimpleNamespace(
                supports=gemv.supports, gemv=spy("gemv"), gemv_silu_and_mul=spy("gemv_silu_and_mul")
            ),
        )
    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.sampling_params import SamplingParams
    from tests.conftest import FIXTURES

    # yuan2-tiny runs the Triton attention backend too (RoPE fused into its KV store); M32 the PyTorch one.
    for name, backend in (("yuan2-tiny", "triton"), ("yuan2-m32-tiny", "torch")):
        golden = json.loads((FIXTURES / name / "golden.json").read_text())
        engine = LLMEngine(
            EngineConfig.create(
                EngineArgs(
                    model=str(FIXTURES / name),
                    skip_tokenizer_init=True,
                    dtype="float32",
                    attention_backend=backend,
                    max_num_batched_tokens=16,
                    block_size=4,
                    num_gpu_blocks_override=80,
                    device=DEVICE,
                )
            )
        )
        runner, captured = engine.runner, {}
        sample = runner._sample

        def capture(request_ids, states, logits, sample=sample, captured=captured):
            for rid, row in zip(request_ids, logits):
                captured.setdefault(rid, []).append(row.detach().float().cpu())
            return sample(request_ids, states, logits)

        runner._sample = capture
        cases = golden["cases"][:3]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        done = {}
        for batch in [list(enumerate(cases))] if not with_gemv else [[pair] for pair in enumerate(cases)]:
            for i, case in batch:
                engine.add_request(str(i), case["prompt_ids"], params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0].token_ids
        for i, case in enumerate(cases):
            assert done[str(i)] == case["greedy_16"][:6], name
            torch.testing.assert_close(captured[str(i)][0], torch.tensor(case["last_logits"]), atol=1e-4, rtol=0)
    assert {
        "fused_add_rms_norm",
        "rms_norm",
        "rotary",
        "rotary_store_kv",
        "silu_and_mul",
        "lf_decode_input",
        "lf_decode_output",
    } <= set(kernels_everywhere)
    if with_gemv:  # the LF convolutions' halves conv1 [H/2, H] x 2 and conv2 [H, H/2] x 2, the MLP's up/gate [2I, H]
        cfg = json.loads((FIXTURES / "yuan2-tiny" / "config.json").read_text())
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        assert {
            ("gemv", (hidden // 2, hidden)),
            ("gemv", (hidden, hidden // 2)),
            ("gemv_silu_and_mul", (2 * inter, hidden)),
        } <= set(gemv_calls)


def test_bf16_qwen2_through_the_fused_kernels(tiny_qwen2, monkeypatch):
    """bf16, where every rounding point shows: a tiny Qwen2 (GQA, q/k/v biases, fused qkv views into
    the RoPE kernel) gives the same logits and greedy tokens with the kernels as with PyTorch (exactly
    the same on CPU today). Eager on a GPU too: a CUDA graph captured in one run would replay in the other."""
    from pagoda import LLM, SamplingParams

    llm = LLM(
        model=tiny_qwen2,
        skip_tokenizer_init=True,
        num_gpu_blocks_override=64,
        max_model_len=128,
        dtype="bfloat16",
        device=DEVICE,
        enforce_eager=True,
    )
    runner, captured = llm.engine.runner, []
    sample = runner._sample
    monkeypatch.setattr(
        runner,
        "_sample",
        lambda ids, states, logits: captured.append(logits.float().cpu()) or sample(ids, states, logits),
    )
    prompts = [{"prompt_token_ids": [5, 17, 301, 44, 9, 260, 88, 13, 402]}, {"prompt_token_ids": [400, 12, 97]}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(ops: dict | None) -> tuple[list[list[int]], torch.Tensor]:
        monkeypatch.setattr(dispatch, "fused_for", lambda family, x: ops and ops[family])
        captured.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], torch.cat(captured)

    ref_tokens, ref_logits = run(None)  # the PyTorch code, on any device
    tokens, logits = run(FUSED)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quick_gelu_matches_reference(dtype):
    """The vision tower's QuickGELU in one pass against PyTorch's three ops: rounded at the same points, so
    equal up to the sigmoid's last fp32 ulp (the interpreter's NumPy exp against PyTorch's vectorised one),
    which a 16-bit rounding hides almost always."""
    x = _randn(3, 1000 + 37, dtype=dtype, scale=4.0, seed=31)  # several programs, a ragged tail
    out = activation_kernels.quick_gelu(x)
    ref = quick_gelu_reference(x)
    assert out.shape == x.shape and out.dtype == dtype
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    if dtype != torch.float32:
        assert (out == ref).float().mean() > 0.99  # rounded where the reference rounds: nearly all bits equal
    assert activation_kernels.quick_gelu(x[:0]).shape == (0, 1037)
