"""`--load-format dummy`: every parameter gets small random values on the device it lives on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagoda.models.loader import init_dummy_weights


class _Mixed(nn.Module):
    def __init__(self, device: str, dtype: torch.dtype):
        super().__init__()
        self.linear = nn.Linear(64, 32, device=device, dtype=dtype)
        self.packed = nn.Parameter(torch.zeros(16, 8, dtype=torch.int32, device=device), requires_grad=False)
        self.optional = nn.Parameter(torch.arange(8, dtype=torch.int32, device=device), requires_grad=False)
        self.optional.optional = True  # holds its default, like a GPTQ g_idx


def _check(model: _Mixed, dtype: torch.dtype) -> None:
    weight = model.linear.weight.float()
    if dtype.itemsize > 1:
        assert weight.abs().max() <= 1e-3 + 1e-6
        assert weight.std() > 2e-4  # uniform on [-1e-3, 1e-3]: std ~5.8e-4, not a constant
        assert not torch.equal(model.linear.weight[0].float(), model.linear.weight[1].float())
    else:  # fp8 holds nothing this small but zero and its smallest steps
        assert weight.abs().max() <= 2**-9
    assert model.linear.bias.float().std() > 2e-4
    assert model.packed.unique().numel() > 100  # random bits, not zeros
    assert torch.equal(model.optional.cpu(), torch.arange(8, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_values_are_small_and_random(dtype):
    model = _Mixed("cpu", dtype)
    init_dummy_weights(model)
    _check(model, dtype)
    again = _Mixed("cpu", dtype)
    init_dummy_weights(again)
    assert torch.equal(model.linear.weight, again.linear.weight)  # one seed, the same model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="draws on the GPU's own generator")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_values_are_drawn_on_the_gpu(dtype):
    model = _Mixed("cuda", torch.bfloat16)
    if dtype != torch.bfloat16:  # an fp8 weight, as --quantization fp8 leaves it
        model.linear.weight = nn.Parameter(model.linear.weight.to(dtype), requires_grad=False)
    init_dummy_weights(model)
    assert model.linear.weight.device.type == "cuda"
    _check(model, dtype)
