"""Which --tensor-parallel-size values each model accepts (pagoda/config/parallel.py), against lists worked out
by hand from the published configs: the factorizations below are the whole arithmetic."""

from __future__ import annotations

import ast
import dataclasses

import pytest

import pagoda.models
from pagoda.config.parallel import (
    ParallelConfig,
    pipeline_parallel_error,
    tensor_parallel_error,
    tensor_parallel_problems,
    valid_tensor_parallel_sizes,
)
from tests.unit.test_plan import QWEN2VL_7B, QWEN2VL_72B, YUAN2_2B, YUAN2_102B  # the published shapes

YUAN2_51B = dict(YUAN2_102B, num_hidden_layers=42)
YUAN2_M32 = dict(
    YUAN2_2B,
    num_attention_heads=16,
    attention_projection_size=4096,
    use_moe=True,
    moe_config=dict(moe_num_experts=32, moe_top_k=2, ffn_hidden_size=8192, norm_topk_prob=True),
)
SMOLLM2_135M = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
)
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
)


def test_the_factorizations_used_below():
    assert 135040 == 2**7 * 5 * 211  # Yuan2 vocab: divides by 2, 4 and 8
    assert 8192 == 2**13 and 32768 == 2**15  # Yuan2 intermediate / M32 ffn_hidden_size
    assert 152064 == 2**9 * 3**3 * 11  # Qwen2-VL vocab
    assert 18944 == 2**9 * 37 and 29568 == 2**7 * 3 * 7 * 11  # Qwen2-VL-7B / 72B intermediate
    assert 49152 == 2**14 * 3 and 1536 == 2**9 * 3  # SmolLM2 vocab / intermediate
    assert 128256 == 2**8 * 3 * 167 and 14336 == 2**11 * 7  # Llama-3 vocab / intermediate


@pytest.mark.parametrize(
    "cfg, expected",
    [
        # 32 heads: the divisors 1..32 are powers of 2, all within 2^7 (vocab) and 2^13 (intermediate).
        (YUAN2_2B, [1, 2, 4, 8, 16, 32]),
        # 64 heads: powers of 2 up to 64, within 2^7 (vocab) and 2^15 (intermediate).
        (YUAN2_51B, [1, 2, 4, 8, 16, 32, 64]),
        (YUAN2_102B, [1, 2, 4, 8, 16, 32, 64]),
        # 16 heads: powers of 2 up to 16, within 2^13 (ffn_hidden_size) and 2^7 (vocab).
        (YUAN2_M32, [1, 2, 4, 8, 16]),
        # 28 heads: divisors 1, 2, 4, 7, 14, 28. 7 and 14: 4 KV heads neither split nor replicate; 28 (a multiple
        # of 4: replicated KV) fails vocab (no factor 7) and intermediate (2^9 * 37).
        (QWEN2VL_7B, [1, 2, 4]),
        # 64 heads: powers of 2; 16..64 replicate the 8 KV heads; vocab 2^9 and intermediate 2^7 cover 64.
        # The vision tower's 16 heads do not limit it (replicated): 32 and 64 are valid.
        (QWEN2VL_72B, [1, 2, 4, 8, 16, 32, 64]),
        # 9 heads: divisors 1, 3, 9; 9 fails vocab (2^14 * 3) and intermediate (2^9 * 3).
        (SMOLLM2_135M, [1, 3]),
        # 32 heads: powers of 2 up to 32; 16 and 32 replicate the 8 KV heads; vocab 2^8, intermediate 2^11.
        (LLAMA3_8B, [1, 2, 4, 8, 16, 32]),
    ],
)
def test_valid_sizes(cfg, expected):
    assert valid_tensor_parallel_sizes(cfg) == expected
    for n in range(1, 2 * cfg["num_attention_heads"] + 1):
        assert (tensor_parallel_error(cfg, n) is None) == (n in expected), n


def test_qwen2vl_nested_text_config_gives_the_same_answer():
    text_keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
    nested = {k: v for k, v in QWEN2VL_72B.items() if k not in text_keys}
    nested["text_config"] = {k: QWEN2VL_72B[k] for k in text_keys}
    assert valid_tensor_parallel_sizes(nested) == [1, 2, 4, 8, 16, 32, 64]
    nested7 = {k: v for k, v in QWEN2VL_7B.items() if k not in text_keys}
    nested7["text_config"] = {k: QWEN2VL_7B[k] for k in text_keys}
    assert valid_tensor_parallel_sizes(nested7) == [1, 2, 4]
    # The text model's fields decide, not the vision tower's (its 16 heads and 1280 width do not divide by 32).
    assert tensor_parallel_problems(dict(QWEN2VL_72B, vision_config=dict(num_heads=16, embed_dim=1280)), 32) == []


def test_each_reason_is_named():
    assert tensor_parallel_problems(QWEN2VL_7B, 7) == [
        "4 KV heads do not divide by 7, and 7 is not a multiple of 4 (to replicate them)",
        "intermediate size 18944 does not divide by 7",
        "vocab size 152064 does not divide by 7",
    ]
    # 28 heads split and the 4 KV heads replicate 7 ways: only the MLP and the vocab refuse.
    assert tensor_parallel_problems(QWEN2VL_7B, 28) == [
        "intermediate size 18944 does not divide by 28",
        "vocab size 152064 does not divide by 28",
    ]
    # 128256 divides by 3 (digit sum 24): no vocab line.
    assert tensor_parallel_problems(LLAMA3_8B, 3) == [
        "32 attention heads do not divide by 3",
        "8 KV heads do not divide by 3, and 3 is not a multiple of 8 (to replicate them)",
        "intermediate size 14336 does not divide by 3",
    ]
    # Multi-head attention (KV heads = heads): one heads line, not a second KV line.
    assert tensor_parallel_problems(YUAN2_2B, 3) == [
        "32 attention heads do not divide by 3",
        "intermediate size 8192 does not divide by 3",
        "vocab size 135040 does not divide by 3",
    ]
    assert tensor_parallel_problems(SMOLLM2_135M, 9) == [
        "intermediate size 1536 does not divide by 9",
        "vocab size 49152 does not divide by 9",
    ]


