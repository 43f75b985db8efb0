"""`pagoda plan` arithmetic against hand computations, and against what the engine really allocates."""

from __future__ import annotations

import argparse
import json

import pytest

from pagoda.errors import ConfigError
from pagoda.tools.plan import GPU_MEMORY_GIB, add_plan_args, format_plan, make_plan, run_plan

KiB, GiB = 1024, 1 << 30

YUAN2_2B = dict(
    architectures=["YuanForCausalLM"],
    model_type="yuan",
    hidden_size=2048,
    num_hidden_layers=24,
    num_attention_heads=32,
    intermediate_size=8192,
    vocab_size=135040,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
YUAN2_102B = dict(
    YUAN2_2B,
    num_hidden_layers=84,
    hidden_size=8192,
    num_attention_heads=64,
    intermediate_size=32768,
    max_position_embeddings=4096,
)
QWEN2VL_7B = dict(
    architectures=["Qwen2VLForConditionalGeneration"],
    model_type="qwen2_vl",
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    vocab_size=152064,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    tie_word_embeddings=False,
    vision_config={"hidden_size": 3584, "in_chans": 3, "model_type": "qwen2_vl", "spatial_patch_size": 14},
)
QWEN2VL_72B = dict(
    QWEN2VL_7B,
    hidden_size=8192,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=29568,
    vision_config=dict(QWEN2VL_7B["vision_config"], hidden_size=8192),
)
H200 = int(GPU_MEMORY_GIB["h200"] * GiB)


def test_yuan2_2b_kv_and_lf_state():
    plan = make_plan(YUAN2_2B, memory_bytes_per_gpu=H200)
    assert plan.kv_bytes_per_token == 2 * 24 * 32 * 64 * 2 == 192 * KiB
    assert plan.state_bytes_per_sequence == 24 * (2048 + 1024) * 2  # 144 KiB
    # 24 x (4H^2 attention + 3 x H x 4H MLP + 2 H^2 LF) + embedding (tied), in bf16
    params = 24 * (4 * 2048**2 + 3 * 2048 * 8192 + 2 * 2048**2) + 135040 * 2048
    norms_and_biases = 24 * (3 * 2048 + 1024 + 2048) + 2048
    assert plan.weights_bytes_total == 2 * (params + norms_and_biases)
    # Every divisor of the 32 heads: powers of 2, within the vocab's 2^7 (135040 = 2^7 * 5 * 211) and 2^13.
    assert plan.valid_tensor_parallel_sizes == [1, 2, 4, 8, 16, 32]
    assert plan.tensor_parallel_problems == []


def test_qwen2vl_7b_and_72b():
    plan = make_plan(QWEN2VL_7B, memory_bytes_per_gpu=int(GPU_MEMORY_GIB["a100-80g"] * GiB), image=(1000, 750))
    assert plan.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 56 * KiB
    assert plan.state_bytes_per_sequence == 0
    # 28 heads: 7 and 14 split neither the 4 KV heads nor the vocab; 28 (KV replicated) fails vocab and MLP.
    assert plan.valid_tensor_parallel_sizes == [1, 2, 4]
    assert plan.image_tokens == 972 and plan.image_tokens_per_request == 974
    assert 8.2e9 < plan.weights_bytes_total / 2 < 8.4e9  # 8.3 B parameters (model card)

    big = make_plan(QWEN2VL_72B, memory_bytes_per_gpu=H200, tensor_parallel_size=4)
    assert big.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 320 * KiB
    assert big.kv_bytes_per_token_per_gpu == 80 * KiB
    # The vision tower (16 heads) is replicated, so it limits nothing: every power of 2 up to the 64 heads.
    assert big.valid_tensor_parallel_sizes == [1, 2, 4, 8, 16, 32, 64]
    assert 72e9 < big.weights_bytes_total / 2 < 74e9


def test_yuan2_102b_on_8_gpus():
    plan = make_plan(YUAN2_102B, memory_bytes_per_gpu=H200, tensor_parallel_size=8)
    assert plan.kv_bytes_per_token == 2 * 84 * 64 * 128 * 2  # 2.625 MiB
    assert plan.kv_bytes_per_token_per_gpu == plan.kv_bytes_per_token // 8  # 336 KiB
    # The LF convolutions (2 H^2 per layer) are replicated on every GPU (docs/models.md, Yuan2: tensor parallelism).
    lf = 84 * 2 * 8192**2 * 2
    assert plan.weights_bytes_per_gpu > lf + (plan.weights_bytes_total - lf) // 8 - 1
    assert plan.fits_one_max_len_request
    single = make_plan(YUAN2_102B, memory_bytes_per_gpu=H200)
    assert not single.fits_one_max_len_request and single.kv_blocks == 0


def test_yuan2_102b_as_4_gpus_by_2_stages():
    """The same 8 GPUs as 2 pipeline stages of TP = 4: 42 layers a stage, the embedding on stage 0 and the
    head on stage 1 (Yuan2 ties them: each stage holds its own copy), KV per GPU of the 42 layers at 4-way."""
    tp8 = make_plan(YUAN2_102B, memory_bytes_per_gpu=H200, tensor_parallel_size=8)
    plan = make_plan(YUAN2_102B, memory_bytes_per_gpu=H200, tensor_parallel_size=4, pipeline_parallel_size=2)
    assert [(st["first_layer"], st["last_layer"]) for st in plan.stages] == [(0, 41), (42, 83)]
    embedding = YUAN2_102B["vocab_size"] * YUAN2_102B["hidden_size"] * 2
    assert plan.weights_bytes_total == tp8.weights_bytes_total + embedding  # the head's own copy on stage 1
    # Half the layers on 4 GPUs is about what all the layers on 8 hold: the same weights per GPU within
    # the replicated LF convolutions (each GPU keeps only its stage's).
    assert abs(plan.weights_bytes_per_gpu - tp8.weights_bytes_per_gpu) < tp8.weights_bytes_per_gpu * 0.25
    assert plan.kv_bytes_per_token_per_gpu == (2 * 42 * 64 * 128 * 2) // 4
    assert plan.kv_bytes_per_token == tp8.kv_bytes_per_token  # the whole model's, all 84 layers
    assert [st["kv_bytes_per_token_per_gpu"] for st in plan.stages] == [(2 * 42 * 64 * 128 * 2) // 4] * 2
    odd = make_plan(YUAN2_102B, memory_bytes_per_gpu=H200, tensor_parallel_size=8, pipeline_parallel_size=5)
    assert [st["last_layer"] - st["first_layer"] + 1 for st in odd.stages] == [17, 17, 17, 17, 16]
    per_layer = 2 * 64 * 128 * 2 // 8  # K and V of one layer per token, 64 heads split 8 ways
    assert [st["kv_bytes_per_token_per_gpu"] for st in odd.stages] == [17 * per_layer] * 4 + [16 * per_layer]
    assert plan.weights_bytes_per_gpu == max(st["weights_bytes_per_gpu"] for st in plan.stages)
    assert "pipeline stages: 0: layers 0-41, " in format_plan(plan) and "pp=2" in format_plan(plan)
    with pytest.raises(ConfigError, match="85 stages"):
        make_plan(YUAN2_102B, memory_bytes_per_gpu=H200, pipeline_parallel_size=85)


def test_invalid_size_gives_the_reasons_and_still_the_numbers():
    plan = make_plan(QWEN2VL_7B, memory_bytes_per_gpu=H200, tensor_parallel_size=7)
    assert plan.tensor_parallel_problems == [
        "4 KV heads do not divide by 7, and 7 is not a multiple of 4 (to replicate them)",
        "intermediate size 18944 does not divide by 7",
        "vocab size 152064 does not divide by 7",
    ]
    text = format_plan(plan)
    assert "valid --tensor-parallel-size: 1, 2, 4\n" in text
    assert "note: --tensor-parallel-size 7 does not fit this model: 4 KV heads do not divide by 7" in text
    assert plan.kv_blocks > 0 and plan.weights_bytes_per_gpu < plan.weights_bytes_total
    # 28 splits the heads and replicates the KV heads: the reasons are the vocab and the MLP only.
    assert make_plan(QWEN2VL_7B, memory_bytes_per_gpu=H200, tensor_parallel_size=28).tensor_parallel_problems == [
        "intermediate size 18944 does not divide by 28",
        "vocab size 152064 does not divide by 28",
    ]
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 0 does not fit .*at least 1"):
        make_plan(QWEN2VL_7B, memory_bytes_per_gpu=H200, tensor_parallel_size=0)


@pytest.mark.parametrize(
    ("knobs", "refusal"),
    [
        (
            {"max_model_len": 9000},
            r"max_model_len=9000 is larger than the model's maximum context \(8192 from config.json\)",
        ),
        ({"max_model_len": 0}, "max_model_len must be >= 1, got 0"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1, got 0"),
    ],
)
def test_a_value_serve_refuses_is_refused_with_serves_line(knobs, refusal):
    """The engine's resolvers, not a copy: what `EngineConfig.create` refuses, plan refuses in the same words."""
    with pytest.raises(ConfigError, match=refusal) as info:
        make_plan(YUAN2_2B, memory_bytes_per_gpu=H200, **knobs)
    assert info.value.param == next(iter(knobs))


def test_the_engine_flags_default_as_serve_does():
    from pagoda.config import EngineArgs

    parser = argparse.ArgumentParser()
    add_plan_args(parser)
    ns, engine = parser.parse_args(["m"]), EngineArgs()
    for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens", "cpu_kv_cache_space_gib"):
        assert getattr(ns, name) == getattr(engine, name), name
    assert (ns.tp, ns.pp, ns.quantization, ns.kv_cache_dtype) == (
        engine.tensor_parallel_size,
        engine.pipeline_parallel_size,
        engine.quantization,
        engine.kv_cache_dtype,
    )
    assert ns.enable_prefix_caching == engine.enable_prefix_caching
    plan = make_plan(YUAN2_2B, memory_bytes_per_gpu=H200)
    assert plan.gpu_memory_utilization == 0.9 and plan.max_num_batched_tokens == 8192  # the engine's resolved defaults


def _replicated_bytes(cfg) -> tuple[int, int]:
    """(total, replicated) weight bytes, from the per-GPU weights at TP 2 and 4: W(tp) = R + (T - R) / tp."""
    w2, w4 = (make_plan(cfg, memory_bytes_per_gpu=H200, tensor_parallel_size=tp) for tp in (2, 4))
    return w2.weights_bytes_total, w2.weights_bytes_total - 4 * (w2.weights_bytes_per_gpu - w4.weights_bytes_per_gpu)


def test_qwen2vl_vision_tower_and_replicated_kv_heads_count_on_every_gpu():
    # The ViT (32 blocks of 1280 wide: ~0.63 B) and its merger (~0.04 B): the model card's 675 M, on every GPU.
    _, replicated = _replicated_bytes(QWEN2VL_7B)
    assert 670e6 < replicated / 2 < 690e6
    # TP 16 over 8 KV heads: each GPU holds one whole KV head's K and V projections (80 layers x 2 x 128 x 8192),
    # twice the 1/16 share an even split would give.
    total, replicated = _replicated_bytes(QWEN2VL_72B)
    even = replicated + (total - replicated) // 16
    kv_head = 80 * 2 * 128 * 8192 * 2
    tp16 = make_plan(QWEN2VL_72B, memory_bytes_per_gpu=H200, tensor_parallel_size=16)
    assert abs(tp16.weights_bytes_per_gpu - (even + kv_head // 2)) < 16


def _run_plan(folder, *argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_plan_args(parser)
    return run_plan(parser.parse_args([str(folder), "--gpu", "h200", *argv]))


def test_cli_exit_status_follows_the_requested_size(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2VL_7B))
    assert _run_plan(tmp_path, "--tensor-parallel-size", "4") == 0
    assert "valid --tensor-parallel-size: 1, 2, 4" in capsys.readouterr().out
    assert _run_plan(tmp_path, "--tp", "8", "--json") == 1
    out = json.loads(capsys.readouterr().out)
    # 8 replicates the 4 KV heads, and divides 18944 = 2^9 * 37 and 152064 = 2^9 * 297: the heads alone refuse.
    assert out["tensor_parallel_problems"] == ["28 attention heads do not divide by 8"]
    assert out["valid_tensor_parallel_sizes"] == [1, 2, 4] and out["kv_blocks"] > 0


def _planned_blocks(engine) -> int:
    """What `pagoda plan` predicts for the engine's own configuration."""
    cfg = engine.config
    return make_plan(
        cfg.model.hf_config,
        device=cfg.device.device,
        gpu_memory_utilization=cfg.cache.gpu_memory_utilization,
        max_model_len=cfg.model.max_model_len,
        dtype=cfg.model.dtype,
        block_size=cfg.cache.block_size,
        max_num_seqs=cfg.scheduler.max_num_seqs,
        max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
        enable_prefix_caching=cfg.cache.enable_prefix_caching,
        cpu_kv_cache_space_gib=cfg.cache.cpu_kv_cache_space_gib,
    ).kv_blocks


def test_cpu_plan_equals_engine_allocation(tiny_llama):
    from pagoda import LLM

    llm = LLM(
        model=tiny_llama, skip_tokenizer_init=True, max_model_len=512, cpu_kv_cache_space_gib=0.001, max_num_seqs=64
    )
    assert _planned_blocks(llm.engine) == llm.engine.kv_layout.num_blocks - 1


@pytest.mark.parametrize("fixture", ["yuan2-tiny", "yuan2-m32-tiny"])
def test_cpu_plan_equals_engine_allocation_with_lf_state(fixture):
    from pagoda import LLM
    from tests.conftest import FIXTURES

    llm = LLM(model=str(FIXTURES / fixture), skip_tokenizer_init=True, cpu_kv_cache_space_gib=0.002, max_num_seqs=4)
    assert _planned_blocks(llm.engine) == llm.engine.kv_layout.num_blocks - 1


def test_a_model_too_big_for_one_gpu_is_said_not_to_fit_instead_of_a_zero_recommendation():
    single = make_plan(QWEN2VL_72B, memory_bytes_per_gpu=H200)  # ~145 GB of bf16 weights on one 141 GB card
    assert single.kv_blocks == 0 and single.recommended_max_num_seqs is None
    text = format_plan(single)
    assert "--max-num-seqs 0" not in text
    assert "recommended --max-num-seqs: none, the model does not fit" in text
    assert "note: the model does not fit on one GPU" in text and "--tp" in text
    assert "lower --max-model-len" not in text  # a shorter context cannot make the weights fit
    assert make_plan(QWEN2VL_72B, memory_bytes_per_gpu=H200, tensor_parallel_size=4).recommended_max_num_seqs


def test_serves_spellings_of_the_flags():
    """`pagoda plan` takes the flags as `pagoda serve` spells them (and its own short --tp / --pp)."""
    parser = argparse.ArgumentParser()
    add_plan_args(parser)
    argv = ["m", "-tp", "2", "-pp", "4", "--cpu-offload-gb", "1.5", "--enable-lora", "--max-loras", "3"]
    ns = parser.parse_args([*argv, "--max-lora-rank", "32"])
    assert (ns.tp, ns.pp, ns.cpu_offload_gb, ns.enable_lora, ns.max_loras, ns.max_lora_rank) == (2, 4, 1.5, True, 3, 32)
    for tp, pp in (["--tensor-parallel-size", "--pipeline-parallel-size"], ["--tp", "--pp"]):
        assert (lambda ns: (ns.tp, ns.pp))(parser.parse_args(["m", tp, "8", pp, "2"])) == (8, 2)
    ns = parser.parse_args(["m"])
    assert (ns.cpu_offload_gb, ns.enable_lora) == (0, False)


QWEN2VL_7B_LAYER = 2 * (  # one decoder layer in bfloat16: q, o; k, v (4 KV heads of 128); q/k/v biases; MLP; norms
    2 * 3584 * 3584 + 2 * 512 * 3584 + (3584 + 2 * 512) + 3 * 3584 * 18944 + 2 * 3584
)


def test_cpu_offload_moves_serves_layers_to_host_memory():
    """--cpu-offload-gb 4 on one L4: serve moves the fewest whole layers that reach 4 GiB (10 of 0.43 GiB), whose
    weights then alias two GPU slots of one layer each: the GPU keeps 8 layers' bytes less, and the KV cache
    grows by them."""
    l4 = int(GPU_MEMORY_GIB["l4"] * GiB)
    plain = make_plan(QWEN2VL_7B, memory_bytes_per_gpu=l4)
    plan = make_plan(QWEN2VL_7B, memory_bytes_per_gpu=l4, cpu_offload_gb=4)
    assert plan.offloaded_bytes_per_gpu == 10 * QWEN2VL_7B_LAYER
    assert plain.weights_bytes_per_gpu - plan.weights_bytes_per_gpu == 8 * QWEN2VL_7B_LAYER
    assert plan.weights_bytes_total == plain.weights_bytes_total
    per_block = 16 * plan.kv_bytes_per_token_per_gpu
    assert abs(plan.kv_blocks - plain.kv_blocks - 8 * QWEN2VL_7B_LAYER // per_block) <= 1
    assert "(4.34 GiB more in host memory: --cpu-offload-gb 4)" in format_plan(plan)
    # Each pipeline stage offloads from its own 14 layers.
    staged = make_plan(QWEN2VL_7B, memory_bytes_per_gpu=l4, pipeline_parallel_size=2, cpu_offload_gb=4)
    assert [st["offloaded_bytes_per_gpu"] for st in staged.stages] == [10 * QWEN2VL_7B_LAYER] * 2


def test_cpu_offload_on_the_cpu_is_refused_with_serves_line(tmp_path):
    from pagoda.config import EngineArgs, EngineConfig

    (tmp_path / "config.json").write_text(json.dumps(YUAN2_2B))
    with pytest.raises(ConfigError) as serve:
        EngineConfig.create(EngineArgs(model=str(tmp_path), device="cpu", cpu_offload_gb=4))
    with pytest.raises(ConfigError) as plan:
        _run_plan(tmp_path, "--device", "cpu", "--cpu-offload-gb", "4")
    assert (plan.value.message, plan.value.param) == (serve.value.message, serve.value.param)
    assert "--cpu-offload-gb" in plan.value.message and "\n" not in plan.value.message
    with pytest.raises(ConfigError, match="cpu_offload_gb must be >= 0, got -1"):
        make_plan(YUAN2_2B, memory_bytes_per_gpu=H200, cpu_offload_gb=-1)


def test_lora_slots_come_before_the_kv_cache(tmp_path):
    from pagoda.config.lora import resolve_lora

    (tmp_path / "config.json").write_text(json.dumps(QWEN2VL_7B))
    lora = resolve_lora(True, 4, 64, None, "auto")
    plain = make_plan(QWEN2VL_7B, memory_bytes_per_gpu=H200)
    plan = make_plan(QWEN2VL_7B, memory_bytes_per_gpu=H200, lora=lora)
    # 28 layers: q/k/v (3 parts) and gate/up (2 parts) share their input, o and down do not; A [parts, 4, 64, in],
    # B [4, out, 64] in bfloat16 (+ small int32 mappings).
    a = 3 * 3584 + 3584 + 2 * 3584 + 18944
    b = (3584 + 2 * 512) + 3584 + 2 * 18944 + 3584
    slots = 28 * 4 * 64 * (a + b) * 2
    assert slots < plan.lora_bytes_per_gpu < slots + 2**20
    per_block = 16 * plan.kv_bytes_per_token_per_gpu
    assert abs(plain.kv_blocks - plan.kv_blocks - plan.lora_bytes_per_gpu // per_block) <= 1
    assert "LoRA slots: " in format_plan(plan) and plain.lora_bytes_per_gpu == 0
    # --enable-tower-connector-lora: the patch embedding (3·2·14·14 = 1176 -> 1280), the vision tower's 32 blocks
    # (qkv, proj, fc1, fc2 at width 1280, MLP 5120) and the merger's two MLP layers (5120 -> 5120 -> 3584) take
    # slots as well.
    with_tower = make_plan(
        QWEN2VL_7B, memory_bytes_per_gpu=H200, lora=resolve_lora(True, 4, 64, None, "auto", tower_connector=True)
    )
    blocks = 32 * ((3 * 1280 + 5120) + (3840 + 1280 + 5120 + 1280))
    tower = 4 * 64 * 2 * ((1176 + 1280) + blocks + (2 * 5120) + (5120 + 3584))
    assert tower < with_tower.lora_bytes_per_gpu - plan.lora_bytes_per_gpu < tower + 2**16
    with pytest.raises(ConfigError, match=r"max_lora_rank must be in \[1, 512\], got 1000"):
        _run_plan(tmp_path, "--enable-lora", "--max-lora-rank", "1000")


@pytest.mark.parametrize(
    "fixture",
    ["tiny_llama", "yuan2-tiny", "yuan2-m32-tiny", "yuan2-m32-tiny attention only", "qwen2-vl with the tower"],
)
def test_lora_slots_equal_the_runners_allocation(fixture, request, tmp_path):
    """What the runner allocates for --max-loras 3 --max-lora-rank 8 (its LoRAManager's slot tensors, on a
    tiny random model on the CPU) is what plan counts; Qwen2-VL's vision tower's slots too, when asked for, and
    only the layers --lora-target-modules names when it is given (an M32's experts are most of its slots)."""
    from pagoda import LLM
    from pagoda.config.lora import resolve_lora
    from tests.conftest import FIXTURES, tiny_qwen2vl_config

    tower = fixture.startswith("qwen2-vl")
    if tower:
        import transformers

        transformers.Qwen2VLForConditionalGeneration(tiny_qwen2vl_config()).save_pretrained(tmp_path)
        model = str(tmp_path)
    else:
        model = request.getfixturevalue(fixture) if fixture == "tiny_llama" else str(FIXTURES / fixture.split()[0])
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if fixture.endswith("attention only") else None
    llm = LLM(
        enable_tower_connector_lora=tower,
        lora_target_modules=targets,
        model=model,
        skip_tokenizer_init=True,
        max_model_len=256,
        cpu_kv_cache_space_gib=0.002,
        max_num_seqs=4,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
    )
    manager = llm.engine.runner.lora
    held = [t for slots in manager.layers.values() for t in (slots.a, slots.b, slots.bounds)] + [manager.step.meta]
    cfg = llm.engine.config
    plan = make_plan(
        cfg.model.hf_config,
        device="cpu",
        dtype=cfg.model.dtype,
        max_model_len=cfg.model.max_model_len,
        max_num_seqs=cfg.scheduler.max_num_seqs,
        max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
        cpu_kv_cache_space_gib=cfg.cache.cpu_kv_cache_space_gib,
        lora=cfg.lora,
    )
    assert plan.lora_bytes_per_gpu == sum(t.numel() * t.element_size() for t in held) > 0
    expected = resolve_lora(True, 3, 8, None, "auto", tower, target_modules=targets)
    assert (plan.max_loras, plan.max_lora_rank) == (3, 8) and cfg.lora == expected
    assert any("experts" in name for name in manager.layers) == (fixture == "yuan2-m32-tiny")
    assert any("visual" in name for name in manager.layers) == tower
    # On the CPU the KV budget is its own (--cpu-kv-cache-space-gib): the slots do not shrink it, in plan as in
    # the engine.
    assert plan.kv_blocks == llm.engine.kv_layout.num_blocks - 1
