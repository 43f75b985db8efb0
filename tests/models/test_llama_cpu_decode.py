"""The lean CPU decode layer (`models/llama_cpu_decode.py`) against the general layer it stands in for: the same
requests through both give the same hidden states at every step, bit for bit, for Llama (float weights, grouped
KV heads), Qwen2 (q/k/v biases) and the embedded model's 4-bit GGUF layers, one request alone (its row attended in
place) and several at once (rows in place or gathered); and it runs only where its conditions hold."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.kernels import policy
from pagoda.layers.quantization import cpu_int4
from pagoda.models import llama_cpu_decode
from tests.conftest import build_default_llm


def _count_calls(monkeypatch, name: str) -> list[int]:
    """A list that grows by one for every call of `llama_cpu_decode.<name>` from now on (`layer`: every layer the
    lean path runs; `attend_in_place`: every one of those whose lone row was attended in place)."""
    calls: list[int] = []
    real = getattr(llama_cpu_decode, name)
    monkeypatch.setattr(llama_cpu_decode, name, lambda *args: calls.append(1) or real(*args))
    return calls


def _steps(llm: LLM, prompts: list[list[int]], lone: bool, monkeypatch) -> list[torch.Tensor]:
    """Every step's final hidden states [T, H], one request at a time, with the lone-decode layer on or off."""
    monkeypatch.setattr(llama_cpu_decode, "ENABLED", lone)
    hidden: list[torch.Tensor] = []
    model = llm.llm_engine.runner.model.model
    handle = model.register_forward_hook(lambda module, args, out: hidden.append(out.clone()))
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for ids in prompts:  # alone: every decode step is one row, its blocks one run
            # a prompt seen before would start from cached blocks, with its new ones elsewhere: not one run
            llm.reset_prefix_cache()
            llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    finally:
        handle.remove()
    return hidden


