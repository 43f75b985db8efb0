"""`pagoda doctor`: each kind of broken model folder gives its own FAIL line; a healthy one gives none.

Folders are built here from a tiny random Llama (sharded into 5 safetensors files) plus a tiny
word-level tokenizer with a chat template, then broken one way per test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket

import pytest
import torch

from pagoda.launch.preflight import serve_preflight
from pagoda.tools import doctor
from pagoda.tools.doctor import Check, format_report, run_checks
from pagoda.tools.doctor import run as doctor_run
from pagoda.tools.doctor.model_config import check_tensor_parallel
from pagoda.tools.doctor.tokenizer import check_yuan_tokens
from tests.conftest import FIXTURES, TINY_CONFIGS, build_tiny_model

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def save_tiny_tokenizer(folder: str, chat_template: str | None = TEMPLATE) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(40)] + ["hello", "world", "user", "assistant"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = chat_template
    tok.save_pretrained(folder)


@pytest.fixture(scope="module")
def healthy_template(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("doctor-healthy"))
    build_tiny_model("llama", folder, max_shard_size="100KB")
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture
def model_dir(healthy_template, tmp_path) -> str:
    """A fresh, writable copy of the healthy sharded folder for one test to break."""
    return shutil.copytree(healthy_template, str(tmp_path / "model"))


def shard_names(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))


def fails(checks: list[Check], name: str | None = None) -> list[Check]:
    return [c for c in checks if c.status == "FAIL" and (name is None or c.name == name)]


def line_of(checks: list[Check], name: str, status: str = "FAIL") -> str:
    lines = [
        line for c, line in zip(checks, format_report(checks).splitlines()) if c.name == name and c.status == status
    ]
    assert lines, f"no {status} line for {name!r} in:\n{format_report(checks)}"
    return "\n".join(lines)


def test_healthy_folder_has_no_fail(model_dir):
    checks = run_checks(model_dir, device="cpu")
    assert not fails(checks), format_report(checks)
    names = {c.name for c in checks}
    assert {
        "config",
        "architecture",
        "config fields",
        "shards",
        "permissions",
        "safetensors",
        "index",
        "checkpoint vs model",
        "disk",
        "tokenizer",
        "special tokens",
        "chat template",
        "cuda",
    } <= names
    assert next(c for c in checks if c.name == "cuda").detail.startswith("running on CPU")
    assert "5 safetensors file(s)" in next(c for c in checks if c.name == "shards").detail


def test_fast_subset_skips_slow_and_gpu_checks(model_dir):
    names = {c.name for c in run_checks(model_dir, fast=True)}
    assert {"config", "architecture", "shards", "safetensors", "tokenizer"} <= names
    assert not names & {"chat template", "checkpoint vs model", "cuda"}


def test_dummy_load_format_needs_no_weights(model_dir):
    """Benchmarks serve config-only folders with --load-format dummy: no weights is then no failure."""
    for name in shard_names(model_dir) + ["model.safetensors.index.json"]:
        os.remove(os.path.join(model_dir, name))
    assert fails(run_checks(model_dir, fast=True), "shards")
    checks = run_checks(model_dir, fast=True, load_format="dummy")
    assert not fails(checks) and "dummy" in line_of(checks, "shards", "ok")


def test_missing_shard(model_dir):
    victim = shard_names(model_dir)[1]
    os.remove(os.path.join(model_dir, victim))
    checks = run_checks(model_dir, fast=True)
    line = line_of(checks, "shards")
    assert victim in line and "missing" in line and "re-download" in line


def test_extra_unlisted_shard(model_dir):
    shutil.copy(
        os.path.join(model_dir, shard_names(model_dir)[0]), os.path.join(model_dir, "model-00006-of-00006.safetensors")
    )
    line = line_of(run_checks(model_dir, fast=True), "shards")
    assert "model-00006-of-00006.safetensors" in line and "not listed" in line


def test_stray_unnumbered_file_is_a_warning(model_dir):
    shutil.copy(os.path.join(model_dir, shard_names(model_dir)[0]), os.path.join(model_dir, "model-4bit.safetensors"))
    checks = run_checks(model_dir, fast=True)
    assert not fails(checks)
    assert "model-4bit.safetensors" in line_of(checks, "shards", "warn")


def test_numbered_gap_without_index(model_dir):
    os.remove(os.path.join(model_dir, "model.safetensors.index.json"))
    os.remove(os.path.join(model_dir, "model-00003-of-00005.safetensors"))
    assert "model-00003-of-00005.safetensors" in line_of(run_checks(model_dir, fast=True), "shards")


def test_truncated_safetensors(model_dir):
    victim = os.path.join(model_dir, shard_names(model_dir)[2])
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 100)
    checks = run_checks(model_dir, fast=True)
    line = line_of(checks, "safetensors")
    assert os.path.basename(victim) in line and "truncated" in line and "re-download it" in line
    assert doctor.main([model_dir, "--fast"]) == 1


def test_stray_bytes_after_safetensors_data(model_dir):
    victim = os.path.join(model_dir, shard_names(model_dir)[0])
    with open(victim, "ab") as f:
        f.write(b"\0" * 16)
    assert "stray bytes" in line_of(run_checks(model_dir, fast=True), "safetensors")


def test_directory_in_place_of_a_file_is_unreadable(model_dir):
    victim = shard_names(model_dir)[3]
    os.remove(os.path.join(model_dir, victim))
    os.mkdir(os.path.join(model_dir, victim))
    checks = run_checks(model_dir, fast=True)
    line = line_of(checks, "permissions")
    assert victim in line and "directory" in line
    assert not fails(checks, "safetensors")  # reported once, not again as a bad header


def test_permission_check_uses_os_access(model_dir, monkeypatch):
    """As root every file is readable, so the os.access answer is simulated for one file."""
    victim = os.path.join(model_dir, "tokenizer.json")
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode, *a, **k: False if os.fspath(p) == victim else real_access(p, mode, *a, **k)
    )
    line = line_of(run_checks(model_dir, fast=True, skip_tokenizer_init=True), "permissions")
    assert "tokenizer.json" in line and "not readable" in line


def test_no_tokenizer_files(tmp_path):
    folder = build_tiny_model("llama", str(tmp_path / "bare"))
    checks = run_checks(folder, fast=True)
    line = line_of(checks, "tokenizer")
    assert "no tokenizer files" in line and "--tokenizer" in line
    skipped = run_checks(folder, fast=True, skip_tokenizer_init=True)
    assert not fails(skipped), format_report(skipped)


def test_bad_chat_template(model_dir):
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write("{% for %}")
    checks = run_checks(model_dir, device="cpu")
    line = line_of(checks, "chat template")
    assert "does not render" in line and "--chat-template" in line
    assert len(fails(checks)) == 1
    fixed = run_checks(model_dir, device="cpu", chat_template=TEMPLATE)  # an override replaces it
    assert not fails(fixed), format_report(fixed)


def test_missing_chat_template_warns(tmp_path):
    folder = build_tiny_model("llama", str(tmp_path / "no-template"))
    save_tiny_tokenizer(folder, chat_template=None)
    checks = run_checks(folder, device="cpu")
    assert not fails(checks), format_report(checks)
    assert "pass --chat-template" in line_of(checks, "chat template", "warn")


def test_taken_port(model_dir):
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        port = listener.getsockname()[1]
        checks = run_checks(model_dir, fast=True, port=port)
        line = line_of(checks, "port")
        assert f"another process listens on port {port}" in line and "--port" in line
    assert [c.status for c in run_checks(model_dir, fast=True, port=port) if c.name == "port"] == ["ok"]


def test_yuan_fixture_special_token_ids():
    checks = run_checks(str(FIXTURES / "yuan2-tiny"), tokenizer=str(FIXTURES / "yuan2-tokenizer"), device="cpu")
    assert not fails(checks), format_report(checks)
    yuan = next(c for c in checks if c.name == "yuan tokens")
    assert yuan.status == "ok" and "<eod> = 77185" in yuan.detail and "<sep> = 77187" in yuan.detail
    assert next(c for c in checks if c.name == "checkpoint vs model").status == "ok"


def test_yuan_ids_elsewhere_fail():
    """A tokenizer where <eod>/<sep> are not Yuan2's ids (a wrong --tokenizer) gives the FAIL line."""

    class WrongTokenizer:
        def convert_tokens_to_ids(self, token):
            return 0

    check = check_yuan_tokens(WrongTokenizer())
    assert check.status == "FAIL" and "<eod> → 0 (expected 77185)" in check.detail and "--tokenizer" in check.fix


