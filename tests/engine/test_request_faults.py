"""One request's failure must stay that request's: ids without a tokenizer piece, and an exception
injected into each per-request stage of the engine core.

The model is the tiny golden Yuan2 widened to Yuan's 135,040 rows with the real tokenizer (134,958
pieces), so ids 134,958..135,039 are rows the tokenizer has no text for — what made the engine
core die on `IndexError: piece id is out of range`. The reference for "the others carry on" is the
same workload run without the fault: every other request's tokens must be identical.
"""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.scheduler import Scheduler
from pagoda.errors import InvalidRequest
from pagoda.frontend.detokenizer import IncrementalDetokenizer, decode_ids, single_token_decoder
from pagoda.layers.sampler import SamplingState

TARGET = "victim"
PROMPTS = {"a": "The capital of France is", TARGET: "Once upon a time", "b": "1, 2, 3,", "c": "Hello"}


def _llm(folder: str, async_scheduling: bool = False) -> LLM:
    return LLM(
        model=folder,
        max_model_len=128,
        num_gpu_blocks_override=64,
        block_size=16,
        seed=0,
        async_scheduling=async_scheduling,
    )


def _finals(llm: LLM, params: dict[str, SamplingParams]) -> dict:
    """Every request of PROMPTS through the engine: request id → its final RequestOutput."""
    engine = llm.engine
    for rid, text in PROMPTS.items():
        engine.add_request(rid, engine.tokenize(text), params[rid], prompt=text)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def _run(llm: LLM, params: dict[str, SamplingParams]) -> dict[str, tuple[list[int], str, str | int | None]]:
    engine = llm.engine
    results = {
        rid: (out.outputs[0].token_ids, out.outputs[0].finish_reason, out.outputs[0].stop_reason)
        for rid, out in _finals(llm, params).items()
    }
    assert engine.block_manager.usage == 0.0, "blocks leaked"
    engine.block_manager.check_integrity([])
    return results


def _params() -> dict[str, SamplingParams]:
    base = dict(temperature=0, max_tokens=12, ignore_eos=True)
    return {
        "a": SamplingParams(**base),
        TARGET: SamplingParams(**base, logprobs=2),
        "b": SamplingParams(**base, stop_token_ids=[99999]),
        "c": SamplingParams(**base, repetition_penalty=1.2),
    }


def _inject_sampling(monkeypatch):
    original = SamplingState.add

    def add(self, request_id, *args, **kwargs):
        if request_id == TARGET:
            raise RuntimeError("injected: sampling setup")
        return original(self, request_id, *args, **kwargs)

    monkeypatch.setattr(SamplingState, "add", add)


def _inject_stop_check(monkeypatch):
    original = Scheduler._check_stop

    def check(self, request, token):
        if request.request_id.split("#")[0] == TARGET:  # "<id>#<i>": the samples of n > 1
            raise RuntimeError("injected: stop check")
        return original(self, request, token)

    monkeypatch.setattr(Scheduler, "_check_stop", check)


