"""Tensor parallelism on the CPU (gloo), through the real engine: rank 0 here, the other ranks spawned.

The reference is the golden fixtures (Yuan2 dense and M32, made with the official modeling code) and the
TP = 1 engine (Llama with 2 KV heads split, then replicated at TP = 4; Qwen2 with one KV head replicated):
the same greedy tokens, logits within 1e-4 (fp32), through one batch, chunked prefill that carries the LF
state across chunks, prefix-cache hits that restore it from snapshots, and async scheduling (the ranks
read each step's tokens one launch late). Yuan2 at TP = 4 is checked at the model level
(tests/models/test_tensor_parallel_models.py).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from pagoda.errors import ConfigError
from pagoda.sampling_params import SamplingParams
from tests.conftest import finished_token_ids
from tests.models.test_yuan_golden import LOGIT_ATOL, _check_all, _golden


def _prompts(name: str) -> list[list[int]]:
    return [case["prompt_ids"] for case in _golden(name)["cases"]]


@pytest.mark.parametrize("name", ["yuan2-tiny", "yuan2-m32-tiny"])
def test_yuan_tp2_matches_the_goldens_batched_chunked_and_cached(engines, name):
    capture = engines(name, tensor_parallel_size=2, block_size=4, max_num_batched_tokens=16, async_scheduling=True)
    runner = capture.engine.runner
    assert runner.local.model.model.layers[0].self_attn.attn.num_heads == 2  # 4 heads, 2 per rank
    prompts = _prompts(name)
    _check_all(name, capture, capture.run(prompts))  # one batch, prompts chunked at 16 tokens
    hits = capture.engine.stats().prefix_cache_hits
    _check_all(name, capture, capture.run(prompts, prefix="s"), prefix="s")  # LF state from snapshots
    assert capture.engine.stats().prefix_cache_hits > hits


def against_one_rank(engines, model: str, **parallel) -> None:
    """The model split as `parallel` says (tensor and/or pipeline sizes) gives one rank's tokens and logits."""
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(4)]
    one = engines(model, block_size=4, max_model_len=256)
    expected = one.run(prompts, max_tokens=8)
    split = engines(model, block_size=4, max_model_len=256, max_num_batched_tokens=16, **parallel)
    assert split.run(prompts, max_tokens=8) == expected
    for rid in expected:
        for a, b in zip(split.logits[rid], one.logits[rid], strict=True):
            torch.testing.assert_close(a, b, atol=LOGIT_ATOL, rtol=0)
    split.engine.shutdown()  # one parallel group per process


