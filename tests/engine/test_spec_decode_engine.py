"""Speculative decoding (n-gram proposals) through the real engine with real weights (the embedded
SmolLM2-135M): greedy outputs token for token those of decoding without it — through chunked prefill,
prefix-cache hits, stop strings that end inside accepted proposals and max_tokens — while copy-heavy
prompts accept most proposals; sampled requests run too (their exactness is tests/unit/test_spec_decode.py's
rejection-sampling check)."""

from __future__ import annotations

import json
import re

import pytest

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import StructuredOutputsParams
from tests.conftest import build_default_llm

DOC = (
    "The Pagoda engine serves Yuan2 and Qwen2-VL models. It keeps a paged KV cache with prefix caching, rebuilds "
    "its batch every step, prefills long prompts in chunks and preempts requests when memory runs out. "
)
COPY = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{DOC}"}]
PROMPTS = [
    f"Read this and repeat it exactly.\n\n{DOC}\n\nRepeat it:",
    "Count: one two three four five six seven eight nine ten one two three four five six seven eight",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "What is the capital of France?",
    "Write a short poem about the sea.",
]


@pytest.fixture(scope="module", autouse=True)
def float_weights():
    """Token-for-token equality across step shapes holds for float32 weights. The CPU's 4-bit layers
    (tests/models/test_cpu_int4.py) take bf16 activations, whose rounding differs between a one-token step
    and a step that verifies proposals beside prefill chunks (a step of verified tokens only runs them as
    one-token rows: test_spec_decode_int4.py), so here both sides load float32 weights."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGODA_CPU_INT4", "0")
        yield


@pytest.fixture(scope="module")
def default_llm(float_weights):
    llm = build_default_llm()
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def spec_llm(float_weights):
    llm = LLM(
        max_model_len=2048,
        cpu_kv_cache_space_gib=0.25,
        seed=0,
        max_num_batched_tokens=64,  # the long prompts prefill in chunks
        # proposals in batches too (the CPU default proposes only for a request running alone)
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 3,
            "disable_by_batch_size": 64,
        },
    )
    yield llm
    llm.shutdown()


def _tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_greedy_outputs_are_unchanged_and_copying_accepts_proposals(default_llm, spec_llm):
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = _tokens(default_llm, params)
    counts = spec_llm.engine.speculator.counts
    assert _tokens(spec_llm, params) == expected
    again = counts.num_drafts
    assert _tokens(spec_llm, params) == expected  # the prompts now hit the prefix cache
    assert counts.num_drafts > again > 0
    # The chat model copying a document: most proposals hold.
    drafted, accepted = counts.num_draft_tokens, counts.num_accepted_tokens
    copy = SamplingParams(temperature=0, max_tokens=32)
    want = default_llm.chat([COPY], copy, use_tqdm=False)[0].outputs[0]
    got = spec_llm.chat([COPY], copy, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text.startswith(DOC[:60])
    assert counts.num_accepted_tokens - accepted >= 0.7 * (counts.num_draft_tokens - drafted) > 0, counts
    short = SamplingParams(temperature=0, max_tokens=5)
    assert _tokens(spec_llm, short) == _tokens(default_llm, short)


def test_a_stop_string_inside_accepted_proposals_ends_the_text_where_it_would(default_llm, spec_llm):
    params = SamplingParams(temperature=0, max_tokens=40, stop=["prefix caching"])
    want = default_llm.chat([COPY], params, use_tqdm=False)[0].outputs[0]
    got = spec_llm.chat([COPY], params, use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop", want.text  # the model copies the document up to the stop string
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)


@pytest.mark.parametrize(
    "penalties",
    [{"repetition_penalty": 1.05}, {"frequency_penalty": 0.4, "presence_penalty": 0.2}],
    ids=["repetition", "frequency+presence"],
)
def test_penalised_greedy_outputs_are_unchanged(default_llm, spec_llm, penalties):
    """Each verified position is penalised with the proposals before it in its history, and the accepted
    ones join the history of later steps: the outputs are those of decoding one token a step."""
    params = SamplingParams(temperature=0, max_tokens=32, **penalties)
    counts = spec_llm.engine.speculator.counts
    accepted = counts.num_accepted_tokens
    want = [o.outputs[0].token_ids for o in default_llm.chat([COPY] * 2, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec_llm.chat([COPY] * 2, params, use_tqdm=False)] == want
    assert _tokens(spec_llm, params) == _tokens(default_llm, params)
    assert counts.num_accepted_tokens - accepted >= 20, counts  # proposals held, so histories mattered


def test_logprobs_are_given_for_every_kept_token(default_llm, spec_llm):
    """Rows that ask for logprobs speculate too: each kept token (proposals included) has its logprob and the
    top alternatives from the model's distribution at its position, as decoding one token a step gives them
    (to float tolerance: the step's batch shape differs); a stop string inside the kept tokens cuts both."""
    counts = spec_llm.engine.speculator.counts
    accepted = counts.num_accepted_tokens
    for params in (
        SamplingParams(temperature=0, max_tokens=24, logprobs=3),
        SamplingParams(temperature=0, max_tokens=40, logprobs=2, stop=["prefix caching"]),
    ):
        want = default_llm.chat([COPY], params, use_tqdm=False)[0].outputs[0]
        got = spec_llm.chat([COPY], params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids and got.text == want.text
        assert len(got.logprobs) == len(got.token_ids)
        for token, mine, theirs in zip(got.token_ids, got.logprobs, want.logprobs):
            assert mine.keys() == theirs.keys() and token in mine
            for tid in mine:
                assert mine[tid].logprob == pytest.approx(theirs[tid].logprob, abs=2e-3)
                assert mine[tid].rank == theirs[tid].rank
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=2e-2)
    assert counts.num_accepted_tokens - accepted >= 20, counts


def test_constrained_outputs_are_unchanged_and_refused_proposals_are_rejected(default_llm, spec_llm):
    """A grammar masks every verified position with what it allows after the proposals before it: a JSON
    answer copying names from its prompt keeps proposals, and proposals copied from a prompt the regex
    forbids are all refused; the outputs are those of decoding one token a step."""
    record = "Name: Alice Margaret Smith. City: Lyon. Street: 14 Rue de la Republique. Phone: 0472 55 61 20."
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "street": {"type": "string"}},
        "required": ["name", "city", "street"],
    }
    cases = [
        (f"Extract this record as JSON.\n\n{record}", StructuredOutputsParams(json=schema)),
        # "Code:" is followed by letters in the prompt: the proposals copied from there are refused.
        ("Code: ABCD. Code: ABCD. Code: WXYZ.\nWrite one more code.", StructuredOutputsParams(regex=r"Code: [0-9]{4}")),
    ]
    counts = spec_llm.engine.speculator.counts
    for prompt, constraint in cases:
        params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=constraint)
        drafted, accepted = counts.num_draft_tokens, counts.num_accepted_tokens
        chat = [[{"role": "user", "content": prompt}]]
        want = default_llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
        got = spec_llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text) == (want.token_ids, want.text)
        if constraint.json is not None:
            assert json.loads(got.text)["city"] == "Lyon"
            assert counts.num_accepted_tokens - accepted >= 5, counts
        else:
            assert re.fullmatch(r"Code: [0-9]{4}", got.text), got.text
            refused = (counts.num_draft_tokens - drafted) - (counts.num_accepted_tokens - accepted)
            assert refused >= 2, counts


