"""End-to-end engine behaviour on tiny random-weight models: batching under pressure must not
change a single token, prefix caching must be used and be invisible, limits must hold."""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError, InvalidRequest

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _random_prompts(count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(low, high))] for _ in range(count)]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_batch_invariance_under_preemption_and_chunking(tiny_llama):
    prompts = _random_prompts(32, 1, 300)
    # Reference: each prompt alone, in a roomy engine.
    alone = LLM(model=tiny_llama, skip_tokenizer_init=True, max_model_len=512, num_gpu_blocks_override=64)
    expected = [_tokens(alone.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False))[0] for p in prompts]

    # Pressure: 8 sequences, 64-token steps, and a pool barely larger than one max-length request.
    tight = LLM(
        model=tiny_llama,
        skip_tokenizer_init=True,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=40,
    )
    # Poison every usable block: attention must never read a slot before it was written.
    for k_cache, v_cache in tight.engine.runner.kv_caches:
        k_cache[1:].fill_(float("nan"))
        v_cache[1:].fill_(float("nan"))
    got = _tokens(tight.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    stats = tight.engine.scheduler.stats
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert stats.num_chunked_prefills > 0, "prompts longer than 64 tokens must be chunked"
    assert got == expected
    bm = tight.engine.block_manager
    bm.check_integrity([])
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_prefix_cache_hits_and_identical_output(tiny_qwen2):
    shared = _random_prompts(1, 50, 50, seed=1)[0]  # 3 full 16-token blocks + 2 tokens
    first, second = shared + [7, 8, 9], shared + [10, 11]
    cached = LLM(model=tiny_qwen2, skip_tokenizer_init=True, max_model_len=256, num_gpu_blocks_override=64)
    cached.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)
    hits_before = cached.engine.block_manager.prefix_hits
    out = cached.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 48
    assert cached.engine.block_manager.prefix_hits - hits_before == 48

    plain = LLM(
        model=tiny_qwen2,
        skip_tokenizer_init=True,
        max_model_len=256,
        num_gpu_blocks_override=64,
        enable_prefix_caching=False,
    )
    ref = plain.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    assert ref.num_cached_tokens == 0
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids

    assert cached.reset_prefix_cache()  # vLLM's offline call: the same prompt again computes from the start
    again = cached.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == ref.outputs[0].token_ids


def test_copied_prefix_hits_decode_in_place_with_the_shared_hits_tokens(tiny_llama, monkeypatch):
    """CPU: chats with one system prompt, one after another. Each later chat's hit is followed in the pool by the
    earlier chat's cached question, so shared it could not continue into a run and every decode step gathered
    its blocks; copied into a run of its own (`BlockManager.copy_hits_max_tokens`), every decode step attends in
    place. Same tokens either way, from a pool poisoned with NaN (a copy that misses a slot would show)."""
    from pagoda.layers.torch_attention import TorchAttentionBackend

    system = _random_prompts(1, 40, 40, seed=3)[0]  # 2 full blocks of 16 + 8 tokens
    questions = _random_prompts(4, 12, 30, seed=4)
    prepare = TorchAttentionBackend.prepare
    steps: list[bool] = []  # per decode-only step: attended in place

    def spy(self, batch):
        meta = prepare(self, batch)
        if meta.decode_blocks is not None and not meta.prefill_rows:
            steps.append(meta.decode_views is not None)
        return meta

    monkeypatch.setattr(TorchAttentionBackend, "prepare", spy)

    def chats(copy: bool) -> tuple[list[list[int]], int]:
        llm = LLM(model=tiny_llama, skip_tokenizer_init=True, max_model_len=256, num_gpu_blocks_override=64)
        assert llm.engine.block_manager.copy_hits_max_blocks > 0, "the CPU engine copies short hits by default"
        if not copy:
            llm.engine.block_manager.copy_hits_max_blocks = 0
        for k_cache, v_cache in llm.engine.runner.kv_caches:
            k_cache[1:].fill_(float("nan"))
            v_cache[1:].fill_(float("nan"))
        steps.clear()
        out = [_tokens(llm.generate([{"prompt_token_ids": system + q}], GREEDY, use_tqdm=False))[0] for q in questions]
        assert llm.engine.block_manager.prefix_hits == 32 * (len(questions) - 1)
        llm.engine.block_manager.check_integrity([])
        return out, sum(steps)

    copied, in_place = chats(copy=True)
    shared, shared_in_place = chats(copy=False)
    assert copied == shared
    assert in_place == len(questions) * (GREEDY.max_tokens - 1), "every decode step in place"
    assert shared_in_place == GREEDY.max_tokens - 1, "shared, only the first chat's decode was in place"


