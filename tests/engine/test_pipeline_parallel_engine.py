"""Pipeline parallelism on the CPU (gloo), through the real engine: stage 0 (the driver) here, the other
stages' ranks spawned, activations sent stage to stage and the last stage's logits back to the driver.

References: the Yuan2 goldens (dense and M32, the official modeling code's continuations and logits) and the
single-stage engine (Llama, Qwen2): the same greedy tokens, logits within 1e-4 (fp32), through one batch,
chunked prefill that carries each stage's LF state across chunks, prefix-cache hits that restore it from the
stages' snapshots, and async scheduling; pipeline x tensor parallelism (2 x 2 ranks) as well.
"""

from __future__ import annotations

import pytest

from pagoda.config import EngineArgs, EngineConfig
from pagoda.errors import ConfigError
from tests.conftest import FIXTURES
from tests.engine.test_tensor_parallel_engine import (
    _prompts,
    against_one_rank,
    lora_against_peft,
    yuan2_lora_against_merged,
)
from tests.models.test_yuan_golden import _check_all


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["yuan2-tiny", "yuan2-m32-tiny"])
def test_yuan_pp2_matches_the_goldens_batched_chunked_and_cached(engines, name, tp):
    capture = engines(
        name,
        pipeline_parallel_size=2,
        tensor_parallel_size=tp,
        block_size=4,
        max_num_batched_tokens=16,
        async_scheduling=True,
    )
    model = capture.engine.runner.local.model
    held = [i for i, layer in enumerate(model.model.layers) if next(layer.parameters(), None) is not None]
    assert held == list(model.stage.layers) and len(held) < len(model.model.layers)  # stage 0's share only
    prompts = _prompts(name)
    _check_all(name, capture, capture.run(prompts))
    hits = capture.engine.stats().prefix_cache_hits
    _check_all(name, capture, capture.run(prompts, prefix="s"), prefix="s")  # LF state from snapshots
    assert capture.engine.stats().prefix_cache_hits > hits


@pytest.mark.parametrize("tp", [1, 2])
def test_llama_pp2_matches_one_stage(engines, tiny_llama, tp):
    against_one_rank(engines, tiny_llama, pipeline_parallel_size=2, tensor_parallel_size=tp)


def test_qwen2_pp2_with_tp2_matches_one_rank(engines, tiny_qwen2):
    against_one_rank(engines, tiny_qwen2, pipeline_parallel_size=2, tensor_parallel_size=2)


def test_lora_adapters_at_pp2_equal_peft_merged(engines, tmp_path):
    """Each stage holds the adapters' terms of its own layers (the driver checks the others' against a layer it
    holds); three adapters and the base in one batch give PEFT's merged models' greedy tokens."""
    lora_against_peft(engines, tmp_path, pipeline_parallel_size=2)


def test_qwen2_vl_tower_adapters_at_pp2_equal_peft_merged(engines, tmp_path):
    """The vision tower lives on the first stage, which reads and checks the adapters' tower terms; the last stage
    skips them."""
    from tests.models.test_lora_vision_tower import make_tower_adapters, run_tower_requests

    base, adapters, expected = make_tower_adapters(tmp_path)
    engine = engines(
        base, enable_lora=True, enable_tower_connector_lora=True, max_loras=2, max_lora_rank=8, pipeline_parallel_size=2
    ).engine
    assert run_tower_requests(engine, adapters) == {rid: tokens for rid, (_, tokens) in expected.items()}


@pytest.mark.parametrize("fixture", ["yuan2-tiny", "yuan2-m32-tiny"])
def test_yuan2_lora_at_pp2_equals_the_merged_checkpoint(engines, tmp_path, fixture):
    yuan2_lora_against_merged(engines, tmp_path, fixture, pipeline_parallel_size=2)


def test_more_stages_than_layers_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"--pipeline-parallel-size 9 does not fit this model: \d+ decoder layers"):
        EngineConfig.create(
            EngineArgs(model=str(FIXTURES / "yuan2-tiny"), skip_tokenizer_init=True, pipeline_parallel_size=9)
        )


def test_micro_batches_overlap_and_one_at_a_time_gives_the_same_tokens(engines, tiny_llama, monkeypatch):
    """On the CPU two stages keep two micro-batches in flight: a step is launched while the other is unread,
    never with a request that step owes a token; with PAGODA_PP_MICRO_BATCHES=0 the stages take turns (no
    step launched beside an unread one) and the tokens are the same."""
    prompts = [[(5 * i + 2 * j) % 400 + 3 for j in range(4 + 3 * i)] for i in range(6)]
    results, overlaps = [], []
    for switch in ("1", "0"):
        monkeypatch.setenv("PAGODA_PP_MICRO_BATCHES", switch)
        split = engines(tiny_llama, block_size=4, max_model_len=256, pipeline_parallel_size=2)
        engine, launch = split.engine, split.engine.runner.launch
        assert engine.config.scheduler.micro_batches == (2 if switch == "1" else 1)
        beside: list[int] = []

        def spy(so, engine=engine, launch=launch, beside=beside):
            owed = {rid for unread, _ in engine._inflight for rid in unread.sampling_request_ids}
            assert not owed & set(so.num_scheduled_tokens), "a step holds a request an unread step owes"
            beside.append(len(engine._inflight))
            return launch(so)

        monkeypatch.setattr(engine.runner, "launch", spy)
        results.append(split.run(prompts, max_tokens=10))
        overlaps.append(max(beside))
        engine.shutdown()  # one parallel group per process
    assert overlaps == [1, 0]
    assert results[0] == results[1]