def test_sampled_requests_run_with_proposals(spec_llm):
    params = SamplingParams(temperature=0.7, max_tokens=16, ignore_eos=True, n=2)
    outputs = spec_llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(c.token_ids) == 16 for o in outputs for c in o.outputs)


def test_get_metrics_counts_as_vllms_reader_does(spec_llm):
    def read() -> dict:
        return {(m.name, m.labels.get("finished_reason")): m for m in spec_llm.get_metrics()}

    before = read()
    out = spec_llm.chat([COPY], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    after = read()

    def grew(name: str, reason: str | None = None) -> int:
        key = (f"vllm:{name}", reason)
        return after[key].value - (before[key].value if key in before else 0)

    assert grew("generation_tokens") == 16 and grew("prompt_tokens") == len(out.prompt_token_ids)
    assert grew("request_success", "length") == 1
    assert after[("vllm:num_requests_running", None)].value == 0
    drafts, accepted = grew("spec_decode_num_drafts"), grew("spec_decode_num_accepted_tokens")
    assert drafts > 0 and 0 < accepted <= grew("spec_decode_num_draft_tokens")
    per_pos = after[("vllm:spec_decode_num_accepted_tokens_per_pos", None)].values
    assert len(per_pos) == 4 and sum(per_pos) == after[("vllm:spec_decode_num_accepted_tokens", None)].value
    assert all(m.labels["engine"] == "0" for m in after.values())


def test_suffix_proposals_keep_greedy_outputs_and_reuse_finished_answers(default_llm):
    """Suffix decoding: outputs as without speculation; an answer given before is proposed from the cache of
    finished outputs when the same question comes again (its own prompt does not contain the answer)."""
    llm = LLM(
        max_model_len=2048,
        cpu_kv_cache_space_gib=0.25,
        seed=0,
        speculative_config={"method": "suffix", "num_speculative_tokens": 8, "disable_by_batch_size": 64},
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=24)
        assert _tokens(llm, params) == _tokens(default_llm, params)
        counts = llm.engine.speculator.counts
        question = [{"role": "user", "content": "Write a short poem about a lighthouse keeper."}]
        first = llm.chat([question], params, use_tqdm=False)[0].outputs[0]
        drafted, accepted = counts.num_draft_tokens, counts.num_accepted_tokens
        again = llm.chat([question], params, use_tqdm=False)[0].outputs[0]
        want = default_llm.chat([question], params, use_tqdm=False)[0].outputs[0]
        assert again.token_ids == first.token_ids == want.token_ids
        # Without the cache its own text proposes little (1 of 9 proposals held when measured).
        assert counts.num_accepted_tokens - accepted >= 0.7 * (counts.num_draft_tokens - drafted) >= 0.7 * 16, counts
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft", ["same", "random"])
def test_draft_model_proposals_keep_greedy_and_sampled_outputs(default_llm, tmp_path, draft):
    """A draft model of the target's vocabulary proposes greedily from its own engine. The target drafting
    for itself: every proposal holds. A random-weight draft (a tiny Llama of SmolLM2's vocabulary): most
    are rejected. Either way the greedy outputs are those without speculation, and sampled requests run."""
    from pagoda.models.source import default_gguf_path
    from tests.conftest import build_tiny_model

    model = default_gguf_path() if draft == "same" else build_tiny_model("llama", str(tmp_path), vocab_size=49152)
    llm = LLM(
        max_model_len=2048,
        cpu_kv_cache_space_gib=0.25,
        seed=0,
        speculative_config={
            "method": "draft_model",
            "model": model,
            "num_speculative_tokens": 3,
            "disable_by_batch_size": 64,
        },
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=16)
        prompts = PROMPTS if draft == "same" else PROMPTS[:2]
        want = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        counts = llm.engine.speculator.counts
        assert counts.num_draft_tokens > 0
        if draft == "same":
            assert counts.num_accepted_tokens == counts.num_draft_tokens, counts
        else:
            assert counts.num_accepted_tokens < 0.5 * counts.num_draft_tokens, counts
        if draft == "random":  # a draft that fails costs proposals, never the request or the engine
            real = llm.engine.draft.step

            def broken():
                real()
                raise RuntimeError("draft down")

            llm.engine.draft.step = broken
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
            llm.engine.draft.step = real
            assert not llm.engine.draft.has_unfinished_requests()
        sampled = SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, n=2)
        assert all(len(c.token_ids) == 8 for o in llm.generate(prompts[:2], sampled, use_tqdm=False) for c in o.outputs)
    finally:
        llm.shutdown()


