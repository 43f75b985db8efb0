"""RoPE (`pagoda/kernels/rotary.py`) against `apply_rotary_reference`, bit for bit (three rounded fp32
operations per output, no FMA), and the fused RoPE + KV store against `rotary` then `store_kv`. On CPU
the kernels run under the Triton interpreter (`conftest.py`), so shapes stay tiny.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("triton")

from pagoda.kernels import rotary as rotary_kernels
from pagoda.layers.rotary import RotaryEmbedding, apply_rotary_reference, multimodal_cos_sin
from tests.kernels.fused_checks import DEVICE, DTYPES, qkv_views, randn

HEADS = [(4, 4), (6, 2), (3, 1)]  # (Hq, Hkv): MHA, GQA, MQA
DIMS = [(8, 8), (16, 16), (12, 8), (10, 6), (16, 8)]  # (head_dim, rotary_dim): full, partial, odd halves


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,rotary_dim", DIMS)
@pytest.mark.parametrize("hq,hkv", HEADS)
def test_rotary_matches_reference_bit_for_bit(hq, hkv, d, rotary_dim, dtype):
    rope = RotaryEmbedding(rotary_dim, 64, 10000.0, None)
    for t, seed in ((1, 10), (5, 11)):
        q, k = qkv_views(t, hq, hkv, d, dtype, seed)
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
        q, k = qkv_views(t, hq, hkv, d, dtype, seed=12)
        for qq, kk in ((q, k), (q.contiguous(), k.contiguous())):
            for tile in (rotary_kernels._ROPE_TILE, 8):  # 8 elements: one head per program
                monkeypatch.setattr(rotary_kernels, "_ROPE_TILE", tile)
                q_out, k_out = rotary_kernels.rotary(qq, kk, *cos_sin)
                q_ref, k_ref = apply_rotary_reference(qq, kk, cos_sin)
                assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref), (rotary_dim, tile)
    q, k = qkv_views(0, hq, hkv, d, dtype, seed=13)
    assert rotary_kernels.rotary(q, k, *RotaryEmbedding(d, 8, 1e4, None).cos_sin(positions[:0]))[0].shape == (0, hq, d)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_on_vision_tower_tables(dtype):
    """The Qwen2-VL vision tower's 2-D RoPE through the kernel: per-patch float32 half tables (rows then
    columns of 40 angles for head_dim 80, a non-power-of-two half), q/k strided views of the fused qkv,
    bit for bit the reference's reading of it: fp32 x·[c|c] + rotate_half(x)·[s|s], rounded once."""
    from pagoda.models.qwen2_vl_vision import _grid_cos_sin

    p, heads, d = 4 * 6, 3, 80
    cos, sin = _grid_cos_sin(4, 6, 2, d, torch.device(DEVICE))  # [P, 1, 40]
    qkv = randn(p, 3 * heads * d, dtype=dtype, scale=2.0, seed=21).view(p, 3, heads, d)
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
    qkv = randn(t, (hq + 2 * hkv) * d, dtype=dtype, scale=2.0, seed=30)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    cos_sin = RotaryEmbedding(rotary_dim, 64, 10000.0, None).cos_sin(torch.tensor([0, 5, 17, 3, 40], device=DEVICE))
    slots = torch.tensor([9, -1, 0, 22, 13], device=DEVICE)

    def caches():
        shape = (num_blocks, hkv, block_size, d) if head_major else (num_blocks, block_size, hkv, d)
        pair = [randn(*shape, dtype=dtype, seed=31 + i) for i in range(2)]
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
    q, k = qkv_views(2, 4, 2, 8, torch.float32, seed=32)
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