def _assert_same_steps(llm: LLM, prompts: list[list[int]], monkeypatch) -> None:
    calls = _count_calls(monkeypatch, "layer")
    general = _steps(llm, prompts, lone=False, monkeypatch=monkeypatch)
    assert not calls
    lone = _steps(llm, prompts, lone=True, monkeypatch=monkeypatch)
    layers = len(llm.llm_engine.runner.model.model.layers)
    assert len(calls) == layers * 11 * len(prompts)  # every decode step of every layer, no prefill
    assert len(lone) == len(general)
    for got, want in zip(lone, general, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen2"])
def test_lone_decode_layers_equal_the_general_layers_bit_for_bit(kind, request, monkeypatch):
    llm = LLM(request.getfixturevalue(kind), skip_tokenizer_init=True, max_model_len=256, num_gpu_blocks_override=64)
    # 37 and 45 tokens: the decode tokens cross block boundaries (16-slot blocks), so the slot arithmetic is tested
    prompts = [[(7 * i + j) % 500 + 3 for i in range(n)] for j, n in enumerate((37, 45))]
    _assert_same_steps(llm, prompts, monkeypatch)


def test_4bit_layers_with_biases_bit_for_bit(tiny_qwen2, monkeypatch):
    """Qwen2's q/k/v biases on 4-bit layers: the tiny model's projections put on GGUF's Q4_1 grid, then packed."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from pagoda.layers.linear import Linear

    llm = LLM(tiny_qwen2, skip_tokenizer_init=True, max_model_len=256, num_gpu_blocks_override=64)
    model = llm.llm_engine.runner.model.model
    for module in model.layers.modules():
        if isinstance(module, Linear):
            w = module.weight.detach().numpy()
            q4 = dequantize(quantize(w, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1)
            module.weight.data.copy_(torch.from_numpy(q4.reshape(w.shape).copy()))
            if module.bias is not None:
                module.bias.data.normal_(generator=torch.Generator().manual_seed(0))  # the checkpoint's are zeros
    assert cpu_int4.pack_int4_layers(model.layers) == (8, 0, 0)
    _assert_same_steps(llm, [[(5 * i) % 500 + 3 for i in range(40)]], monkeypatch)


def test_embedded_model_4bit_layers_take_the_lone_decode_path_bit_for_bit(default_llm, monkeypatch):
    layers = default_llm.llm_engine.runner.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj.quant, cpu_int4.CpuInt4Method)
    _assert_same_steps(default_llm, [[1, 504, 3458, 282, 4649, 314] * 5], monkeypatch)


def test_layers_it_cannot_run_exactly_take_the_general_path(tiny_llama, monkeypatch):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, max_model_len=256, num_gpu_blocks_override=64)
    model = llm.llm_engine.runner.model.model
    layer = model.layers[0]
    rope = model.rotary_emb.cos_sin(torch.tensor([5]))
    assert llama_cpu_decode.eligible(layer, rope)
    half = (rope[0][..., :2], rope[1][..., :2])  # a partial rotary
    assert not llama_cpu_decode.eligible(layer, half)
    cache = layer.self_attn.attn.k_cache
    monkeypatch.setattr(layer.self_attn.attn, "k_cache", cache.to(torch.bfloat16))  # a narrower cache is gathered
    assert not llama_cpu_decode.eligible(layer, rope)
    monkeypatch.setattr(layer.self_attn.attn, "k_cache", cache)
    monkeypatch.setattr(layer.mlp.down_proj, "lora", object())  # adapters add to the projection's output
    assert not llama_cpu_decode.eligible(layer, rope)
    monkeypatch.setattr(layer.mlp.down_proj, "lora", None)
    assert llama_cpu_decode.eligible(layer, rope)
    handle = layer.register_forward_pre_hook(lambda module, args: None)  # a hook (weight offload) needs the call
    assert not llama_cpu_decode.eligible(layer, rope)
    handle.remove()


def test_a_next_turn_decodes_in_place_after_its_prefix_hit(tiny_llama, monkeypatch):
    """Turn 2 of a chat starts from turn 1's cached blocks; the block manager continues their run
    (`prefer_runs`), so its decode steps take the lean layer with the row attended in place."""
    llm = LLM(tiny_llama, skip_tokenizer_init=True, max_model_len=256, num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    turn1 = [(11 * i) % 500 + 3 for i in range(40)]  # with its answer, 51 tokens: a partial fourth block
    answer = llm.generate({"prompt_token_ids": turn1}, params, use_tqdm=False)[0].outputs[0].token_ids
    turn2 = {"prompt_token_ids": [*turn1, *answer, *range(40, 50)]}
    calls = _count_calls(monkeypatch, "attend_in_place")
    tokens = {}
    for lone in (True, False):
        monkeypatch.setattr(llama_cpu_decode, "ENABLED", lone)
        calls.clear()
        out = llm.generate(turn2, params, use_tqdm=False)[0]
        assert out.num_cached_tokens >= 32  # the prefix hit: turn 1's full blocks
        tokens[lone] = out.outputs[0].token_ids
        assert len(calls) == (len(llm.llm_engine.runner.model.model.layers) * 11 if lone else 0)
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("kind", ["tiny_llama", "default"])
def test_several_decode_rows_bit_for_bit(kind, request, monkeypatch):
    """Four requests at once, of different prompt and output lengths: decode-only steps of 4, 3, 2 and 1 rows
    (blocks interleaved, so gathered) between steps that also prefill (which take the general layer). Each side
    gets an engine of its own: how a run's steps are cut and its blocks laid out depends on what the pool held
    before (a 4-bit prefill of more than 64 rows rounds differently, attention in place differs from gathered in
    the last bit), so two runs on one engine need not agree bit for bit even through the same layer."""
    hidden: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    prompts = [{"prompt_token_ids": [(13 * i + j) % 400 + 3 for i in range(n)]} for j, n in enumerate((9, 30, 17, 41))]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (20, 7, 13, 26)]
    calls = _count_calls(monkeypatch, "layer")
    for lean in (False, True):
        monkeypatch.setattr(llama_cpu_decode, "ENABLED", lean)
        if kind == "default":
            llm = build_default_llm()
        else:
            llm = LLM(request.getfixturevalue(kind), skip_tokenizer_init=True, max_model_len=256)
        model = llm.llm_engine.runner.model.model
        handle = model.register_forward_hook(lambda module, args, out, lean=lean: hidden[lean].append(out.clone()))
        llm.generate(prompts, params, use_tqdm=False)
        handle.remove()
        layers = len(model.layers)
        llm.shutdown()
        del llm, model
    rows = [len(s) for s in hidden[True]]
    assert {4, 3, 2, 1} <= set(rows)  # the step sizes the lean path must handle
    decode_only = sum(1 for s in hidden[True] if len(s) <= 4)  # every step after the first (the four prompts)
    assert len(calls) == layers * decode_only
    assert len(hidden[True]) == len(hidden[False])
    for got, want in zip(hidden[True], hidden[False], strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [1, 4, policy.CPU_INT4_MAX_ROWS + 1])
def test_a_projection_multiplies_as_the_layer_does_at_every_row_count(rows):
    """A decode-only step may hold more rows than the int4 kernel takes (`policy.CPU_INT4_MAX_ROWS`); the lean
    layer's projections then go where the layer's own matmul goes (the rebuilt-weight path), bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from pagoda.layers.linear import Linear

    weight = torch.randn(192, 128, generator=torch.Generator().manual_seed(1)).numpy()
    q4 = dequantize(quantize(weight, GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1).reshape(weight.shape)
    layer = Linear(128, 192, bias=True)
    layer.weight.data.copy_(torch.from_numpy(q4.copy()))
    layer.bias.data.normal_(generator=torch.Generator().manual_seed(2))
    assert cpu_int4.pack_int4_layers(torch.nn.Sequential(layer)) == (1, 0, 0)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(3))
    assert torch.equal(llama_cpu_decode._projection(layer)(x), layer(x))