def test_cache_salt_shares_prefix_hits_only_within_a_salt(tiny_qwen2):
    # Two tenants send the same 3-block prefix: a tenant hits only its own blocks (and unsalted requests
    # only unsalted ones); the output is the same either way.
    shared = _random_prompts(1, 50, 50, seed=3)[0]
    llm = LLM(model=tiny_qwen2, skip_tokenizer_init=True, max_model_len=256, num_gpu_blocks_override=64)

    def cached(tail: list[int], salt: str | None) -> tuple[int, list[int]]:
        prompt = {"prompt_token_ids": shared + tail, **({"cache_salt": salt} if salt else {})}
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    assert cached([1], "tenant-a")[0] == 0
    assert cached([2], "tenant-b")[0] == 0, "another salt must not hit tenant-a's blocks"
    assert cached([3], None)[0] == 0, "no salt must not hit salted blocks"
    hit_a, tokens_a = cached([4], "tenant-a")
    hit_b, _ = cached([5], "tenant-b")
    assert hit_a == hit_b == 48 and cached([6], None)[0] == 48
    assert tokens_a == cached([4], "tenant-c")[1]


def test_logprob_token_ids_give_exactly_those_tokens(tiny_qwen2):
    # The ids' logprobs at each position are those the top-20 run reports for the same tokens (greedy: the
    # same positions), in the order asked, with the sampled token's own entry beside them.
    llm = LLM(model=tiny_qwen2, skip_tokenizer_init=True, max_model_len=128, num_gpu_blocks_override=32)
    prompt = [{"prompt_token_ids": _random_prompts(1, 20, 20, seed=5)[0]}]
    top = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=20), use_tqdm=False)[0].outputs[0]
    wanted = sorted(top.logprobs[0], key=lambda t: top.logprobs[0][t].rank or 99)[5:8]
    params = SamplingParams(temperature=0, max_tokens=4, logprob_token_ids=wanted)
    chosen = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert chosen.token_ids == top.token_ids
    first = chosen.logprobs[0]
    assert [t for t, e in sorted(first.items(), key=lambda i: i[1].rank or 99) if e.rank is not None] == wanted
    for t in wanted:
        assert first[t].logprob == pytest.approx(top.logprobs[0][t].logprob, abs=1e-4)
    assert set(first) == set(wanted) | {chosen.token_ids[0]}


def test_priority_needs_the_priority_policy_offline(tiny_qwen2):
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    fcfs = LLM(model=tiny_qwen2, skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks_override=16)
    with pytest.raises(InvalidRequest, match="--scheduling-policy priority"):
        fcfs.generate(prompts, GREEDY, use_tqdm=False, priority=[0, 1])
    ranked = LLM(
        model=tiny_qwen2,
        skip_tokenizer_init=True,
        max_model_len=64,
        num_gpu_blocks_override=16,
        scheduling_policy="priority",
    )
    got = ranked.generate(prompts, GREEDY, use_tqdm=False, priority=[3, -1])
    want = fcfs.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_limits_hold_every_step(tiny_llama):
    llm = LLM(
        model=tiny_llama,
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=3,
        max_num_batched_tokens=40,
        num_gpu_blocks_override=64,
    )
    engine = llm.engine
    for i, p in enumerate(_random_prompts(7, 5, 90, seed=2)):
        engine.add_request(str(i), p, GREEDY)
    while engine.has_unfinished_requests():
        scheduled = engine.scheduler.schedule()
        assert scheduled.total_num_scheduled_tokens <= 40
        assert len(scheduled.num_scheduled_tokens) <= 3
        step = engine.runner.execute(scheduled)
        engine.scheduler.update(scheduled, step)
        engine.block_manager.check_integrity(list(engine.scheduler.requests.values()))


def test_max_model_len_and_lengths(tiny_llama):
    llm = LLM(model=tiny_llama, skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks_override=16)
    out = llm.generate(
        [{"prompt_token_ids": list(range(3, 60))}],
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.outputs[0].token_ids) == 64 - 57 and out.outputs[0].finish_reason == "length"
    with pytest.raises(InvalidRequest, match="maximum model length of 64"):
        llm.generate([{"prompt_token_ids": list(range(3, 70))}], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequest, match="outside the model.s vocabulary"):
        llm.generate([{"prompt_token_ids": [5, 9999]}], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequest, match="empty"):
        llm.generate([{"prompt_token_ids": []}], GREEDY, use_tqdm=False)


def test_pool_too_small_fails_at_startup_naming_the_knob(tiny_llama):
    with pytest.raises(ConfigError, match="num-gpu-blocks-override or lower --max-model-len"):
        LLM(model=tiny_llama, skip_tokenizer_init=True, max_model_len=512, num_gpu_blocks_override=8)


def test_n_and_seeded_sampling(tiny_llama):
    llm = LLM(model=tiny_llama, skip_tokenizer_init=True, max_model_len=128, num_gpu_blocks_override=64)
    prompt = [{"prompt_token_ids": [4, 5, 6, 7]}]
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    a = llm.generate(prompt, params, use_tqdm=False)[0]
    b = llm.generate(prompt * 2, params, use_tqdm=False)[1]  # batched with a twin: same tokens
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # the samples differ from each other


