"""The embedded model's sampling defaults and the chat protocol's edges, on the shared real server
(SmolLM2-135M-Instruct)."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
from e2e_helpers import CAPITAL_QUESTION, MODEL, assert_openai_error

CHAT = "/v1/chat/completions"


def test_the_capital_question_answers_quickly(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": CAPITAL_QUESTION, "temperature": 0, "max_tokens": 64}
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert "Paris" in answer["choices"][0]["message"]["content"], answer
    assert answer["usage"]["completion_tokens"] <= 64


def test_a_bare_request_gets_the_embedded_defaults(server, http: httpx.Client) -> None:
    """No temperature, no max_tokens: the shipped defaults (logged at startup) bound the answer."""
    log = server.log_path.read_text(errors="replace")
    assert "Sampling defaults" in log and "'temperature': 0.2" in log and "'max_tokens': 256" in log, log[-3000:]
    response = http.post(CHAT, json={"model": MODEL, "messages": CAPITAL_QUESTION})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 256


def test_roles_and_content_as_openai_checks_them(http: httpx.Client) -> None:
    for messages, param in [
        ([{"role": "bogus", "content": "hi"}], "messages.0.role"),
        ([{"role": "user", "content": None}], "messages.0.content"),
        ([{"role": "assistant", "content": "Paris."}], "messages"),
    ]:
        error = assert_openai_error(http.post(CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 1}), 400)
        assert error["param"] == param, error
    # An assistant turn without content (one that called tools) is fine between user turns.
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None},
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": "Hello?"},
    ]
    assert http.post(CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 1}).status_code == 200


def test_an_assistant_only_conversation_can_be_continued(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "assistant", "content": "The capital of France is"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 3,
        "temperature": 0,
    }
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


def test_lone_surrogates_are_400_not_500(http: httpx.Client) -> None:
    for path, body, param in [
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x\ud800"}], "max_tokens": 1}, "messages"),
        (
            CHAT,
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}],
                "max_tokens": 1,
            },
            "messages",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "\ud83d", "max_tokens": 1}, "prompt"),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ]:
        response = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        error = assert_openai_error(response, 400, contains="surrogate")
        assert error["param"] == param, error


def test_detokenize_names_tokens(http: httpx.Client) -> None:
    error = assert_openai_error(http.post("/detokenize", json={"model": MODEL, "tokens": [1, 10**9]}), 400)
    assert error["param"] == "tokens" and "prompt" not in error["message"]
    assert http.post("/detokenize", json={"model": MODEL, "tokens": []}).json() == {"prompt": ""}


def test_top_logprobs_limit_is_named(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": CAPITAL_QUESTION, "max_tokens": 1, "logprobs": True, "top_logprobs": 1000}
    error = assert_openai_error(http.post(CHAT, json=body), 400)
    assert error["param"] == "top_logprobs" and "20" in error["message"]
    body["top_logprobs"] = 20
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


def test_sampling_knobs_float32_cannot_hold_are_refused(http: httpx.Client) -> None:
    # 1e308 was inf on the device: with a grammar every logit went NaN and token 0 came out, outside it.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    for field in ("temperature", "repetition_penalty"):
        body = {"model": MODEL, "messages": CAPITAL_QUESTION, "max_tokens": 8, field: 1e308}
        error = assert_openai_error(http.post(CHAT, json={**body, "response_format": response_format}), 400)
        assert error["param"] == field and "float32" in error["message"], error
    # The largest values accepted stay inside the grammar.
    body = {
        "model": MODEL,
        "messages": CAPITAL_QUESTION,
        "max_tokens": 8,
        "temperature": 3.4e38,
        "repetition_penalty": 3.4e38,
        "structured_outputs": {"choice": ["yes", "no"]},
    }
    for _ in range(3):
        response = http.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] in ("yes", "no"), response.json()


def test_vllm_request_options_on_the_real_model(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": CAPITAL_QUESTION, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    response = http.post(CHAT, json=body, headers={"X-Request-Id": "trace-7"})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["id"] == "chatcmpl-trace-7"
    # The ids are those /tokenize gives for the same messages and /detokenize turns back into the reply.
    tokenized = http.post("/tokenize", json={"model": MODEL, "messages": CAPITAL_QUESTION}).json()
    assert answer["prompt_token_ids"] == tokenized["tokens"]
    choice = answer["choices"][0]
    assert len(choice["token_ids"]) == answer["usage"]["completion_tokens"]
    detokenized = http.post("/detokenize", json={"model": MODEL, "tokens": choice["token_ids"]}).json()["prompt"]
    assert detokenized == choice["message"]["content"]
    # The same client id twice at once: both answered, under the id they gave.
    with httpx.Client(base_url=str(http.base_url), headers=dict(http.headers), timeout=120) as other:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            same = {**body, "request_id": "dup", "max_tokens": 16}
            replies = list(pool.map(lambda c: c.post(CHAT, json=same), (http, other)))
    assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
    assert {r.json()["id"] for r in replies} == {"chatcmpl-dup"}
    # Priority needs --scheduling-policy priority; this server schedules FCFS.
    error = assert_openai_error(http.post(CHAT, json={**body, "priority": 2}), 400)
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
