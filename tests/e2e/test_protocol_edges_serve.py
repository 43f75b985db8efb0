"""The embedded model's sampling defaults and the chat protocol's edges, on the shared real server
(SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json

import httpx
from e2e_helpers import CAPITAL_QUESTION, MODEL, assert_openai_error

CHAT = "/v1/chat/completions"


def test_readme_example_answers_quickly(http: httpx.Client) -> None:
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
