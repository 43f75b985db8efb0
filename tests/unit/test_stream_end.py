"""The end of a streamed response: the last token chunk, the usage chunk (include_usage) and `data: [DONE]`
go out in one write, and the events are exactly those of the pydantic models, in OpenAI's order
(chunks, usage, [DONE] once). The reference events are built here from the protocol models."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.server import protocol as p
from pagoda.server.metrics import ServerMetrics
from pagoda.server.serving import OpenAIServing, ServingContext
from pagoda.server.sse import sse_response

PROMPT = [5, 6, 7]


class FakeEngine:
    """One step of deltas per text for each request (by default "a", "b", "c"), the last one finished; each
    step carries one token."""

    is_dead = False
    stats = None

    def __init__(self, texts: tuple[str, ...] = ("a", "b", "c")):
        self.texts = texts

    async def generate_batches(self, ids, params, prompt=None, delta=True, request_id=None, mm_inputs=None):
        for step, text in enumerate(self.texts):
            done = step == len(self.texts) - 1
            yield [
                RequestOutput(
                    request_id or "x",
                    prompt,
                    ids,
                    [CompletionOutput(0, text, [100 + step], None, None, "length" if done else None)],
                    done,
                    0,
                    0.0 if done else None,
                )
            ]
            await asyncio.sleep(0)


def serving(engine: FakeEngine | None = None) -> OpenAIServing:
    ctx = ServingContext(
        engine=engine or FakeEngine(),
        tokenizer=None,
        served_model_names=["m"],
        max_model_len=1024,  # type: ignore[arg-type]
        vocab_size=1000,
        architecture="Fake",
        chat_template=None,
        metrics=ServerMetrics("m-stream-end-test"),
    )
    return OpenAIServing(ctx)


async def writes(events) -> list[str]:
    response = sse_response(events)
    return [w.decode() if isinstance(w, bytes) else w async for w in response.body_iterator]


def parse(text: str) -> list[str]:
    assert text.endswith("\n\n")
    return [event.removeprefix("data: ") for event in text[:-2].split("\n\n")]


def token_chunks(out: list[str], usage_reference) -> list[dict]:  # type: ignore[no-untyped-def]
    """Checks the stream's end against the reference; returns its token chunks. `usage_reference(first
    chunk)` is the expected usage chunk's JSON; None without include_usage."""
    events = parse("".join(out))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    if usage_reference is not None:
        assert chunks[-1] == json.loads(usage_reference(chunks[0]))
        chunks = chunks[:-1]
    last = parse(out[-1])  # the final write carries the end of the stream
    assert last[-1] == "[DONE]" and json.loads(last[0])["choices"][-1]["finish_reason"] == "length"
    assert len(last) == (3 if usage_reference is not None else 2)
    return chunks


@pytest.mark.parametrize("prompts", [1, 2])
@pytest.mark.parametrize("usage", [False, True])
def test_completion_stream_end(prompts: int, usage: bool) -> None:
    server = serving()
    body = {"model": "m", "prompt": PROMPT if prompts == 1 else [PROMPT] * prompts, "max_tokens": 3, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}

    async def run() -> list[str]:
        return await writes(await server.completion_stream(p.CompletionRequest(**body), 0.0))

    expected_usage = p.UsageInfo(prompt_tokens=3 * prompts, completion_tokens=3 * prompts, total_tokens=6 * prompts)
    chunks = token_chunks(
        asyncio.run(run()),
        (
            lambda head: p.CompletionResponse(
                id=head["id"], created=head["created"], model="m", choices=[], usage=expected_usage
            ).model_dump_json(exclude_none=True)
        )
        if usage
        else None,
    )
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {i: "abc" for i in range(prompts)}


@pytest.mark.parametrize("usage", [False, True])
def test_chat_stream_end(usage: bool) -> None:
    server = serving()

    async def chat_prompt(*args, **kwargs):
        return "text", PROMPT, None

    server.chat_prompt = chat_prompt  # type: ignore[method-assign]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}

    async def run() -> list[str]:
        return await writes(await server.chat_stream(p.ChatCompletionRequest(**body), 0.0))

    chunks = token_chunks(
        asyncio.run(run()),
        (
            lambda head: p.ChatCompletionChunk(
                id=head["id"],
                created=head["created"],
                model="m",
                choices=[],
                usage=p.UsageInfo(prompt_tokens=3, completion_tokens=3, total_tokens=6),
            ).model_dump_json()
        )
        if usage
        else None,
    )
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "abc"


def test_chat_role_chunk_goes_out_with_the_first_tokens() -> None:
    """Not before the prefill: a client that times the first chunk with choices (vLLM's `bench serve`) would
    otherwise see a TTFT of ~0 and count the prefill as decode time."""
    server = serving()

    async def chat_prompt(*args, **kwargs):
        return "text", PROMPT, None

    server.chat_prompt = chat_prompt  # type: ignore[method-assign]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}

    async def run() -> list[str]:
        return await writes(await server.chat_stream(p.ChatCompletionRequest(**body), 0.0))

    first = [json.loads(e) for e in parse(asyncio.run(run())[0])]
    assert [c["choices"][0]["delta"] for c in first] == [
        {"role": "assistant", "content": ""},
        {"role": None, "content": "a"},
    ]


def test_every_step_with_tokens_is_an_event_even_without_text() -> None:
    """A token whose text is held back (an incomplete UTF-8 sequence, a possible stop string) or that has no
    piece in the tokenizer still makes a chunk, with empty text: a client that times events (vLLM's `bench
    serve` counts each as one token's arrival) sees one per step instead of bursts at the next visible text."""
    texts = ("a", "", "", "b", "", "c")
    server = serving(FakeEngine(texts))

    async def chat_prompt(*args, **kwargs):
        return "text", PROMPT, None

    server.chat_prompt = chat_prompt  # type: ignore[method-assign]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}
    completion = {"model": "m", "prompt": PROMPT, "max_tokens": 6, "stream": True}

    async def run() -> tuple[list[str], list[str]]:
        return (
            await writes(await server.chat_stream(p.ChatCompletionRequest(**chat), 0.0)),
            await writes(await server.completion_stream(p.CompletionRequest(**completion), 0.0)),
        )

    chat_out, completion_out = asyncio.run(run())
    chat_chunks = token_chunks(chat_out, None)
    assert chat_chunks[0]["choices"][0]["delta"]["role"] == "assistant"  # the role chunk, then one per step
    assert [c["choices"][0]["delta"]["content"] for c in chat_chunks[1:]] == list(texts)
    assert [c["choices"][0]["text"] for c in token_chunks(completion_out, None)] == list(texts)