def test_config_errors(model_dir):
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:
        f.write("{not json")
    assert "not valid JSON" in line_of(run_checks(model_dir, fast=True), "config")
    with open(path, "w") as f:
        json.dump(dict(cfg, architectures=["GPT2LMHeadModel"]), f)
    assert "GPT2LMHeadModel is not supported" in line_of(run_checks(model_dir, fast=True), "architecture")
    with open(path, "w") as f:
        json.dump(dict(cfg, num_key_value_heads=3), f)
    assert "num_key_value_heads 3" in line_of(run_checks(model_dir, fast=True), "config fields")
    assert "does not exist" in line_of(run_checks(str(os.path.join(model_dir, "nope")), fast=True), "config")


def test_config_that_does_not_match_the_weights(model_dir):
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(cfg, intermediate_size=96), f)
    line = line_of(run_checks(model_dir, device="cpu"), "checkpoint vs model")
    assert "shape mismatch" in line and "config.json" in line


def test_bin_shards_both_ways(tmp_path):
    import transformers

    folder = str(tmp_path / "bin")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_CONFIGS["llama"]))
    hf.config.save_pretrained(folder)
    state = hf.state_dict()
    names = list(state)
    shards = {
        "pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
        "pytorch_model-00002-of-00002.bin": names[len(names) // 2 :],
    }
    for shard, keys in shards.items():
        torch.save({k: state[k] for k in keys}, os.path.join(folder, shard))
    with open(os.path.join(folder, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}, f)
    checks = run_checks(folder, fast=True, skip_tokenizer_init=True)
    assert not fails(checks), format_report(checks)
    assert "2 bin file(s)" in next(c for c in checks if c.name == "shards").detail

    extra = os.path.join(folder, "pytorch_model-00003-of-00003.bin")
    shutil.copy(os.path.join(folder, "pytorch_model-00001-of-00002.bin"), extra)
    assert "pytorch_model-00003-of-00003.bin" in line_of(
        run_checks(folder, fast=True, skip_tokenizer_init=True), "shards"
    )
    os.remove(extra)
    second = os.path.join(folder, "pytorch_model-00002-of-00002.bin")
    with open(second, "r+b") as f:
        f.truncate(os.path.getsize(second) // 2)
    line = line_of(run_checks(folder, fast=True, skip_tokenizer_init=True), "pytorch bin")
    assert "pytorch_model-00002-of-00002.bin" in line and "re-download it" in line
    os.remove(second)
    line = line_of(run_checks(folder, fast=True, skip_tokenizer_init=True), "shards")
    assert "pytorch_model-00002-of-00002.bin" in line and "missing" in line


def test_qwen2_vl_vision_and_preprocessor_config(tmp_path):
    folder = tmp_path / "qwen2vl-config"
    folder.mkdir()
    cfg = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "text_config": {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "vocab_size": 512,
            "intermediate_size": 128,
        },
        "vision_config": {"depth": 2, "embed_dim": 32, "num_heads": 4, "hidden_size": 64},
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14, "merge_size": 2}))
    checks = run_checks(str(folder), fast=True, skip_tokenizer_init=True)
    assert next(c for c in checks if c.name == "vision config").status == "ok"
    assert next(c for c in checks if c.name == "preprocessor config").status == "ok"
    assert "No *.safetensors" in line_of(checks, "shards")

    (folder / "config.json").write_text(json.dumps(dict(cfg, vision_config=dict(cfg["vision_config"], hidden_size=48))))
    (folder / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14, "merge_size": 0}))
    checks = run_checks(str(folder), fast=True, skip_tokenizer_init=True)
    assert "vision_config.hidden_size (48)" in line_of(checks, "vision config")
    assert "merge_size must be a positive integer" in line_of(checks, "preprocessor config")

    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16}))
    assert "patch_size 16 vs vision_config 14" in line_of(
        run_checks(str(folder), fast=True, skip_tokenizer_init=True), "preprocessor config"
    )