def test_speculation_under_tp2_gives_every_rank_the_tokens_that_held(engines, tiny_llama):
    """Suffix proposals at TP = 2: the driver verifies them and sends every rank the tokens that held, which each
    rank feeds to its next inputs. The second round's proposals are the first round's answers (right by
    construction), so most hold; greedy tokens equal one rank's without speculation in both rounds."""
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(4)]
    expected = list(engines(tiny_llama, block_size=4, max_model_len=256).run(prompts, max_tokens=12).values())
    spec = {"method": "suffix", "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    split = engines(tiny_llama, block_size=4, max_model_len=256, tensor_parallel_size=2, speculative_config=spec)
    for round_ in "ab":
        assert list(split.run(prompts, max_tokens=12, prefix=round_).values()) == expected, round_
    counts = split.engine.speculator.counts
    assert counts.num_drafts >= 4 and counts.num_accepted_tokens >= 0.75 * counts.num_draft_tokens


def test_a_second_engine_while_a_group_runs_is_refused(engines, tiny_llama):
    engines(tiny_llama, tensor_parallel_size=2, max_model_len=256)
    with pytest.raises(ConfigError, match="already runs a parallel engine"):
        engines(tiny_llama, tensor_parallel_size=1, max_model_len=256)


def test_llama_tp2_splits_and_tp4_replicates_kv_heads(engines, tiny_llama):
    against_one_rank(engines, tiny_llama, tensor_parallel_size=2)
    against_one_rank(engines, tiny_llama, tensor_parallel_size=4)


def test_qwen2_tp2_replicates_its_one_kv_head(engines, tiny_qwen2):
    against_one_rank(engines, tiny_qwen2, tensor_parallel_size=2)


def test_seeded_sampling_is_the_drivers(engines, tiny_llama):
    """Only rank 0 samples: a seeded random request gives the TP = 1 tokens."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)
    results = []
    for tp in (1, 2):
        engine = engines(tiny_llama, tensor_parallel_size=tp, max_model_len=256).engine
        engine.add_request("a", [5, 6, 7, 8], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results.append(out.outputs[0].token_ids)
        engine.shutdown()
    assert results[0] == results[1]


def test_yuan_speculation_under_tp2_rolls_every_ranks_lf_state_back(engines):
    """Yuan2 at TP = 2 with proposals that keep two tokens and miss the third: every rank rolls its LF state slots
    back to the last kept token (the counts come with the driver's tokens); the goldens hold."""
    from tests.models.test_yuan_speculation import SPEC, _golden_proposer

    capture = engines("yuan2-tiny", tensor_parallel_size=2, block_size=4, speculative_config=SPEC)
    capture.engine.speculator.ngram.propose = _golden_proposer("yuan2-tiny")
    cases = _golden("yuan2-tiny")["cases"]
    tokens = capture.run([c["prompt_ids"] for c in cases])
    assert [tokens[f"r{i}"] for i in range(len(cases))] == [c["greedy_16"] for c in cases]
    counts = capture.engine.speculator.counts
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens


def test_lora_adapters_under_tp2_equal_peft_merged(engines, tmp_path):
    """LoRA at TP = 2: each rank holds its share of every adapter (A by input columns on row-parallel layers, B by
    output rows on column-parallel ones, KV heads split); two adapters and the base in one batch give PEFT's
    merged models' greedy tokens. The other rank reads each adapter when its first request reaches them."""
    lora_against_peft(engines, tmp_path, tensor_parallel_size=2)


def test_qwen2_vl_tower_adapters_under_tp2_equal_peft_merged(engines, tmp_path):
    """Adapters on Qwen2-VL's vision tower at TP = 2: every rank runs the (unsplit) tower with the adapters of the
    step's items, and keys their encoder outputs apart from the base model's."""
    from tests.models.test_lora_vision_tower import make_tower_adapters, run_tower_requests

    base, adapters, expected = make_tower_adapters(tmp_path)
    engine = engines(
        base, enable_lora=True, enable_tower_connector_lora=True, max_loras=2, max_lora_rank=8, tensor_parallel_size=2
    ).engine
    assert run_tower_requests(engine, adapters) == {rid: tokens for rid, (_, tokens) in expected.items()}


def lora_against_peft(engines, tmp_path, **parallel) -> None:
    """Three adapters and the base model in one batch on a split tiny Llama: PEFT's merged models' greedy tokens."""
    from pagoda.lora.request import LoRARequest
    from tests.conftest import build_tiny_model
    from tests.models.test_lora import ADAPTERS, MAX_TOKENS, PROMPTS, _make_adapter, _reference

    base = build_tiny_model("llama", str(tmp_path / "base"))
    paths = {name: _make_adapter(base, tmp_path / name, *ADAPTERS[name], seed) for seed, name in enumerate(ADAPTERS)}
    engine = engines(base, max_model_len=256, enable_lora=True, max_loras=3, **parallel).engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = {}
    for i, name in enumerate([*ADAPTERS, None]):
        lora = LoRARequest(name, i + 1, paths[name]) if name else None
        for j, prompt in enumerate(PROMPTS):
            engine.add_request(f"{name}-{j}", prompt, params, lora_request=lora)
            expected[f"{name}-{j}"] = _reference(base, paths.get(name))[j][0]
    assert finished_token_ids(engine) == expected
    # The "attn" folder rewritten with the "all" adapter's files and read again in place: every rank runs the new
    # weights (the id's reads are part of the request each rank compares with what it holds).
    shutil.rmtree(paths["attn"])
    shutil.copytree(paths["all"], paths["attn"])
    engine.add_lora(LoRARequest("attn", 1, paths["attn"], load_inplace=True))
    for j, prompt in enumerate(PROMPTS):
        engine.add_request(f"again-{j}", prompt, params, lora_request=LoRARequest("attn", 1, paths["attn"]))
    assert finished_token_ids(engine) == {f"again-{j}": expected[f"all-{j}"] for j in range(len(PROMPTS))}
    # Removed, its folder rewritten (the "all" files again), then asked for under the same name, id and folder: every
    # rank dropped its copy at the removal, so every rank reads the new files (one that kept the old copy would
    # compute its share of the heads with the old weights).
    engine.remove_lora(2)
    shutil.rmtree(paths["mlp"])
    shutil.copytree(paths["all"], paths["mlp"])
    for j, prompt in enumerate(PROMPTS):
        engine.add_request(f"readded-{j}", prompt, params, lora_request=LoRARequest("mlp", 2, paths["mlp"]))
    assert finished_token_ids(engine) == {f"readded-{j}": expected[f"all-{j}"] for j in range(len(PROMPTS))}


@pytest.mark.parametrize("fixture", ["yuan2-tiny", "yuan2-m32-tiny"])
def test_yuan2_lora_under_tp2_equals_the_merged_checkpoint(engines, tmp_path, fixture):
    """Yuan2's fused qk rows under TP = 2: each rank takes its heads' interleaved q/k rows of the adapter's B, as
    of the weights; the M32's experts: each rank its share of w1's two parts and of w2's input columns, summed by
    the experts' one all-reduce. The adapter's greedy tokens equal the merged checkpoint's at one rank."""
    yuan2_lora_against_merged(engines, tmp_path, fixture, tensor_parallel_size=2)


def yuan2_lora_against_merged(engines, tmp_path, fixture: str = "yuan2-tiny", **parallel) -> None:
    from pagoda.lora.request import LoRARequest
    from tests.models.test_lora import MAX_TOKENS, yuan_adapter_and_merged

    adapter, merged = yuan_adapter_and_merged(tmp_path, fixture=fixture)
    prompts = _prompts(fixture)
    expected = engines(merged).run(prompts, max_tokens=MAX_TOKENS)
    engine = engines(fixture, enable_lora=True, max_loras=1, max_lora_rank=4, **parallel).engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, lora_request=LoRARequest("yuan", 1, adapter))
    assert finished_token_ids(engine) == expected