def test_yuan_m32_checks_the_experts_not_the_unused_intermediate_size():
    odd_dense = dict(YUAN2_M32, intermediate_size=8190)  # unused by the MoE layers
    assert valid_tensor_parallel_sizes(odd_dense) == [1, 2, 4, 8, 16]
    odd_experts = dict(YUAN2_M32, moe_config=dict(YUAN2_M32["moe_config"], ffn_hidden_size=8200))  # 2^3 * 5^2 * 41
    assert valid_tensor_parallel_sizes(odd_experts) == [1, 2, 4, 8]
    assert tensor_parallel_problems(odd_experts, 16) == [
        "the experts' FFN size 8200 (moe_config.ffn_hidden_size) does not divide by 16"
    ]


def test_sizes_below_one_and_tp_1():
    for n in (0, -2):
        assert tensor_parallel_problems(LLAMA3_8B, n) == [f"the tensor parallel size must be at least 1 (got {n})"]
    assert tensor_parallel_problems({}, 1) == []  # TP 1 shards nothing, whatever the config
    assert tensor_parallel_problems({}, 2) == [
        "config.json gives no num_attention_heads, so the attention cannot be split"
    ]
    assert valid_tensor_parallel_sizes({}) == [1]


def test_the_startup_refusal_line():
    assert tensor_parallel_error(YUAN2_51B, 8) is None
    assert tensor_parallel_error(YUAN2_51B, 3) == (
        "--tensor-parallel-size 3 does not fit this model: 64 attention heads do not divide by 3; "
        "intermediate size 32768 does not divide by 3; vocab size 135040 does not divide by 3; "
        "valid sizes: 1, 2, 4, 8, 16, 32, 64."
    )
    assert tensor_parallel_error(SMOLLM2_135M, 2) == (
        "--tensor-parallel-size 2 does not fit this model: 9 attention heads do not divide by 2; "
        "3 KV heads do not divide by 2, and 2 is not a multiple of 3 (to replicate them); valid sizes: 1, 3."
    )
    assert "\n" not in (tensor_parallel_error(QWEN2VL_7B, 0) or "\n")


def test_pipeline_stages_need_a_decoder_layer_each():
    assert YUAN2_102B["num_hidden_layers"] > 2
    layers = YUAN2_51B["num_hidden_layers"]  # 42, Qwen2-VL's text layers nested under text_config too
    assert pipeline_parallel_error(YUAN2_51B, layers) is None and pipeline_parallel_error(YUAN2_51B, 1) is None
    assert pipeline_parallel_error(YUAN2_51B, layers + 1) == (
        f"--pipeline-parallel-size {layers + 1} does not fit this model: {layers} decoder layers cannot fill "
        f"{layers + 1} stages."
    )
    nested = {"architectures": ["Qwen2VLForConditionalGeneration"], "text_config": {"num_hidden_layers": 3}}
    assert "3 decoder layers cannot fill 4 stages" in (pipeline_parallel_error(nested, 4) or "")
    assert pipeline_parallel_error(YUAN2_51B, 0) == "--pipeline-parallel-size must be at least 1 (got 0)."


def test_stage_layers_are_balanced_with_the_extra_ones_first():
    from pagoda.distributed.parallel_state import stage_layers

    assert [list(stage_layers(7, s, 3)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(stage_layers(80, s, 3)) for s in range(3)] == [27, 27, 26]
    assert [stage_layers(24, s, 1) for s in range(1)] == [range(0, 24)]
    with pytest.raises(ValueError, match="2 decoder layers cannot be split into 3 pipeline stages"):
        stage_layers(2, 0, 3)


def test_parallel_config_is_a_resolved_section():
    fields = {f.name: f for f in dataclasses.fields(ParallelConfig)}
    assert set(fields) == {"tensor_parallel_size", "distributed_executor_backend", "pipeline_parallel_size"}
    assert all(f.default is dataclasses.MISSING and f.kw_only for f in fields.values())
    cfg = ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="mp", pipeline_parallel_size=3)
    assert cfg.world_size == 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tensor_parallel_size = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        ParallelConfig(2, "mp", 1)  # type: ignore[misc]


def _imports(module) -> set[str]:
    tree = ast.parse(open(module.__file__, encoding="utf-8").read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return imported | {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}


def test_imports_nothing_but_the_standard_library():
    """pagoda/config must import without torch (and config/engine.py imports this module): the only pagoda
    module it reads is the model families' facts, which imports nothing but the standard library."""
    import pagoda.config.parallel as module
    import pagoda.models.families as families

    assert _imports(module) == {"__future__", "dataclasses", "typing", "pagoda.models.families"}
    assert _imports(families) == {"__future__", "collections.abc", "dataclasses", "typing"}
    assert open(pagoda.models.__file__, encoding="utf-8").read().strip() == ""  # the package imports nothing