def test_tensor_parallel_and_shm(model_dir):
    """The tiny Llama: 4 heads, 2 KV heads, intermediate 128, vocab 512 — so sizes 1, 2 and 4 fit."""
    from pagoda.config.parallel import tensor_parallel_error

    checks = run_checks(model_dir, fast=True, tensor_parallel_size=3, skip_tokenizer_init=True)
    refusal = (
        "--tensor-parallel-size 3 does not fit this model: 4 attention heads do not divide by 3; "
        "2 KV heads do not divide by 3, and 3 is not a multiple of 2 (to replicate them); "
        "intermediate size 128 does not divide by 3; vocab size 512 does not divide by 3; valid sizes: 1, 2, 4."
    )
    (check,) = [c for c in checks if c.name == "tensor parallel"]
    assert check.status == "FAIL" and check.detail == refusal == tensor_parallel_error(TINY_CONFIGS["llama"], 3)
    assert any(c.name == "/dev/shm" for c in checks)

    def tp_line(n: int) -> Check:
        (c,) = [
            c
            for c in run_checks(model_dir, fast=True, tensor_parallel_size=n, skip_tokenizer_init=True)
            if c.name == "tensor parallel"
        ]
        return c

    assert tp_line(2) == Check(
        "tensor parallel", "ok", "2 GPUs: 4 attention heads split 2 per GPU, 2 KV heads split 1 per GPU", None
    )
    assert tp_line(4).detail == (
        "4 GPUs: 4 attention heads split 1 per GPU, 2 KV heads replicated (each on 2 GPUs, 1 per GPU)"
    )
    assert tp_line(0).status == "FAIL" and "must be at least 1 (got 0)" in tp_line(0).detail
    assert tp_line(8).detail.startswith("--tensor-parallel-size 8 does not fit this model: 4 attention heads do not")


