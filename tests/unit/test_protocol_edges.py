"""The HTTP protocol's smaller promises, checked in-process (no engine, no model): what /openapi.json
documents for errors, /v1/models while the engine is dead, chat message roles and content, and
error messages that name the right field and do not echo huge or undecodable input back."""

from __future__ import annotations

import json
import types

import pytest
from fastapi.testclient import TestClient

from pagoda.frontend.prompt_work import PromptWork
from pagoda.server import protocol as p
from pagoda.server.app import build_app
from pagoda.server.serving import OpenAIServing, ServingContext

MODEL = "m"


@pytest.fixture
def engine() -> types.SimpleNamespace:
    return types.SimpleNamespace(is_dead=False, dead_reason=None)


@pytest.fixture
def client(engine) -> TestClient:
    ctx = ServingContext(
        engine=engine,
        tokenizer=None,
        served_model_names=[MODEL],
        max_model_len=64,
        vocab_size=100,
        architecture="LlamaForCausalLM",
        chat_template=None,
        metrics=None,
    )  # type: ignore[arg-type]
    return TestClient(build_app(OpenAIServing(ctx)), raise_server_exceptions=False)


def post(client: TestClient, path: str, body: dict):  # type: ignore[no-untyped-def]
    # json.dumps: \ud800 escapes are sent as a client's JSON encoder writes them.
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def error_of(response, status: int) -> dict:  # type: ignore[no-untyped-def]
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["type"], error
    return error


# ---- /openapi.json ---------------------------------------------------------------------------
def test_openapi_documents_400_in_openai_shape_and_never_422(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert '"422"' not in json.dumps(schema) and "HTTPValidationError" not in json.dumps(schema)
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        responses = schema["paths"][path]["post"]["responses"]
        assert responses["400"]["content"]["application/json"]["schema"] == error_ref, path
        assert "404" in responses and "401" in responses, path
    assert (
        schema["paths"]["/v1/models"]["get"]["responses"]["503"]["content"]["application/json"]["schema"] == error_ref
    )
    components = schema["components"]["schemas"]
    assert components["ErrorResponse"]["properties"]["error"] == {"$ref": "#/components/schemas/ErrorInfo"}
    assert set(components["ErrorInfo"]["properties"]) == {"message", "type", "param", "code"}
    # What it documents is what a schema error gets.
    error = error_of(post(client, "/v1/completions", {"prompt": "hi", "max_tokens": "many"}), 400)
    assert error["type"] == "BadRequestError" and error["param"] == "max_tokens"


# ---- /v1/models ------------------------------------------------------------------------------
def test_models_is_503_while_the_engine_is_dead(client: TestClient, engine) -> None:
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    engine.is_dead, engine.dead_reason = True, "the engine core process exited"
    response = client.get("/v1/models")
    error = error_of(response, 503)
    assert error["type"] == "ServiceUnavailableError" and "exited" in error["message"]
    assert int(response.headers["Retry-After"]) > 0
    assert client.get("/health").status_code == 503


# ---- chat messages ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "messages,param",
    [
        ([{"role": "bogus", "content": "hi"}], "messages.0.role"),
        ([{"role": "function", "content": "hi"}], "messages.0.role"),
        ([{"role": "user", "content": None}], "messages.0.content"),
        ([{"role": "user"}], "messages.0.content"),
        ([{"role": "user", "content": "hi"}, {"role": "system", "content": None}], "messages.1.content"),
        ([{"role": "tool", "content": None, "tool_call_id": "t"}], "messages.0.content"),
    ],
)
def test_bad_roles_and_missing_content_are_400(client: TestClient, messages: list, param: str) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        error = error_of(post(client, path, {"messages": messages}), 400)
        assert error["param"] == param, error


def test_assistant_message_may_omit_content() -> None:
    message = p.ChatMessage(role="assistant", content=None)
    assert message.content is None
    assert p.ChatMessage(role="developer", content="be brief").role == "developer"


def test_assistant_only_conversation_is_400_unless_continuing_it(client: TestClient) -> None:
    only_assistant = [{"role": "assistant", "content": "The capital of France is"}]
    error = error_of(post(client, "/v1/chat/completions", {"messages": only_assistant}), 400)
    assert error["param"] == "messages" and "continue_final_message" in error["message"]
    # Continuing it gets past that check (this in-process server has no tokenizer to go further).
    error = error_of(
        post(
            client,
            "/v1/chat/completions",
            {"messages": only_assistant, "continue_final_message": True, "add_generation_prompt": False},
        ),
        400,
    )
    assert "tokenizer" in error["message"]


# ---- fields named right; input not echoed whole ----------------------------------------------
@pytest.mark.parametrize("value", [1000, 21, -1])
def test_top_logprobs_out_of_range_names_top_logprobs(client: TestClient, value: int) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": value}
    error = error_of(post(client, "/v1/chat/completions", body), 400)
    assert error["param"] == "top_logprobs" and "20" in error["message"], error


def test_detokenize_errors_name_tokens_and_no_tokens_is_empty_text(client: TestClient) -> None:
    error = error_of(post(client, "/detokenize", {"tokens": [5, 100]}), 400)
    assert error["param"] == "tokens" and "prompt" not in error["message"], error
    error = error_of(post(client, "/detokenize", {"tokens": [-1]}), 400)
    assert error["param"] == "tokens"
    assert post(client, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_a_huge_model_name_is_not_echoed_back(client: TestClient) -> None:
    name = "x" * 1_000_000
    response = post(client, "/v1/completions", {"model": name, "prompt": "hi"})
    error = error_of(response, 404)
    assert len(response.content) < 2000 and "1000000 characters" in error["message"], error["message"][:300]
    assert MODEL in error["message"] and error["param"] == "model"


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/tokenize", {"prompt": "\udfff"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\ud83d"]}, "prompt"),
    ],
)
def test_lone_surrogates_are_400(client: TestClient, path: str, body: dict, param: str) -> None:
    # The server here has no tokenizer: give it an encoder so the check before encoding is reached.
    client.app.state.serving.prompts = PromptWork(types.SimpleNamespace(encode=lambda text, **kwargs: [1]), 64)
    error = error_of(post(client, path, body), 400)
    assert error["param"] == param and "surrogate" in error["message"], error


def test_errors_quoting_undecodable_text_still_go_out(client: TestClient) -> None:
    response = post(client, "/v1/completions", {"model": "gpt\ud800", "prompt": "hi"})
    error = error_of(response, 404)
    assert "gpt\ud800" in error["message"]
    assert response.content.isascii()
