"""Output processing through the whole engine with a real tokenizer (SmolLM2's, from the embedded
default model) on a tiny random-weight model: streamed deltas of n > 1 requests fold back into the
same samples as the final-only outputs, aborts finish every sample of a request, and logprob
alternatives carry the text of their token."""

from __future__ import annotations

import json
import random

import pytest

from pagoda import LLM, SamplingParams

VOCAB = 4096  # ids below this are common SmolLM2 tokens: readable text, stop strings that match


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory) -> str:
    from pagoda.models.gguf_checkpoint import default_gguf_path, load_gguf_tokenizer

    folder = tmp_path_factory.mktemp("tiny-smol")
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    (folder / "config.json").write_text(json.dumps(config))
    load_gguf_tokenizer(default_gguf_path()).save_pretrained(str(folder))
    return str(folder)


def _engine(folder: str):
    return LLM(
        model=folder, load_format="dummy", max_model_len=512, max_num_seqs=16, num_gpu_blocks_override=200, seed=0
    ).engine


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 30))] for _ in range(count)]


PARAMS = [
    SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=20, stop=["e", " the"]),
    SamplingParams(n=2, temperature=0.0, max_tokens=15, logprobs=2),
    SamplingParams(temperature=0.7, seed=9, max_tokens=25, stop=["\n"], include_stop_str_in_output=True),
    SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=12, min_tokens=4, ignore_eos=True),
]


def _run(folder: str, delta: bool) -> tuple[dict, list[list[str]]]:
    """Per request: per sample (text, token ids, finish reason, stop reason, logprobs); and the
    request ids of each step's outputs, in order."""
    engine = _engine(folder)
    for i, (prompt, params) in enumerate(zip(_prompts(len(PARAMS)), PARAMS)):
        engine.add_request(f"q{i}", prompt, params, delta=delta)
    got: dict[str, dict[int, list]] = {}
    order = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        order.append([o.request_id for o in outs])
        for out in outs:
            samples = got.setdefault(out.request_id, {})
            for c in out.outputs:
                s = samples.setdefault(c.index, ["", [], None, None, []])
                if delta:
                    s[0] += c.text
                    s[1] += c.token_ids
                    s[4] += c.logprobs or []
                else:
                    s[0], s[1], s[4] = c.text, c.token_ids, c.logprobs or []
                s[2], s[3] = c.finish_reason, c.stop_reason
    return got, order


def test_deltas_of_multi_sample_requests_fold_into_the_final_outputs(tiny_with_tokenizer):
    final, _ = _run(tiny_with_tokenizer, delta=False)
    streamed, order = _run(tiny_with_tokenizer, delta=True)
    assert streamed == final
    assert sorted(final) == ["q0", "q1", "q2", "q3"]
    assert [len(final[f"q{i}"]) for i in range(4)] == [3, 2, 1, 2]
    assert all(s[2] in ("stop", "length") for r in final.values() for s in r.values())
    # Every step reports each advanced request once, in the order the requests were added.
    for step in order:
        assert len(step) == len(set(step)) and step == sorted(step, key=lambda rid: int(rid[1:]))


def test_logprob_alternatives_carry_their_token_text(tiny_with_tokenizer):
    final, _ = _run(tiny_with_tokenizer, delta=False)
    engine = _engine(tiny_with_tokenizer)
    tokenizer = engine.tokenizer
    for sample in final["q1"].values():
        assert len(sample[4]) == len(sample[1])
        for token, entry in zip(sample[1], sample[4]):
            assert token in entry
            for tid, lp in entry.items():
                assert lp.decoded_token == tokenizer.decode([tid])


def test_abort_finishes_every_sample(tiny_with_tokenizer):
    engine = _engine(tiny_with_tokenizer)
    long = SamplingParams(n=3, temperature=0.8, seed=2, max_tokens=200, ignore_eos=True)
    engine.add_request("a", _prompts(1)[0], long, delta=True)
    engine.add_request("b", _prompts(2)[1], SamplingParams(max_tokens=200, ignore_eos=True), delta=False)
    for _ in range(4):
        engine.step()
    outs = engine.abort_request(["a", "b", "unknown"])
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    for out in outs:
        assert out.finished
        assert {c.finish_reason for c in out.outputs} == {"abort"}
    assert len(next(o for o in outs if o.request_id == "a").outputs) == 3
    assert not engine.has_unfinished_requests()
    assert engine.abort_request(["a"]) == []
    engine.block_manager.check_integrity([])
