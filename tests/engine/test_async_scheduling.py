"""Async scheduling (step N+1 launched before step N's tokens are read) must not change a token.

The reference is the same engine with async scheduling off: one step at a time, every token on the
host before the next step is built. Both engines run the same mixed workload under pressure
(chunked prefill, preemption, prefix-cache hits, stop tokens that end requests early, max_tokens,
min_tokens, seeded sampling, logprobs, penalties that need the whole history, n > 1), and every
request's tokens, finish reason and logprobs must match.
"""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from pagoda.errors import InvalidRequest


def _workload(seed: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(40)]  # a common prefix: prefix-cache hits
    stops = rng.sample(range(3, 512), 40)  # ~8 % of the vocabulary ends a request
    prompts, params = [], []
    for i in range(36):
        body = [rng.randrange(3, 512) for _ in range(rng.randint(1, 150))]
        prompts.append({"prompt_token_ids": (shared + body) if i % 3 == 0 else body})
        kind = i % 9
        max_tokens = rng.randint(1, 24)
        if kind == 0:
            p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=stops)
        elif kind == 2:
            p = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=stops, min_tokens=6)
        elif kind == 3:
            p = SamplingParams(
                temperature=0.9, top_p=0.9, top_k=50, seed=1000 + i, max_tokens=max_tokens, stop_token_ids=stops
            )
        elif kind == 4:
            p = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=3, stop_token_ids=stops)
        elif kind == 5:
            p = SamplingParams(temperature=0, max_tokens=max_tokens, repetition_penalty=1.3, ignore_eos=True)
        elif kind == 6:
            p = SamplingParams(
                temperature=0, max_tokens=max_tokens, frequency_penalty=0.7, presence_penalty=0.3, stop_token_ids=stops
            )
        elif kind == 7:
            p = SamplingParams(n=2, temperature=1.0, seed=2000 + i, max_tokens=max_tokens, ignore_eos=True)
        else:
            p = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # to max_model_len
        params.append(p)
    return prompts, params


def _summary(outputs) -> list:
    rows = []
    for out in outputs:
        for c in out.outputs:
            lps = (
                None
                if c.logprobs is None
                else [sorted((tid, lp.logprob) for tid, lp in step.items()) for step in c.logprobs]
            )
            rows.append((out.request_id, c.index, c.token_ids, c.finish_reason, c.stop_reason, lps))
    return rows


def _assert_same(got: list, expected: list) -> None:
    """Tokens, finish and stop reasons exactly; logprobs to float32 rounding (batches differ)."""
    assert [r[:-1] for r in got] == [r[:-1] for r in expected]
    for g, e in zip(got, expected):
        assert (g[-1] is None) == (e[-1] is None)
        for step_g, step_e in zip(g[-1] or [], e[-1] or []):
            assert [t for t, _ in step_g] == [t for t, _ in step_e]
            assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(step_g, step_e))


def _engine(model: str, async_scheduling: bool, **kwargs) -> LLM:
    return LLM(model=model, skip_tokenizer_init=True, max_model_len=256, async_scheduling=async_scheduling, **kwargs)


@pytest.mark.parametrize("seed", [0, 1])
def test_async_equals_sync_under_pressure(tiny_llama, seed):
    prompts, params = _workload(seed)
    tight = dict(max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=40)
    ref = _engine(tiny_llama, False, **tight)
    expected = _summary(ref.generate(prompts, params, use_tqdm=False))

    llm = _engine(tiny_llama, True, **tight)
    runner = llm.engine.runner
    late = {"rows": 0}
    gather = runner.inputs._late_tokens

    def counting(states, rows, flat_index, last_sampled):  # how many inputs came from the device, not the host
        late["rows"] += len(rows)
        return gather(states, rows, flat_index, last_sampled)

    runner.inputs._late_tokens = counting
    got = _summary(llm.generate(prompts, params, use_tqdm=False))
    _assert_same(got, expected)
    stats = llm.engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.num_chunked_prefills > 0
    assert llm.engine.block_manager.prefix_hits > 0
    assert late["rows"] > 100, "the pending tokens must have been fed from the device"
    assert any(r[3] == "stop" for r in got) and any(r[3] == "length" for r in got)
    # Nothing leaks: an idle step hands the last finished requests to the runner.
    llm.engine.step()
    assert not llm.engine.has_unfinished_requests()
    assert not runner.states
    bm = llm.engine.block_manager
    bm.check_integrity([])
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_async_with_speculation_equals_sync_without(tiny_llama):
    """Speculation under async scheduling: a step with proposals is read before the next is scheduled, and the
    steps in flight are read before proposals are made; steps without proposals keep the overlap. The same
    workload twice (the second time suffix proposals are the first time's answers, right by construction):
    every token, finish reason and logprob of the sync engine without speculation."""
    prompts, params = _workload(0)
    tight = dict(max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=40)
    expected = _summary(_engine(tiny_llama, False, **tight).generate(prompts, params, use_tqdm=False))
    spec = {"method": "suffix", "num_speculative_tokens": 4, "disable_by_batch_size": 64}
    llm = _engine(tiny_llama, True, speculative_config=spec, **tight)
    runner, late = llm.engine.runner, {"rows": 0}
    gather = runner.inputs._late_tokens

    def counting(states, rows, flat_index, last_sampled):
        late["rows"] += len(rows)
        return gather(states, rows, flat_index, last_sampled)

    runner.inputs._late_tokens = counting
    for _ in range(2):  # (request ids differ the second time)
        got = _summary(llm.generate(prompts, params, use_tqdm=False))
        _assert_same([r[1:] for r in got], [r[1:] for r in expected])
    counts = llm.engine.speculator.counts
    assert counts.num_accepted_tokens > 100 and late["rows"] > 100  # both: proposals kept, steps overlapped
    llm.engine.step()  # an idle step hands the last finished requests to the runner
    assert not llm.engine.has_unfinished_requests() and not runner.states


def test_async_abort_mid_flight(tiny_qwen2):
    """Aborting a request whose next step is already launched drops that step's token."""
    llm = _engine(tiny_qwen2, True, num_gpu_blocks_override=64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", [5, 6, 7, 8], params, delta=True)
    engine.add_request("b", [9, 10, 11], params, delta=True)
    seen: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(6):
        for out in engine.step():
            seen[out.request_id] += out.outputs[0].token_ids
    assert engine._inflight  # a step is on the device right now
    aborted = engine.abort_request(["a"])
    assert [o.request_id for o in aborted] == ["a"] and aborted[0].finished
    # "a" is still in the launched step: reusing its id now would hand it that step's token.
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request("a", [5, 6], params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "b"
            seen[out.request_id] += out.outputs[0].token_ids
    ref = _engine(tiny_qwen2, False, num_gpu_blocks_override=64)
    want = ref.generate([{"prompt_token_ids": [9, 10, 11]}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert seen["b"] == want and 0 < len(seen["a"]) < 50
    assert (
        seen["a"]
        == ref.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)[0]
        .outputs[0]
        .token_ids[: len(seen["a"])]
    )
    assert not engine._inflight  # idle: nothing left on the device
    engine.step()
    assert not engine.runner.states and engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