def test_stop_token_ids_and_min_tokens(tiny_llama):
    llm = LLM(model=tiny_llama, skip_tokenizer_init=True, max_model_len=128, num_gpu_blocks_override=64)
    prompt = [{"prompt_token_ids": [4, 5, 6, 7]}]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    tokens = free.outputs[0].token_ids
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == tokens[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens suppresses the stop token until enough tokens exist.
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=first + 2, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= first + 2
    assert stop_at not in out.token_ids[: first + 1]


def test_folder_without_tokenizer_needs_skip_flag(tiny_llama):
    from pagoda.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="skip_tokenizer_init"):
        LLM(model=tiny_llama, max_model_len=128, num_gpu_blocks_override=64)
    llm = LLM(model=tiny_llama, skip_tokenizer_init=True, max_model_len=128, num_gpu_blocks_override=64)
    with pytest.raises(InvalidRequest, match="prompt_token_ids"):
        llm.generate(["text needs a tokenizer"], GREEDY, use_tqdm=False)


def test_repetition_penalty_sees_the_prompt_through_the_engine(tiny_llama):
    """A huge repetition penalty keeps greedy decoding off every prompt token and every token it
    already produced (the runner must hand the prompt history to the sampler)."""
    llm = LLM(model=tiny_llama, skip_tokenizer_init=True, max_model_len=256, num_gpu_blocks_override=64)
    prompt = list(range(100, 160))
    plain = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1000.0)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert not set(out) & set(prompt)
    assert len(set(out)) == len(out)
    assert set(plain) & set(prompt) or len(set(plain)) < len(plain), "the unpenalized run should repeat something"


def test_repetition_penalty_matches_transformers(tiny_llama):
    """Greedy decoding with a repetition penalty, against transformers' own `generate()` (its
    RepetitionPenaltyLogitsProcessor penalises prompt and generated tokens alike), for a batch of
    prompts decoded together: the runner's persistent device-side token history must equal it."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompts = _random_prompts(4, 5, 40, seed=9)
    llm = LLM(
        model=tiny_llama, skip_tokenizer_init=True, max_model_len=256, num_gpu_blocks_override=64, dtype="float32"
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8)
    got = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                repetition_penalty=1.8,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert tokens == ref


def test_pdl_only_for_steps_of_few_tokens(tiny_llama, monkeypatch):
    """Programmatic dependent launch only for steps of at most `policy.PDL_MAX_ROWS` tokens, eager
    or captured (so each kernel size launches, and compiles at start-up, in one variant): a long
    prompt's prefill runs without it, the decode steps after it with it; outside a step (kernels
    called directly) it stays allowed, and the context manager nests."""
    from pagoda.kernels import dispatch, policy

    llm = LLM(model=tiny_llama, skip_tokenizer_init=True, num_gpu_blocks_override=64, max_model_len=256)
    model = llm.engine.runner.model
    seen = []
    forward = model.forward

    def spy(input_ids, *args, **kwargs):
        seen.append((input_ids.shape[0], dispatch.pdl_is_allowed()))
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    long_prompt = list(range(1, policy.PDL_MAX_ROWS + 40))
    llm.generate([long_prompt, [5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert seen[0] == (len(long_prompt) + 2, False)
    assert seen[1:] and all(allowed for _, allowed in seen[1:]) and all(n <= 2 for n, _ in seen[1:])
    assert dispatch.pdl_is_allowed()
    with dispatch.pdl_allowed(False):
        assert not dispatch.pdl_is_allowed()
        with dispatch.pdl_allowed(True):
            assert dispatch.pdl_is_allowed()
        assert not dispatch.pdl_is_allowed()


def test_late_tokens_of_a_batch_that_keeps_its_rows_need_no_copies(tiny_llama, monkeypatch):
    """Rows whose input is the previous step's (still unread) sample get it by a gather on the
    device; when row i takes sample i into token i (a batch that keeps its rows, always at batch 1)
    a slice and a cached index replace the gather's two host-to-device copies. Either way the
    (index, value) pairs are the same."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from pagoda.worker import step_inputs

    runner = LLM(model=tiny_llama, skip_tokenizer_init=True, num_gpu_blocks_override=16, max_model_len=64).engine.runner
    copies = []
    real = step_inputs.to_device
    monkeypatch.setattr(step_inputs, "to_device", lambda *a, **k: copies.append(a) or real(*a, **k))
    last = torch.tensor([11, 22, 33])
    states = [SimpleNamespace(num_pending=1, pending_row=r) for r in (0, 1, 2)]
    index, values = runner.inputs._late_tokens(states, np.array([0, 1, 2]), np.array([0, 1, 2]), last)
    assert index.tolist() == [0, 1, 2] and values.tolist() == [11, 22, 33] and not copies
    index, values = runner.inputs._late_tokens(states[:1], np.array([0]), np.array([0]), last)
    assert index.tolist() == [0] and values.tolist() == [11] and not copies
    moved = [SimpleNamespace(num_pending=1, pending_row=r) for r in (2, 0)]
    index, values = runner.inputs._late_tokens(moved + states[1:2], np.array([0, 1]), np.array([3, 7]), last)
    assert index.tolist() == [3, 7] and values.tolist() == [33, 11] and len(copies) == 2
