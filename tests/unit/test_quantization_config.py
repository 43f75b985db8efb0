"""Which quantization a checkpoint runs with: `quantization_config` and tensor names resolved before any
weight loads, into one `QuantConfig`, or refused in one line naming the layout found and the supported
ones (never "re-download the model", which would send the user after a damaged download).

Folders are copies of one tiny random Llama with a `quantization_config` written into config.json, or
quantized-style tensors written into the checkpoint in place of a projection's weight. Whether the
supported layouts compute the right thing is tests/models/test_quantized_models.py.
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
from pagoda.config.quantization import SUPPORTED, QuantConfig, tensor_quantization
from pagoda.errors import ConfigError, ModelLoadError
from pagoda.tools.doctor import format_report, run_checks
from tests.conftest import build_tiny_model

PROJ = "model.layers.0.self_attn.q_proj"
NOT_SUPPORTED = r"this quantized checkpoint \({}\) is not supported"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> str:
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("quant-plain")))


@pytest.fixture
def folder(plain, tmp_path) -> str:
    return shutil.copytree(plain, str(tmp_path / "model"))


def with_quantization_config(folder: str, config: dict) -> str:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        hf_config = json.load(f)
    hf_config["quantization_config"] = config
    with open(path, "w") as f:
        json.dump(hf_config, f)
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


def resolved(folder: str, **kwargs) -> QuantConfig | None:
    return EngineConfig.create(EngineArgs(model=folder, skip_tokenizer_init=True, **kwargs)).model.quantization


def load(folder: str, **kwargs) -> LLM:
    return LLM(model=folder, skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks_override=16, **kwargs)


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False}


def _fp8_group(strategy: str) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
    return {"group_0": {"targets": ["Linear"], "weights": weights}}


@pytest.mark.parametrize(
    "config, expected",
    [
        (AWQ, QuantConfig("awq", True, bits=4, group_size=32)),
        (
            {**GPTQ, "checkpoint_format": "gptq_v2"},
            QuantConfig("gptq", True, bits=4, group_size=32, desc_act=True, sym=False, checkpoint_format="gptq_v2"),
        ),
        (
            {**AWQ, "modules_to_not_convert": ["visual"]},
            QuantConfig("awq", True, bits=4, group_size=32, ignored=("visual",)),
        ),
        (
            {"quant_method": "fp8", "activation_scheme": "dynamic"},
            QuantConfig("fp8", True, fp8_weight_strategy="tensor"),
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": _fp8_group("channel"),
                "ignore": ["lm_head"],
            },
            QuantConfig("fp8", True, fp8_weight_strategy="channel", ignored=("lm_head",)),
        ),
    ],
)
def test_supported_layouts_resolve(folder, config, expected):
    assert resolved(with_quantization_config(folder, config)) == expected


@pytest.mark.parametrize(
    "config, method, detail",
    [
        ({**AWQ, "bits": 8}, "awq", "8-bit weights"),
        ({**AWQ, "version": "gemv"}, "awq", "AWQ version 'gemv'"),
        ({**GPTQ, "bits": 3}, "gptq", "3-bit weights"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8", "block-wise FP8 scales"),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": _fp8_group("group")},
            "compressed-tensors",
            "'pack-quantized'",
        ),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes", "not implemented"),
    ],
)
def test_unsupported_layouts_are_refused_in_one_line(folder, config, method, detail):
    with_quantization_config(folder, config)
    with pytest.raises(ModelLoadError, match=NOT_SUPPORTED.format(method)) as exc:
        EngineConfig.create(EngineArgs(model=folder, skip_tokenizer_init=True))
    message = exc.value.message
    assert detail in message and SUPPORTED in message
    assert "re-download" not in message and "\n" not in message


def test_quantized_tensors_without_a_config_are_refused_before_loading(folder):
    with_awq_tensors(folder)
    # From the safetensors header alone: EngineConfig reads no weights.
    with pytest.raises(ModelLoadError, match=NOT_SUPPORTED.format("awq/gptq") + f".*{PROJ}.qweight") as exc:
        EngineConfig.create(EngineArgs(model=folder, skip_tokenizer_init=True))
    assert "no quantization_config" in exc.value.message


def test_quantized_tensors_in_a_bin_checkpoint_are_refused_at_load(folder):
    """A pickle's tensor names are only known once it is read: the loader refuses with the same text."""
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    os.remove(os.path.join(folder, "model.safetensors"))
    tensors[f"{PROJ}.weight"] = tensors[f"{PROJ}.weight"].to(torch.float8_e4m3fn)
    tensors[f"{PROJ}.weight_scale"] = torch.ones(1)
    torch.save(tensors, os.path.join(folder, "pytorch_model.bin"))
    with pytest.raises(ModelLoadError, match=NOT_SUPPORTED.format("fp8")) as exc:
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