def test_outputs_made_while_the_next_step_runs_are_the_same(default_llm, monkeypatch):
    """`PAGODA_SPEC_DEFERRED_OUTPUTS` with async scheduling: a step read at once for its proposals has its text,
    stop strings and logprobs made after the next step is launched. Every output is the one made at once (tokens,
    text, finish reason, logprobs; n = 2 samples; a stop string inside accepted proposals), streams carry each
    token once and in order, and a request aborted while its outputs wait gets one final output and nothing after."""
    monkeypatch.setenv("PAGODA_SPEC_DEFERRED_OUTPUTS", "1")
    llm = LLM(
        max_model_len=2048,
        cpu_kv_cache_space_gib=0.25,
        seed=0,
        async_scheduling=True,
        speculative_config={"method": "suffix", "num_speculative_tokens": 3, "disable_by_batch_size": 64},
    )
    engine = llm.engine
    try:
        assert engine._defer_outputs
        deferred = []
        process = engine._process

        def counting(so, launched, defer=False):
            deferred.append(defer)
            return process(so, launched, defer)

        engine._process = counting
        for params in (
            SamplingParams(temperature=0, max_tokens=24),
            SamplingParams(temperature=0, max_tokens=40, logprobs=2, stop=["prefix caching"]),
            SamplingParams(temperature=0, max_tokens=12, n=2),
        ):
            want = default_llm.chat([COPY, *([[{"role": "user", "content": p}] for p in PROMPTS[1:3]])], params)
            got = llm.chat([COPY, *([[{"role": "user", "content": p}] for p in PROMPTS[1:3]])], params)
            for w, g in zip(want, got):
                assert [(c.token_ids, c.text, c.finish_reason) for c in g.outputs] == [
                    (c.token_ids, c.text, c.finish_reason) for c in w.outputs
                ]
                for mine, theirs in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or []):
                    assert mine.keys() == theirs.keys()
        assert any(deferred), "no step's outputs were deferred"
        # Streamed, one request aborted while its outputs wait: its final output is the last it gets.
        stream = SamplingParams(temperature=0, max_tokens=48)
        prompt = engine.tokenize(PROMPTS[0])
        engine.add_request("kept", prompt, stream, delta=True)
        engine.add_request("cut", prompt, stream, delta=True)
        seen: dict[str, list] = {"kept": [], "cut": []}
        aborted = False
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert not seen[out.request_id] or not seen[out.request_id][-1].finished, out.request_id
                seen[out.request_id].append(out)
            waiting = engine._deferred is not None and any(r.request_id.startswith("cut") for r in engine._deferred[0])
            if not aborted and waiting and len(seen["cut"]) >= 2:
                for out in engine.abort_request(["cut"]):
                    seen[out.request_id].append(out)
                aborted = True
        assert aborted and seen["cut"][-1].finished and seen["cut"][-1].outputs[0].finish_reason == "abort"
        kept = [t for out in seen["kept"] for t in out.outputs[0].token_ids]
        want = default_llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
        assert kept == want[0].outputs[0].token_ids and seen["kept"][-1].finished
    finally:
        llm.shutdown()