def test_pipeline_parallel_shows_serves_split_and_refusal(model_dir):
    from pagoda.config.parallel import pipeline_parallel_error

    layers = TINY_CONFIGS["llama"]["num_hidden_layers"]

    def pp_line(n: int) -> Check:
        checks = run_checks(model_dir, fast=True, pipeline_parallel_size=n, skip_tokenizer_init=True)
        assert any(c.name == "/dev/shm" for c in checks)
        (c,) = [c for c in checks if c.name == "pipeline parallel"]
        return c

    assert pp_line(layers) == Check(
        "pipeline parallel",
        "ok",
        f"{layers} stages: "
        + "; ".join(f"stage {i}: layers {i}-{i}" for i in range(layers))
        + f" (embedding on stage 0, LM head on {layers - 1})",
        None,
    )
    too_many = pp_line(layers + 1)
    assert too_many.status == "FAIL" and too_many.detail == pipeline_parallel_error(TINY_CONFIGS["llama"], layers + 1)


def test_tensor_parallel_of_qwen2vl_ignores_the_vision_heads():
    from tests.unit.test_plan import QWEN2VL_72B

    # 32 does not divide the vision tower's 16 heads, but the tower is replicated: only the text model counts.
    cfg = dict(QWEN2VL_72B, vision_config=dict(QWEN2VL_72B["vision_config"], num_heads=16))
    assert check_tensor_parallel(cfg, 32) == Check(
        "tensor parallel",
        "ok",
        "32 GPUs: 64 attention heads split 2 per GPU, 8 KV heads replicated (each on 4 GPUs, 1 per GPU); "
        "the vision tower is replicated on every GPU",
        None,
    )
    assert check_tensor_parallel(cfg, 3).detail.endswith("valid sizes: 1, 2, 4, 8, 16, 32, 64.")


def test_a_crashing_check_becomes_a_fail_line(model_dir, monkeypatch):
    def boom(state):
        raise RuntimeError("disk exploded")

    monkeypatch.setattr(doctor_run, "check_disk", boom)
    checks = run_checks(model_dir, fast=True)
    assert "unexpected error: RuntimeError: disk exploded" in line_of(checks, "disk")
    assert any(c.name == "tokenizer" and c.status == "ok" for c in checks)  # the others still ran