def test_cli_refuses_an_unsupported_folder_in_one_line(folder, capsys):
    with_quantization_config(folder, {"quant_method": "bitsandbytes"})
    assert main(["generate", "hi", "--model", folder, "--skip-tokenizer-init"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pagoda: error: ") and "(bitsandbytes) is not supported" in err[0]


def test_fp8_quantizes_an_unquantized_checkpoint_at_load(plain):
    assert resolved(plain, quantization="fp8") == QuantConfig("fp8", False, ignored=("lm_head",))
    assert resolved(plain, quantization="none") is None and resolved(plain) is None


@pytest.mark.parametrize(
    "flag, needs", [("awq", "needs an AWQ checkpoint"), ("gptq_marlin", "needs a GPTQ checkpoint")]
)
def test_int4_flag_needs_an_int4_checkpoint(plain, flag, needs, capsys):
    assert main(["generate", "hi", "--quantization", flag, "--model", plain, "--skip-tokenizer-init"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{needs} (config.json with a quantization_config)" in err[0]


def test_flag_contradicting_the_checkpoint_is_refused(folder):
    with_quantization_config(folder, AWQ)
    with pytest.raises(ModelLoadError, match="--quantization gptq does not match the checkpoint, which is awq"):
        resolved(folder, quantization="gptq")
    assert resolved(folder, quantization="awq_marlin") == resolved(folder)  # vLLM's kernel names: the same method


def test_llm_quantization_keyword_names_the_choices(plain):
    with pytest.raises(ConfigError, match="quantization") as exc:
        load(plain, quantization="int3")
    assert exc.value.param == "quantization" and "fp8" in exc.value.message


def test_doctor_reports_the_layout_it_will_run(folder):
    with_awq_tensors(with_quantization_config(folder, AWQ))
    checks = run_checks(folder, device="cpu", skip_tokenizer_init=True)
    report = format_report(checks)
    quant = [c for c in checks if c.name == "quantization"]
    assert [c.status for c in quant] == ["ok"] and "awq int4 weights (group size 32)" in quant[0].detail, report
    assert not [c for c in checks if c.status == "FAIL"], report


def test_doctor_fails_an_unsupported_folder_with_the_serve_text(folder):
    with_quantization_config(folder, {**AWQ, "bits": 3})
    checks = run_checks(folder, fast=True, skip_tokenizer_init=True)
    bad = [c for c in checks if c.status == "FAIL"]
    assert [c.name for c in bad] == ["quantization"] and "(awq) is not supported" in bad[0].detail
    assert "re-download" not in format_report(checks)


def test_doctor_is_silent_on_an_unquantized_folder(plain):
    assert not [c for c in run_checks(plain, fast=True, skip_tokenizer_init=True) if c.name == "quantization"]


def test_plan_counts_quantized_weights(folder, capsys):
    def weights(*argv: str) -> int:
        assert main(["plan", folder, "--device", "cpu", "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)["weights_bytes_total"]

    plain_bytes, fp8_bytes = weights(), weights("--quantization", "fp8")
    with_quantization_config(folder, AWQ)
    awq_bytes = weights()
    # The projections' share of the bf16 bytes halves at fp8 and quarters at int4 (plus scales/zero points).
    assert awq_bytes < fp8_bytes < plain_bytes
