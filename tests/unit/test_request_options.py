"""vLLM's per-request options on the HTTP API, each checked by its effect on what the engine is asked and on
the response (in-process: a stand-in engine that records every request and answers with known tokens, and a
character-level tokenizer with a BOS, so token ids are known): request_id / X-Request-Id, cache_salt,
priority, return_token_ids, return_tokens_as_token_ids, add_special_tokens, chat echo; and the 400s of the
fields Pagoda refuses, of echo with logprobs and of a tool message that answers no call."""

from __future__ import annotations

import json
from typing import Any

import jinja2
import pytest
from fastapi.testclient import TestClient

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.server import protocol as p
from pagoda.server.app import build_app
from pagoda.server.metrics import ServerMetrics
from pagoda.server.serving import OpenAIServing, ServingContext

MODEL = "m"
BOS = 1
REPLY = [40, 41, 42]  # the stand-in engine's answer to every request: "ABC"
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


class CharTokenizer:
    """One token per character (id = code point - 25, so "A" is 40), BOS = 1 when special tokens are added."""

    chat_template = TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + [ord(c) - 25 for c in text]

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(i + 25) for i in ids if i != BOS)

    def apply_chat_template(
        self, messages: list, chat_template: str, tokenize: bool, add_generation_prompt: bool, **variables: Any
    ) -> str:
        return jinja2.Template(chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def __len__(self) -> int:
        return 200


class RecordingEngine:
    is_dead, dead_reason = False, None

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def generate_batches(self, prompt_token_ids, params, prompt, delta, request_id, mm_inputs, **kwargs):  # noqa: ANN001, ANN201
        self.calls.append({"ids": list(prompt_token_ids), "request_id": request_id, "params": params, **kwargs})
        for i, token in enumerate(REPLY):
            last = i == len(REPLY) - 1
            lp = [{token: Logprob(-0.25, 1, chr(token + 25)), token + 1: Logprob(-2.0, 2, chr(token + 26))}]
            outputs = [
                CompletionOutput(
                    k,
                    chr(token + 25),
                    [token],
                    None,
                    lp if params.logprobs is not None else None,
                    "stop" if last else None,
                )
                for k in range(params.n)
            ]
            yield [RequestOutput(request_id, prompt, list(prompt_token_ids), outputs, last)]


@pytest.fixture
def engine() -> RecordingEngine:
    return RecordingEngine()


def _client(engine: RecordingEngine, policy: str = "fcfs") -> TestClient:
    ctx = ServingContext(
        engine=engine,  # type: ignore[arg-type]
        tokenizer=CharTokenizer(),
        served_model_names=[MODEL],
        max_model_len=512,
        vocab_size=200,
        architecture="LlamaForCausalLM",
        chat_template=None,
        metrics=ServerMetrics(MODEL),
        scheduling_policy=policy,
    )
    return TestClient(build_app(OpenAIServing(ctx)), raise_server_exceptions=False)


@pytest.fixture
def client(engine: RecordingEngine) -> TestClient:
    return _client(engine)


def _post(client: TestClient, path: str, body: dict, **headers: str) -> Any:
    response = client.post(path, json={"model": MODEL, "max_tokens": 3, **body}, headers=headers)
    return response


def _ok(response: Any) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def _events(response: Any) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _refused(response: Any, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


USER = [{"role": "user", "content": "Hi"}]


# ---- request_id and X-Request-Id -----------------------------------------------------------------
def test_the_response_id_carries_the_request_id(client: TestClient, engine: RecordingEngine) -> None:
    assert _ok(_post(client, "/v1/chat/completions", {"messages": USER, "request_id": "abc"}))["id"] == "chatcmpl-abc"
    assert _ok(_post(client, "/v1/completions", {"prompt": "x", "request_id": "abc"}))["id"] == "cmpl-abc"
    # The header wins over the body, streamed too.
    got = _post(
        client, "/v1/completions", {"prompt": "x", "request_id": "body", "stream": True}, **{"X-Request-Id": "hdr"}
    )
    assert {e["id"] for e in _events(got)} == {"cmpl-hdr"}
    assert _ok(_post(client, "/v1/chat/completions", {"messages": USER}))["id"].startswith("chatcmpl-")
    # Reused ids (and the prompts of one request) are distinct inside the engine.
    engine_ids = [call["request_id"] for call in engine.calls]
    _ok(_post(client, "/v1/completions", {"prompt": ["x", "y"], "request_id": "abc"}))
    engine_ids += [call["request_id"] for call in engine.calls[len(engine_ids) :]]
    assert len(set(engine_ids)) == len(engine_ids)
    assert all(rid.startswith("abc-") for rid in engine_ids[:2] + engine_ids[-2:])


# ---- cache_salt and priority reach the engine ------------------------------------------------------
def test_cache_salt_and_priority_reach_the_engine(engine: RecordingEngine) -> None:
    client = _client(engine, policy="priority")
    _ok(_post(client, "/v1/chat/completions", {"messages": USER, "cache_salt": "tenant-a", "priority": -5}))
    _ok(_post(client, "/v1/completions", {"prompt": "x"}))
    assert engine.calls[0]["cache_salt"] == "tenant-a" and engine.calls[0]["priority"] == -5
    assert "cache_salt" not in engine.calls[1] and "priority" not in engine.calls[1]
    _refused(_post(client, "/v1/completions", {"prompt": "x", "cache_salt": ""}), "cache_salt")


def test_priority_under_fcfs_is_a_400_naming_the_flag(client: TestClient, engine: RecordingEngine) -> None:
    message = _refused(_post(client, "/v1/completions", {"prompt": "x", "priority": 1}), "priority")
    assert "--scheduling-policy priority" in message
    _ok(_post(client, "/v1/completions", {"prompt": "x", "priority": 0}))
    assert len(engine.calls) == 1


# ---- return_token_ids ----------------------------------------------------------------------------
def test_return_token_ids_non_streamed(client: TestClient) -> None:
    chat = _ok(_post(client, "/v1/chat/completions", {"messages": USER, "return_token_ids": True}))
    assert chat["prompt_token_ids"] == CharTokenizer().encode("<user>Hi<assistant>", add_special_tokens=False)
    assert chat["choices"][0]["token_ids"] == REPLY and chat["choices"][0]["message"]["content"] == "ABC"
    completion = _ok(_post(client, "/v1/completions", {"prompt": ["ab", "c"], "return_token_ids": True}))
    assert [c["prompt_token_ids"] for c in completion["choices"]] == [[BOS, 72, 73], [BOS, 74]]
    assert [c["token_ids"] for c in completion["choices"]] == [REPLY, REPLY]
    # Not asked: the response keeps its shape.
    plain = _ok(_post(client, "/v1/chat/completions", {"messages": USER}))
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_return_token_ids_streamed(client: TestClient) -> None:
    events = _events(
        _post(client, "/v1/chat/completions", {"messages": USER, "return_token_ids": True, "stream": True})
    )
    assert events[0]["prompt_token_ids"] == CharTokenizer().encode("<user>Hi<assistant>", add_special_tokens=False)
    assert all("prompt_token_ids" not in e for e in events[1:])
    assert [t for e in events for c in e["choices"] for t in c.get("token_ids") or []] == REPLY
    events = _events(_post(client, "/v1/completions", {"prompt": "ab", "return_token_ids": True, "stream": True}))
    choices = [c for e in events for c in e["choices"]]
    assert choices[0]["prompt_token_ids"] == [BOS, 72, 73] and all("prompt_token_ids" not in c for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == REPLY


# ---- return_tokens_as_token_ids ------------------------------------------------------------------
def test_logprob_tokens_as_token_ids(client: TestClient) -> None:
    body = {"messages": USER, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    content = _ok(_post(client, "/v1/chat/completions", body))["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in REPLY]
    assert [e["token"] for e in content[0]["top_logprobs"]] == ["token_id:40", "token_id:41"]
    assert content[0]["bytes"] == list(b"token_id:40")
    streamed = _events(_post(client, "/v1/chat/completions", {**body, "stream": True}))
    tokens = [
        e["token"] for ev in streamed for c in ev["choices"] for e in (c.get("logprobs") or {}).get("content") or []
    ]
    assert tokens == [f"token_id:{t}" for t in REPLY]
    legacy = _ok(_post(client, "/v1/completions", {"prompt": "x", "logprobs": 1, "return_tokens_as_token_ids": True}))
    lp = legacy["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in REPLY] and list(lp["top_logprobs"][0]) == [
        "token_id:40",
        "token_id:41",
    ]
    assert lp["text_offset"] == [0, 1, 2]  # offsets stay those of the text
    plain = _ok(_post(client, "/v1/completions", {"prompt": "x", "logprobs": 1}))["choices"][0]["logprobs"]
    assert plain["tokens"] == ["A", "B", "C"]


# ---- add_special_tokens --------------------------------------------------------------------------
def test_add_special_tokens_changes_the_prompt(client: TestClient, engine: RecordingEngine) -> None:
    _ok(_post(client, "/v1/completions", {"prompt": "ab"}))  # default true, as OpenAI's tokenizers
    _ok(_post(client, "/v1/completions", {"prompt": "ab", "add_special_tokens": False}))
    _ok(_post(client, "/v1/chat/completions", {"messages": USER}))  # default false: the template writes them
    _ok(_post(client, "/v1/chat/completions", {"messages": USER, "add_special_tokens": True}))
    prompts = [call["ids"] for call in engine.calls]
    assert prompts[0] == [BOS, 72, 73] and prompts[1] == [72, 73]
    assert prompts[2][0] != BOS and prompts[3] == [BOS, *prompts[2]]


# ---- chat echo -----------------------------------------------------------------------------------
def test_chat_echo_prepends_the_last_message_of_the_reply_role(client: TestClient) -> None:
    prefill = [*USER, {"role": "assistant", "content": "Hello, "}]
    body = {"messages": prefill, "echo": True, "add_generation_prompt": False, "continue_final_message": True}
    assert _ok(_post(client, "/v1/chat/completions", body))["choices"][0]["message"]["content"] == "Hello, ABC"
    events = _events(_post(client, "/v1/chat/completions", {**body, "stream": True, "n": 2}))
    for i in range(2):
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"] if c["index"] == i)
        assert text == "Hello, ABC"
    # With a generation prompt the reply is the assistant's: a last user message is not echoed.
    assert (
        _ok(_post(client, "/v1/chat/completions", {"messages": USER, "echo": True}))["choices"][0]["message"]["content"]
        == "ABC"
    )


# ---- refused ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("repetition_detection", {"max_pattern_size": 4}),
        ("thinking_token_budget", 100),
        ("reasoning_effort", "low"),
        ("include_reasoning", False),
        ("documents", [{"title": "t", "text": "x"}]),
        ("media_io_kwargs", {"video": {"num_frames": 4}}),
        ("vllm_xargs", {"k": 1}),
        ("kv_transfer_params", {"do_remote_decode": True}),
        ("prompt_embeds", "AAAA"),
        ("truncation_side", "left"),
    ],
)
def test_unimplemented_vllm_fields_are_refused(
    client: TestClient, engine: RecordingEngine, field: str, value: Any
) -> None:
    assert field in p.REFUSED_FIELDS
    message = _refused(_post(client, "/v1/chat/completions", {"messages": USER, field: value}), field)
    assert "not supported" in message
    _refused(_post(client, "/v1/completions", {"prompt": "x", field: value}), field)
    assert not engine.calls


def test_completion_echo_with_logprobs_is_refused(client: TestClient) -> None:
    assert "prompt" in _refused(_post(client, "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}), "echo")
    assert _ok(_post(client, "/v1/completions", {"prompt": "xy", "echo": True}))["choices"][0]["text"] == "xyABC"


def test_a_tool_message_must_answer_an_earlier_call(client: TestClient) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    answered = [
        *USER,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"},
    ]
    _ok(_post(client, "/v1/chat/completions", {"messages": answered}))
    for tool_message in ({"role": "tool", "tool_call_id": "call_2", "content": "1"}, {"role": "tool", "content": "1"}):
        message = _refused(
            _post(client, "/v1/chat/completions", {"messages": [*answered[:2], tool_message]}), "messages"
        )
        assert "messages[2]" in message
    # A call made after the tool message does not count.
    late = [
        *USER,
        {"role": "tool", "tool_call_id": "call_1", "content": "1"},
        {"role": "assistant", "tool_calls": [call]},
    ]
    _refused(_post(client, "/v1/chat/completions", {"messages": late, "add_generation_prompt": True}), "messages")


def test_logprob_token_ids_reach_the_sampler_and_need_logprobs(client: TestClient, engine: RecordingEngine) -> None:
    body = {"messages": USER, "logprobs": True, "logprob_token_ids": [41, 7]}
    _ok(_post(client, "/v1/chat/completions", body))
    _ok(_post(client, "/v1/completions", {"prompt": "x", "logprobs": 0, "logprob_token_ids": [3]}))
    assert [call["params"].logprob_token_ids for call in engine.calls] == [[41, 7], [3]]
    assert "needs logprobs" in _refused(
        _post(client, "/v1/chat/completions", {"messages": USER, "logprob_token_ids": [41]}), "logprob_token_ids"
    )
    _refused(
        _post(client, "/v1/completions", {"prompt": "x", "logprobs": 1, "logprob_token_ids": [200]}),
        "logprob_token_ids",
    )
    _refused(
        _post(client, "/v1/completions", {"prompt": "x", "logprobs": 1, "logprob_token_ids": []}), "logprob_token_ids"
    )
    assert len(engine.calls) == 2


def test_tokenize_of_messages_counts_what_a_chat_request_sends(client: TestClient, engine: RecordingEngine) -> None:
    for extra in ({}, {"add_special_tokens": True}):
        tokens = _ok(client.post("/tokenize", json={"model": MODEL, "messages": USER, **extra}))["tokens"]
        _ok(_post(client, "/v1/chat/completions", {"messages": USER, **extra}))
        assert tokens == engine.calls[-1]["ids"]
    assert engine.calls[-1]["ids"][0] == BOS and engine.calls[0]["ids"][0] != BOS
