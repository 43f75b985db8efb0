"""`loader.materialize` gives a meta-built model the tensors `Module.to_empty` would, without importing sympy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from pagoda.models.loader import materialize
from pagoda.models.registry import get_model_class
from tests.conftest import build_tiny_model


class _Odd(nn.Module):
    """Parameters and buffers of the kinds a model may hold: a transposed (non-contiguous) weight, a frozen
    one, an unset bias, integer and boolean buffers, a non-persistent buffer, a nested module."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3, 5).t())
        self.frozen = nn.Parameter(torch.empty(2, 2, dtype=torch.float16), requires_grad=False)
        self.register_parameter("bias", None)
        self.register_buffer("positions", torch.empty(7, dtype=torch.int64))
        self.register_buffer("mask", torch.empty(2, 3, dtype=torch.bool), persistent=False)
        self.register_buffer("unset", None)
        self.inner = nn.Linear(4, 6)


def _layout(model: nn.Module) -> list[tuple]:
    tensors = [(n, t, True) for n, t in model.named_parameters()] + [(n, t, False) for n, t in model.named_buffers()]
    return sorted(
        (n, tuple(t.shape), t.stride(), t.dtype, t.device.type, type(t).__name__, t.requires_grad, is_param)
        for n, t, is_param in tensors
    )


def _meta_models(tmp_path) -> list[nn.Module]:
    models = []
    with torch.device("meta"):
        models.append(_Odd())
    for kind in ("llama", "qwen2"):
        folder = build_tiny_model(kind, str(tmp_path / kind))
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        with torch.device("meta"):
            models.append(get_model_class(config["architectures"][0])(config, 64))
    return models


def test_materialize_gives_what_to_empty_gives(tmp_path):
    for expected_model, model in zip(_meta_models(tmp_path), _meta_models(tmp_path), strict=True):
        expected = _layout(expected_model.to_empty(device="cpu"))
        got = _layout(materialize(model, torch.device("cpu")))
        assert got == expected
        assert all(t.device.type == "cpu" for t in model.state_dict().values())


def test_materialize_unties_as_to_empty_does():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    materialize(model, torch.device("cpu"))
    assert model[1].weight is not model[0].weight  # `tie_weights` ties them again after loading


@pytest.mark.timeout(120)
def test_materializing_a_model_does_not_import_sympy(tmp_path):
    folder = build_tiny_model("llama", str(tmp_path / "llama"))
    child = (
        "import json, sys, torch\n"
        "from pagoda.models.loader import materialize\n"
        "from pagoda.models.registry import get_model_class\n"
        f"config = json.load(open({os.path.join(folder, 'config.json')!r}))\n"
        "with torch.device('meta'):\n"
        "    model = get_model_class(config['architectures'][0])(config, 64)\n"
        "materialize(model, torch.device('cpu'))\n"
        "print('sympy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
