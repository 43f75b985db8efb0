"""Quantized checkpoints and `--quantization`: refused before any weight loads, in one line that says
what is unsupported (never "re-download the model", which would send the user after a damaged download).

Folders are copies of one tiny random Llama: a `quantization_config` written into config.json, or
AWQ/FP8-style tensors written into the checkpoint in place of a projection's weight.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda import LLM
from pagoda.cli.main import main
from pagoda.config import EngineArgs, EngineConfig
from pagoda.errors import ConfigError, ModelLoadError
from pagoda.models.quantization import tensor_quantization
from pagoda.tools.doctor import format_report, run_checks
from tests.conftest import build_tiny_model

PROJ = "model.layers.0.self_attn.q_proj"
REFUSED = r"quantized checkpoints \({}\) are not supported yet"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> str:
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("quant-plain")))


@pytest.fixture
def folder(plain, tmp_path) -> str:
    return shutil.copytree(plain, str(tmp_path / "model"))


def with_quantization_config(folder: str, method: str = "awq") -> str:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128}
    with open(path, "w") as f:
        json.dump(config, f)
    return folder


def with_awq_tensors(folder: str) -> str:
    """q_proj as AWQ stores it (int32-packed weight and zeros, fp16 scales), config.json untouched."""
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors[f"{PROJ}.weight"]
    tensors[f"{PROJ}.qweight"] = torch.zeros(64, 8, dtype=torch.int32)
    tensors[f"{PROJ}.qzeros"] = torch.zeros(1, 8, dtype=torch.int32)
    tensors[f"{PROJ}.scales"] = torch.ones(1, 64, dtype=torch.float16)
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def load(folder: str, **kwargs) -> LLM:
    return LLM(model=folder, skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks_override=16, **kwargs)


def test_quantization_config_is_refused_before_loading(folder):
    with_quantization_config(folder, "awq")
    with pytest.raises(ModelLoadError, match=REFUSED.format("awq")) as exc:
        EngineConfig.create(EngineArgs(model=folder, skip_tokenizer_init=True))
    assert "re-download" not in exc.value.message and "\n" not in exc.value.message
    with pytest.raises(ModelLoadError, match=REFUSED.format("awq")):
        load(folder)


def test_quantized_tensors_are_refused_before_loading(folder):
    with_awq_tensors(folder)
    # From the safetensors header alone: EngineConfig reads no weights.
    with pytest.raises(ModelLoadError, match=REFUSED.format("awq/gptq") + f".*{PROJ}.qweight"):
        EngineConfig.create(EngineArgs(model=folder, skip_tokenizer_init=True))


def test_quantized_tensors_in_a_bin_checkpoint_are_refused_at_load(folder):
    """A pickle's tensor names are only known once it is read: the loader refuses with the same text."""
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    os.remove(os.path.join(folder, "model.safetensors"))
    tensors[f"{PROJ}.weight"] = tensors[f"{PROJ}.weight"].to(torch.float8_e4m3fn)
    tensors[f"{PROJ}.weight_scale"] = torch.ones(1)
    torch.save(tensors, os.path.join(folder, "pytorch_model.bin"))
    with pytest.raises(ModelLoadError, match=REFUSED.format("fp8")) as exc:
        load(folder)
    assert "re-download" not in exc.value.message


@pytest.mark.parametrize(
    "names, method",
    [
        ([f"{PROJ}.qweight", f"{PROJ}.qzeros", f"{PROJ}.scales"], "awq/gptq"),
        ([f"{PROJ}.qweight", f"{PROJ}.g_idx"], "gptq"),
        ([f"{PROJ}.weight", f"{PROJ}.weight_scale", f"{PROJ}.input_scale"], "fp8"),
        ([f"{PROJ}.weight", f"{PROJ}.weight_scale_inv"], "fp8"),
        ([f"{PROJ}.weight_packed", f"{PROJ}.weight_scale"], "compressed-tensors"),
        ([f"{PROJ}.weight", f"{PROJ}.weight.quant_state.bitsandbytes__nf4"], "bitsandbytes"),
        ([f"{PROJ}.weight", "model.norm.weight", "lm_head.weight"], None),
    ],
)
def test_tensor_names_name_the_method(names, method):
    found = tensor_quantization(names)
    assert (found.method if found else None) == method


def test_cli_refuses_a_quantized_folder_in_one_line(folder, capsys):
    with_quantization_config(folder, "gptq")
    assert main(["generate", "hi", "--model", folder, "--skip-tokenizer-init"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pagoda: error: ") and "(gptq) are not supported yet" in err[0]


# serve's --port -1 would fail the preflight: without the refusal the test fails rather than serves.
@pytest.mark.parametrize("argv", [["generate", "hi", "--quantization", "awq"], ["serve", "-q", "fp8", "--port", "-1"]])
def test_quantization_flag_is_refused_in_one_line(argv, plain, capsys):
    assert main([*argv, "--model", plain, "--skip-tokenizer-init"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pagoda: error: --quantization ")
    assert "not supported yet" in err[0] and "quantization issue" in err[0]


def test_llm_quantization_keyword(plain):
    with pytest.raises(ConfigError, match="--quantization awq is not supported yet") as exc:
        load(plain, quantization="awq")
    assert exc.value.param == "quantization"
    EngineConfig.create(EngineArgs(model=plain, quantization="none"))  # unquantized: accepted


def test_doctor_fails_a_quantized_folder_with_the_same_text(folder):
    with_awq_tensors(with_quantization_config(folder, "awq"))
    checks = run_checks(folder, device="cpu", skip_tokenizer_init=True)
    report = format_report(checks)
    bad = [c for c in checks if c.status == "FAIL"]
    assert [c.name for c in bad] == ["quantization"], report
    assert "quantized checkpoints (awq) are not supported yet" in bad[0].detail
    assert "re-download" not in report
    assert any(c.name == "quantization" for c in run_checks(folder, fast=True, skip_tokenizer_init=True))


def test_doctor_is_silent_on_an_unquantized_folder(plain):
    assert not [c for c in run_checks(plain, fast=True, skip_tokenizer_init=True) if c.name == "quantization"]


def test_plan_notes_a_quantized_folder(folder, capsys):
    with_quantization_config(folder, "awq")
    assert main(["plan", folder, "--device", "cpu"]) == 0
    assert "note: " + folder + ": quantized checkpoints (awq) are not supported yet" in capsys.readouterr().out
