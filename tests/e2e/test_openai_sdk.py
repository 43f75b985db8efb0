"""The official `openai` SDK (sync, async, streaming) against a real `pagoda serve`."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from e2e_helpers import API_KEY, CAPITAL_QUESTION, MODEL, sse_json, sse_payloads
from openai import AsyncOpenAI, OpenAI

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy_chat(client: OpenAI):
    """The greedy answer to the capital question, computed once and compared against elsewhere."""
    return client.chat.completions.create(model=MODEL, messages=CAPITAL_QUESTION, max_tokens=24, **GREEDY)


def tokenize(http: httpx.Client, **body) -> list[int]:
    response = http.post("/tokenize", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["count"] == len(data["tokens"])
    return data["tokens"]


def test_models_lists_served_name_with_max_model_len(client: OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model"
    assert models[0].model_extra["max_model_len"] == 2048


def test_sdk_raises_typed_errors(client: OpenAI, base_url: str) -> None:
    """Our OpenAI-shaped errors become the SDK's exception classes, with our message."""
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=CAPITAL_QUESTION, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048"):
        client.completions.create(model=MODEL, prompt=[1000] * 2040, max_tokens=100)
    wrong_key = OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()


def test_chat_greedy_answers_paris(greedy_chat, http: httpx.Client) -> None:
    choice = greedy_chat.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert choice.index == 0 and len(greedy_chat.choices) == 1
    assert greedy_chat.model == MODEL and greedy_chat.object == "chat.completion"
    usage = greedy_chat.usage
    assert usage.prompt_tokens == len(tokenize(http, messages=CAPITAL_QUESTION))
    assert 0 < usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_async_client_concurrent_chats(base_url: str, greedy_chat) -> None:
    async def main() -> list:
        async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(
                *[
                    aclient.chat.completions.create(model=MODEL, messages=CAPITAL_QUESTION, max_tokens=24, **GREEDY)
                    for _ in range(3)
                ]
            )

    for response in asyncio.run(main()):
        assert "Paris" in response.choices[0].message.content
        assert response.usage.prompt_tokens == greedy_chat.usage.prompt_tokens


def test_completion_string_prompt_usage_matches_tokenize(client: OpenAI, http: httpx.Client) -> None:
    prompt = "The quick brown fox"
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert response.object == "text_completion"
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert response.usage.prompt_tokens == len(tokenize(http, prompt=prompt))
    assert response.usage.completion_tokens == 6
    assert response.usage.total_tokens == response.usage.prompt_tokens + 6


def test_completion_list_of_prompts_and_token_ids(client: OpenAI, http: httpx.Client) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.usage.prompt_tokens == sum(len(tokenize(http, prompt=p)) for p in prompts)
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + batch.usage.completion_tokens

    # The same prompt as token ids gives the same greedy text and the same usage.
    ids = tokenize(http, prompt=prompts[0])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, **GREEDY)
    assert by_ids.choices[0].text == batch.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    # A list of token-id lists is a batch too.
    by_lists = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=2, **GREEDY)
    assert [c.index for c in by_lists.choices] == [0, 1]
    assert by_lists.usage.prompt_tokens == len(ids) + 3


def test_n_choices_have_distinct_indexes(client: OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=CAPITAL_QUESTION, max_tokens=4, n=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    assert all(c.message.content is not None for c in chat.choices)
    assert chat.usage.completion_tokens <= 3 * 4

    completion = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=3,
        n=2,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in completion.choices) == [0, 1]
    assert completion.usage.completion_tokens == 2 * 3


def test_stop_string_cuts_text(client: OpenAI, greedy_chat) -> None:
    full = greedy_chat.choices[0].message.content
    assert "Paris" in full
    cut = client.chat.completions.create(
        model=MODEL, messages=CAPITAL_QUESTION, max_tokens=24, stop=["Paris"], **GREEDY
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == full[: full.index("Paris")]
    assert "Paris" not in choice.message.content
    assert choice.model_extra.get("stop_reason") == "Paris"


def test_seed_reproducibility(client: OpenAI) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL,
                prompt="My favourite animal is the",
                max_tokens=8,
                temperature=1.0,
                top_p=1.0,
                seed=seed,
                extra_body={"ignore_eos": True, "top_k": 0},
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    others = {sample(seed) for seed in (1, 2, 3)}
    assert len(others | {first}) > 1, "different seeds should (almost always) sample different text"


def test_chat_logprobs_shapes(client: OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=CAPITAL_QUESTION, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    )
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        ranked = [t.logprob for t in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode())


def test_completion_logprobs_shapes(client: OpenAI) -> None:
    response = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=4,
        logprobs=2,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    choice = response.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0
        assert 1 <= len(top) <= 3 and token in top
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy


def test_streamed_chat_matches_non_streamed(client: OpenAI, greedy_chat) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL_QUESTION,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    choice_chunks = [c for c in chunks if c.choices]
    finish = [c.choices[0].finish_reason for c in choice_chunks]
    assert finish[-1] == "stop" and all(f is None for f in finish[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    assert text == greedy_chat.choices[0].message.content
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.model_dump(exclude_none=True) == greedy_chat.usage.model_dump(exclude_none=True)
    assert all(c.usage is None for c in chunks[:-1])


def test_async_streaming_completion(base_url: str, client: OpenAI) -> None:
    expected = client.completions.create(model=MODEL, prompt="Roses are red,", max_tokens=8, **GREEDY)

    async def main() -> tuple[str, list]:
        async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as aclient:
            stream = await aclient.completions.create(
                model=MODEL, prompt="Roses are red,", max_tokens=8, stream=True, **GREEDY
            )
            chunks = [chunk async for chunk in stream]
            return "".join(c.choices[0].text for c in chunks if c.choices), chunks

    text, chunks = asyncio.run(main())
    assert text == expected.choices[0].text
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons[-1] == expected.choices[0].finish_reason and all(r is None for r in reasons[:-1])


def test_raw_stream_is_sse_with_done_terminator(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": CAPITAL_QUESTION,
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
        **GREEDY,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_json(sse_payloads(response))
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == (
        events[-1]["usage"]["prompt_tokens"] + events[-1]["usage"]["completion_tokens"]
    )

    with http.stream(
        "POST",
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True, "ignore_eos": True},
    ) as response:
        events = sse_json(sse_payloads(response))
    assert [e["choices"][0].get("finish_reason") for e in events][-1] == "length"
    assert all(e["object"] == "text_completion" for e in events)


def test_first_chunk_arrives_long_before_the_end(client: OpenAI) -> None:
    """Tokens are streamed as they are generated, not buffered until the end."""
    start = time.monotonic()
    first_content, count = None, 0
    stream = client.completions.create(
        model=MODEL,
        prompt="Write a long story about a dragon.",
        max_tokens=100,
        stream=True,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            count += 1
            if first_content is None:
                first_content = time.monotonic() - start
    total = time.monotonic() - start
    assert first_content is not None and count >= 50
    assert first_content < 0.5 * total, f"first chunk at {first_content:.2f}s of {total:.2f}s"