def _inject_detokenizer(monkeypatch):
    """The detokenizer of the target's prompt raises on its fourth token."""
    target_prompt = None
    original_init, original_update = IncrementalDetokenizer.__init__, IncrementalDetokenizer.update_one

    def init(self, tokenizer, prompt_token_ids, **kwargs):
        nonlocal target_prompt
        if target_prompt is None:
            target_prompt = tokenizer.encode(PROMPTS[TARGET])
        self._victim = list(prompt_token_ids) == list(target_prompt)
        self._seen = 0
        original_init(self, tokenizer, prompt_token_ids, **kwargs)

    def update_one(self, token_id):
        self._seen += 1
        if self._victim and self._seen == 4:
            raise IndexError("injected: piece id is out of range")
        return original_update(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", init)
    monkeypatch.setattr(IncrementalDetokenizer, "update_one", update_one)


def _inject_output(monkeypatch):
    """Building the target's logprobs entry (output processing) raises on its second token."""
    original = OutputProcessor._append_logprobs
    calls = {"n": 0}

    def append(self, sample, token, lp):
        if sample.parent.request_id == TARGET:
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyError("injected: output processing")
        return original(self, sample, token, lp)

    monkeypatch.setattr(OutputProcessor, "_append_logprobs", append)


@pytest.fixture(scope="module")
def reference(wide_yuan):
    return _run(_llm(wide_yuan), _params())


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "inject",
    [_inject_sampling, _inject_stop_check, _inject_detokenizer, _inject_output],
    ids=["sampling", "stop-check", "detokenize", "output"],
)
def test_a_fault_in_one_request_ends_only_that_request(
    wide_yuan, reference, monkeypatch, inject, async_scheduling, caplog
):
    llm = _llm(wide_yuan, async_scheduling)
    inject(monkeypatch)
    with caplog.at_level("ERROR", logger="pagoda"):
        results = _run(llm, _params())
    tokens, reason, message = results[TARGET]
    assert reason == "error" and "Internal error while" in str(message) and TARGET in str(message)
    assert len([r for r in caplog.records if TARGET in r.getMessage()]) == 1, "logged once, with its id"
    for rid in PROMPTS:
        if rid != TARGET:
            assert results[rid] == reference[rid], rid
    monkeypatch.undo()
    # The engine is whole afterwards: the same workload gives the reference again.
    assert _run(llm, _params()) == reference


def test_n_samples_fail_together(wide_yuan, monkeypatch):
    llm = _llm(wide_yuan)
    _inject_stop_check(monkeypatch)
    params = _params()
    params[TARGET] = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    finals = _finals(llm, params)
    assert {c.finish_reason for c in finals[TARGET].outputs} == {"error"}
    assert len(finals[TARGET].outputs) == 3
    assert llm.engine.block_manager.usage == 0.0


def test_ids_without_a_tokenizer_piece(padding_yuan):
    """Greedy decoding that samples such ids between ordinary ones, and a prompt holding one: they
    add no text (the text is the tokenizer's decode of the other ids), nothing crashes; ids past
    the model's rows are refused naming the id and the range."""
    llm = LLM(model=padding_yuan, max_model_len=128, num_gpu_blocks_override=32, seed=0)
    tokenizer = llm.get_tokenizer()
    pieces = len(tokenizer)
    assert pieces < 135000 < 135040
    out = llm.generate(
        [{"prompt_token_ids": [100, 135000]}, "Hello", "Once upon a time"],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1, skip_special_tokens=False),
        use_tqdm=False,
    )
    sampled = [t for o in out for t in o.outputs[0].token_ids]
    assert any(t >= pieces for t in sampled) and any(t < pieces for t in sampled)
    for o in out:
        c = o.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 16
        # Decoded after the prompt, as the detokenizer does (SentencePiece keeps the first leading space).
        prompt = [t for t in o.prompt_token_ids if t < pieces]
        kept = [t for t in c.token_ids if t < pieces]
        assert c.text == tokenizer.decode(prompt + kept)[len(tokenizer.decode(prompt)) :]
        assert all(entry[t].decoded_token == "" for t, entry in zip(c.token_ids, c.logprobs) if t >= pieces)
    with pytest.raises(InvalidRequest, match=r"135040 .*\[0, 135040\)"):
        llm.generate([{"prompt_token_ids": [100, 135040]}], SamplingParams(max_tokens=1), use_tqdm=False)


def test_decoding_helpers_drop_ids_without_a_piece(wide_yuan):
    llm = LLM(model=wide_yuan, max_model_len=64, num_gpu_blocks_override=8)
    tok = llm.get_tokenizer()
    pieces = len(tok)
    with pytest.raises(IndexError):  # the reference: SentencePiece itself refuses such an id
        tok.decode([100, pieces + 5])
    assert decode_ids(tok, [100, pieces + 5, 200, -1]) == tok.decode([100, 200])
    assert single_token_decoder(tok)(pieces) == ""
    detok = IncrementalDetokenizer(tok, [100, pieces + 1])
    for t in [200, pieces + 2, 300]:
        detok.update_one(t)
    detok.finish()
    assert detok.output_text == tok.decode([200, 300])
