"""LayerNorm and add + LayerNorm (`pagoda/kernels/layer_norm.py`) against `layer_norm_reference` (F.layer_norm, what
the CPU runs and the Qwen2-VL parity tests pin down), and the vision tower through them against its PyTorch path.
The residual sum is bit-exact; the normed value is within an ulp (the fp32 statistics' summation order). On CPU the
kernels run under the Triton interpreter (`conftest.py`), so shapes stay tiny.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("triton")

from pagoda.kernels import dispatch
from pagoda.kernels import layer_norm as ln_kernels
from pagoda.layers.norm import LayerNorm, layer_norm_reference
from tests.kernels.fused_checks import DEVICE, DTYPES, FUSED, check_normed, randn

SHAPES = [(1, 8), (3, 33), (4, 100), (2, 257)]  # (rows, hidden); odd and non-power-of-2 hiddens


def check_ln(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16/fp16: within an ulp on a few elements (`check_normed`). float32: the mean and variance summed in
    another order move every normalized value by a few fp32 ulps of the row's scale, which near zero is many
    ulps of the value itself, so an absolute bound instead."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        check_normed(out, ref)


def _params(hidden: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(hidden, dtype=dtype, seed=seed) + 1, randn(hidden, dtype=dtype, scale=0.5, seed=seed + 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_layer_norm(rows, hidden, dtype):
    x = randn(rows, hidden, dtype=dtype, scale=3.0, seed=1) + 2  # an offset: the mean matters
    weight, bias = _params(hidden, dtype, 2)
    out = ln_kernels.layer_norm(x, weight, bias, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    check_ln(out, layer_norm_reference(x, weight, bias, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_fused_add_layer_norm(rows, hidden, dtype):
    x = randn(rows, hidden, dtype=dtype, scale=2.0, seed=3)
    residual = randn(rows, hidden, dtype=dtype, scale=5.0, seed=4)
    weight, bias = _params(hidden, dtype, 5)
    out, summed = ln_kernels.fused_add_layer_norm(x, residual, weight, bias, 1e-5)
    ref_out, ref_summed = layer_norm_reference(x, weight, bias, 1e-5, residual)
    assert torch.equal(summed, ref_summed)  # the next residual stream: exactly `x + residual`
    assert torch.equal(summed, residual + x)  # the order the tower used to add in
    check_ln(out, ref_out)


def test_strided_and_batched_inputs():
    wide = randn(5, 80, dtype=torch.bfloat16, seed=6)
    x = wide[:, 8:56]  # rows strided by 80
    residual = randn(2, 5, 48, dtype=torch.bfloat16, seed=7)[1]
    weight, bias = _params(48, torch.bfloat16, 8)
    out, summed = ln_kernels.fused_add_layer_norm(x, residual, weight, bias, 1e-6)
    ref_out, ref_summed = layer_norm_reference(x, weight, bias, 1e-6, residual)
    assert torch.equal(summed, ref_summed)
    check_ln(out, ref_out)
    x3 = randn(2, 3, 48, dtype=torch.bfloat16, seed=9)  # [..., H]
    check_ln(ln_kernels.layer_norm(x3, weight, bias, 1e-6), layer_norm_reference(x3, weight, bias, 1e-6))


def test_supports_only_what_it_computes():
    x = randn(2, 16, dtype=torch.bfloat16, seed=10)
    weight, bias = _params(16, torch.bfloat16, 11)
    assert ln_kernels.supports_layer_norm(x, weight, bias, x)
    assert not ln_kernels.supports_layer_norm(x, weight, None)  # no bias: PyTorch
    assert not ln_kernels.supports_layer_norm(x, weight.float(), bias)  # mixed dtypes: PyTorch
    assert not ln_kernels.supports_layer_norm(x, weight[:8], bias[:8])
    assert not ln_kernels.supports_layer_norm(x, weight, bias, x[:1])
    wide = randn(1, ln_kernels.MAX_NORM_SIZE + 1, dtype=torch.bfloat16, seed=12)
    assert not ln_kernels.supports_layer_norm(wide, *_params(wide.shape[1], torch.bfloat16, 13))


@pytest.fixture
def layer_norm_kernels_everywhere(monkeypatch):
    """LayerNorm layers take the kernels for every tensor, CPU included (interpreted there); other families keep
    their usual dispatch. Returns the kernel calls made."""
    calls: list[str] = []
    usual = dispatch.fused_for

    class Spy:
        def __getattr__(self, name):
            attr = getattr(FUSED["layer_norm"], name)
            if name in ("layer_norm", "fused_add_layer_norm"):

                def wrapped(*args, **kwargs):
                    calls.append(name)
                    return attr(*args, **kwargs)

                return wrapped
            return attr

    monkeypatch.setattr(dispatch, "fused_for", lambda family, x: Spy() if family == "layer_norm" else usual(family, x))
    return calls


def test_layer_uses_the_kernels_and_falls_back(layer_norm_kernels_everywhere):
    calls = layer_norm_kernels_everywhere
    norm = LayerNorm(24, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(randn(24, dtype=torch.float32, seed=14) + 1)
        norm.bias.copy_(randn(24, dtype=torch.float32, seed=15))
    x, residual = randn(3, 24, dtype=torch.float32, seed=16), randn(3, 24, dtype=torch.float32, seed=17)
    out, summed = norm(x, residual)
    ref_out, ref_summed = layer_norm_reference(x, norm.weight, norm.bias, norm.eps, residual)
    assert torch.equal(summed, ref_summed)
    check_ln(out, ref_out)
    check_ln(norm(x), torch.nn.functional.layer_norm(x, (24,), norm.weight, norm.bias, 1e-6))
    # fp32 parameters, bf16 input: not the kernels' case, so nn.LayerNorm's behaviour, whatever the device's is
    # (the CPU promotes; CUDA has no such mixed-dtype layer norm and raises).
    mixed = x.to(torch.bfloat16)
    try:
        expected = torch.nn.functional.layer_norm(mixed, (24,), norm.weight, norm.bias, 1e-6)
    except RuntimeError:
        with pytest.raises(RuntimeError):
            norm(mixed)
    else:
        assert torch.equal(norm(mixed), expected)
    assert calls == ["fused_add_layer_norm", "layer_norm"]


def test_vision_tower_through_the_kernels_matches_its_pytorch_path(layer_norm_kernels_everywhere):
    """The tower adds each block's attention and MLP output inside the next LayerNorm (the merger's for the last
    block's MLP): the same sums, in the same order, as the PyTorch path's `x + f(x)`; only the norms' fp32
    statistics are ordered differently. Three blocks, two images of different sizes (two segment lengths)."""
    from pagoda.models.qwen2_vl_vision import Qwen2VisionTransformer, vision_config_with_defaults

    cfg = vision_config_with_defaults(
        {"depth": 3, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2, "in_channels": 3, "patch_size": 2}, 24
    )
    torch.manual_seed(0)
    tower = Qwen2VisionTransformer(cfg).to(DEVICE)
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0.0, 0.3)
    grids = [(1, 4, 4), (1, 2, 6)]
    rows = sum(t * h * w for t, h, w in grids)
    pixels = randn(rows, 3 * cfg["temporal_patch_size"] * 2 * 2, dtype=torch.float32, seed=18)
    with torch.no_grad():
        fused = tower(pixels, grids)
        calls = list(layer_norm_kernels_everywhere)
        dispatch_usual = dispatch.fused_for
        try:
            dispatch.fused_for = lambda family, x: None  # the PyTorch path everywhere
            reference = tower(pixels, grids)
        finally:
            dispatch.fused_for = dispatch_usual
    assert calls.count("fused_add_layer_norm") == 2 * cfg["depth"] and calls.count("layer_norm") == 1
    assert fused.shape == reference.shape == (rows // 4, 24)
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)