def test_report_format_and_cli(model_dir, capsys):
    report = format_report(
        [Check("a", "ok", "fine", None), Check("b", "warn", "hmm", "do x"), Check("c", "FAIL", "bad", "do y")]
    )
    assert report.splitlines() == ["[ ok ] a: fine", "[warn] b: hmm → do x", "[FAIL] c: bad → do y"]
    assert doctor.main([model_dir, "--device", "cpu"]) == 0
    assert "[FAIL]" not in capsys.readouterr().out
    assert doctor.main(["--model", model_dir, "--fast", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["counts"]["FAIL"] == 0 and {"name", "status", "detail", "fix"} <= set(out["checks"][0])
    assert doctor.main([model_dir, "--fast", "-tp", "3", "--distributed-executor-backend", "ray"]) == 1
    assert "[FAIL] tensor parallel: --tensor-parallel-size 3 does not fit this model" in capsys.readouterr().out


def test_serve_preflight_raises_with_the_fail_lines(model_dir):
    from pagoda.config import EngineArgs
    from pagoda.config.server import ServerConfig
    from pagoda.errors import ConfigError

    engine, server = EngineArgs(model=model_dir), ServerConfig(port=None)  # type: ignore[arg-type]
    assert not fails(serve_preflight(engine, server))
    os.remove(os.path.join(model_dir, shard_names(model_dir)[0]))
    with pytest.raises(ConfigError, match=r"\[FAIL\] shards: .*model-00001-of-00005.safetensors"):
        serve_preflight(engine, server)
    three = EngineArgs(model=model_dir, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match=r"\[FAIL\] tensor parallel: --tensor-parallel-size 3 does not fit this"):
        serve_preflight(three, server)


def test_serve_keeps_the_tokenizer_its_preflight_loaded(model_dir, monkeypatch):
    """`pagoda serve`'s checks load the tokenizer once: the launcher's setup keeps the preflight's when it came from
    the path the engine uses, and loads its own otherwise."""
    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.config.multimodal import MultiModalConfig
    from pagoda.config.server import ServerConfig
    from pagoda.launch.preflight import preflight_keeping_tokenizer
    from pagoda.server import api_process

    engine, server = EngineArgs(model=model_dir), ServerConfig(port=None)  # type: ignore[arg-type]
    config = EngineConfig.create(engine)
    path, tokenizer = preflight_keeping_tokenizer(engine, server)
    assert path == config.model.tokenizer and tokenizer.encode("hello world")
    loads: list[str] = []
    real = api_process.load_tokenizer
    monkeypatch.setattr(api_process, "load_tokenizer", lambda *a, **k: loads.append(a[1]) or real(*a, **k))
    kept = api_process.ApiSetup(server, config, MultiModalConfig(), check=False, preflight=lambda: (path, tokenizer))
    assert kept.tokenizer is tokenizer and loads == []
    elsewhere = lambda: ("/another/folder", tokenizer)  # noqa: E731
    own = api_process.ApiSetup(server, config, MultiModalConfig(), check=False, preflight=elsewhere)
    assert own.tokenizer is not tokenizer and loads == [config.model.tokenizer]


def test_default_gguf_model():
    checks = run_checks(None, fast=True, skip_tokenizer_init=True)
    assert not fails(checks), format_report(checks)
    assert "GGUF" in checks[0].detail and "single GGUF file" in next(c for c in checks if c.name == "shards").detail


def _simulate_one_gpu(monkeypatch, free_gib: int) -> None:
    """torch.cuda answers as for one 140 GiB GPU with `free_gib` free (no GPU here), CUDA_VISIBLE_DEVICES unset."""
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake H200")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (free_gib * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_gpu_checks_with_a_simulated_gpu(model_dir, monkeypatch):
    """No GPU here: torch.cuda's answers are simulated to run the GPU branch (one busy GPU, TP 2)."""
    _simulate_one_gpu(monkeypatch, free_gib=100)
    checks = run_checks(model_dir, tensor_parallel_size=2, skip_tokenizer_init=True)
    by_name = {c.name: c for c in checks}
    assert by_name["cuda"].status == "ok" and "1 GPU(s) visible" in by_name["cuda"].detail
    assert "needs 2 GPUs but 1 is visible (CUDA_VISIBLE_DEVICES is not set)" in line_of(checks, "gpus")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    checks = run_checks(model_dir, tensor_parallel_size=2, skip_tokenizer_init=True)
    assert "needs 2 GPUs but 1 is visible (CUDA_VISIBLE_DEVICES=3)" in line_of(checks, "gpus")
    ray = run_checks(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray", skip_tokenizer_init=True)
    assert [c.status for c in ray if c.name == "gpus"] == ["ok"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert by_name["gpu 0"].status == "warn" and "100.00 GiB free of 140.00 GiB" in by_name["gpu 0"].detail
    assert by_name["bf16"].status == "ok"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    checks = run_checks(model_dir, device="cuda", skip_tokenizer_init=True)
    assert "--device cuda" in line_of(checks, "cuda")
    assert [c.status for c in run_checks(model_dir, skip_tokenizer_init=True) if c.name == "cuda"] == ["warn"]


def test_gpus_for_pipeline_stages_are_refused_by_serve_and_doctor_in_the_same_words(model_dir, monkeypatch):
    """One simulated GPU, -tp 1 -pp 2: serve refuses the 2 ranks (config/engine.py) and doctor's gpus line is
    that refusal, naming both sizes (not a tensor-parallel size of 2)."""
    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.config import engine as engine_config
    from pagoda.errors import ConfigError

    monkeypatch.setattr(engine_config, "_cuda_available", lambda: True)
    _simulate_one_gpu(monkeypatch, free_gib=140)
    what = "--tensor-parallel-size 1 x --pipeline-parallel-size 2 needs 2 GPUs but 1 is visible"
    with pytest.raises(ConfigError) as refusal:
        EngineConfig.create(EngineArgs(model=model_dir, device="cuda", pipeline_parallel_size=2))
    assert refusal.value.message == (
        f"{what} (CUDA_VISIBLE_DEVICES is not set); lower the parallel sizes or expose more GPUs."
    )
    assert refusal.value.param == "tensor_parallel_size"
    # tp x pp, not tp alone: -tp 2 -pp 2 needs 4
    with pytest.raises(ConfigError, match="--tensor-parallel-size 2 x --pipeline-parallel-size 2 needs 4 GPUs"):
        EngineConfig.create(
            EngineArgs(model=model_dir, device="cuda", tensor_parallel_size=2, pipeline_parallel_size=2)
        )
    checks = run_checks(model_dir, device="cuda", pipeline_parallel_size=2, skip_tokenizer_init=True)
    (gpus,) = [c for c in checks if c.name == "gpus"]
    assert gpus.status == "FAIL"
    assert f"{gpus.detail}; {gpus.fix}." == refusal.value.message
    assert "[FAIL] gpus: " + what in line_of(checks, "gpus")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # enough GPUs: neither refuses
    assert not [
        c for c in run_checks(model_dir, pipeline_parallel_size=2, skip_tokenizer_init=True) if c.name == "gpus"
    ]
    assert EngineConfig.create(EngineArgs(model=model_dir, device="cuda", pipeline_parallel_size=2)).parallel


def test_pipeline_stages_agree_with_plan(model_dir, capsys):
    """-tp 2 -pp 2 on the tiny Llama: doctor's pipeline line gives each stage's layers, weights and KV per GPU,
    the very numbers `pagoda plan` gives (in the dtype serve would load: float32 on the CPU, else bfloat16)."""
    from pagoda.tools.plan import add_plan_args, describe_stage, make_plan, run_plan

    def pp_line(device: str) -> str:
        checks = run_checks(
            model_dir, device=device, tensor_parallel_size=2, pipeline_parallel_size=2, skip_tokenizer_init=True
        )
        (c,) = [c for c in checks if c.name == "pipeline parallel"]
        assert c.status == "ok", c
        return c.detail

    parser = argparse.ArgumentParser()
    add_plan_args(parser)
    assert run_plan(parser.parse_args([model_dir, "-tp", "2", "-pp", "2", "--gpu", "h200", "--json"])) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert [(st["first_layer"], st["last_layer"]) for st in stages] == [(0, 0), (1, 1)]
    # Stage 0 holds the embedding, stage 1 the norm and the head (tied: its own copy): per GPU, half of each
    # (the vocab split 2 ways) plus half of its one layer, in bfloat16.
    hidden, vocab, inter = 64, 512, 128
    layer = (hidden * (hidden + 2 * 32) + hidden * hidden + 3 * hidden * inter) // 2 * 2 + 2 * hidden * 2
    assert stages[0]["weights_bytes_per_gpu"] == vocab * hidden + layer
    assert stages[1]["weights_bytes_per_gpu"] == vocab * hidden + layer + hidden * 2
    assert [st["kv_bytes_per_token_per_gpu"] for st in stages] == [2 * 1 * 16 * 2] * 2  # K, V of 1 KV head a GPU
    gpu = pp_line("cuda")
    assert gpu.startswith("2 stages of 2 GPUs (bfloat16): ")
    assert all(f"stage {i}: {describe_stage(st)}" in gpu for i, st in enumerate(stages)), gpu
    assert "stage 0: layers 0-0, 68.25 KiB of weights and 64 B of KV per token per GPU" in gpu
    cpu = make_plan(
        TINY_CONFIGS["llama"], device="cpu", dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2
    )
    line = pp_line("cpu")
    assert line.startswith("2 stages of 2 GPUs (float32): ")
    assert all(f"stage {i}: {describe_stage(st)}" in line for i, st in enumerate(cpu.stages)), line
    assert [st["weights_bytes_per_gpu"] for st in cpu.stages] == [2 * st["weights_bytes_per_gpu"] for st in stages]
    # serve's fast preflight builds no model: the layers alone
    fast = run_checks(model_dir, fast=True, tensor_parallel_size=2, pipeline_parallel_size=2, skip_tokenizer_init=True)
    assert "of weights" not in next(c for c in fast if c.name == "pipeline parallel").detail
