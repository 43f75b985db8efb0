"""Every client mistake over raw HTTP: the right 4xx, an OpenAI-shaped body, never a 5xx.

The last test here kills the shared server's engine process (it is ordered after every other test).
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from e2e_helpers import API_KEY, CAPITAL_QUESTION, MODEL, assert_openai_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kill_race import assert_answered_503, fire_after_kill

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(**overrides) -> dict:
    return {"model": MODEL, "messages": CAPITAL_QUESTION, "max_tokens": 2, **overrides}


def completion_body(**overrides) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **overrides}


# ---- unknown model ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path,body",
    [
        (CHAT, chat_body(model="gpt-4o")),
        (COMPLETIONS, completion_body(model="gpt-4o")),
        (CHAT, chat_body(model="gpt-4o", stream=True)),
    ],
)
def test_unknown_model_is_404_listing_served_names(http: httpx.Client, path: str, body: dict) -> None:
    error = assert_openai_error(http.post(path, json=body), 404, contains="gpt-4o")
    assert MODEL in error["message"]
    assert error["type"] == "NotFoundError" and error["param"] == "model"


def test_unknown_route_and_method_are_openai_shaped(http: httpx.Client) -> None:
    assert_openai_error(http.get("/v1/does-not-exist"), 404)
    assert_openai_error(http.get(CHAT), 405)


# ---- invalid sampling parameters -------------------------------------------------------------
BAD_PARAMS = [
    (CHAT, {"temperature": -1}, "temperature"),
    (CHAT, {"top_p": 0}, "top_p"),
    (CHAT, {"n": 0}, "n"),
    (CHAT, {"max_tokens": 0}, "max_tokens"),
    (CHAT, {"max_completion_tokens": -3}, "max_tokens"),
    (CHAT, {"logprobs": True, "top_logprobs": -1}, "logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": 10_000}, "logprobs"),
    (CHAT, {"logprobs": "sometimes"}, "logprobs"),
    (CHAT, {"top_logprobs": 3}, "top_logprobs"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"stop": [""]}, "stop"),
    (CHAT, {"top_k": -5}, "top_k"),
    (CHAT, {"min_tokens": 5}, "min_tokens"),
    (CHAT, {"seed": 2**70}, "seed"),
    (COMPLETIONS, {"temperature": -1}, "temperature"),
    (COMPLETIONS, {"top_p": 0}, "top_p"),
    (COMPLETIONS, {"n": 0}, "n"),
    (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": -1}, "max_tokens"),
    (COMPLETIONS, {"logprobs": -1}, "logprobs"),
    (COMPLETIONS, {"logprobs": 10_000}, "logprobs"),
    (COMPLETIONS, {"stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
    (COMPLETIONS, {"temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"suffix": "x"}, "suffix"),
]


@pytest.mark.parametrize(
    "path,overrides,param", BAD_PARAMS, ids=[f"{p.rsplit('/', 1)[1]}-{'-'.join(o)}" for p, o, _ in BAD_PARAMS]
)
def test_invalid_parameters_are_400(http: httpx.Client, path: str, overrides: dict, param: str) -> None:
    body = (chat_body if path == CHAT else completion_body)(**overrides)
    error = assert_openai_error(http.post(path, json=body), 400)
    assert error["type"] == "BadRequestError"
    assert param in error["message"] or param == error["param"], error


def test_invalid_parameters_on_a_stream_are_400_before_streaming(http: httpx.Client) -> None:
    with http.stream("POST", CHAT, json=chat_body(temperature=-1, stream=True)) as response:
        response.read()
        assert_openai_error(response, 400, contains="temperature")


# ---- malformed bodies ------------------------------------------------------------------------
MALFORMED_CHAT = [
    {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this image?"},
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                ],
            }
        ],
    },
    {"model": MODEL, "max_tokens": 2, "messages": []},
    {"model": MODEL, "max_tokens": 2},
    {"model": MODEL, "max_tokens": 2, "messages": "What is the capital of France?"},
    {"model": MODEL, "max_tokens": 2, "messages": [{"content": "no role"}]},
    {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": 42}]},
    {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [{"text": "no type"}]}]},
    {"model": MODEL, "max_tokens": 2, "messages": [["user", "hi"]]},
    {"model": MODEL, "max_tokens": "two", "messages": CAPITAL_QUESTION},
    {"model": MODEL, "max_tokens": 2.5, "messages": CAPITAL_QUESTION},
    {"model": MODEL, "max_tokens": 2, "messages": CAPITAL_QUESTION, "n": [3]},
    {"model": MODEL, "max_tokens": 2, "messages": CAPITAL_QUESTION, "stop": 7},
    {"model": MODEL, "max_tokens": 2, "messages": CAPITAL_QUESTION, "stream_options": "yes", "stream": True},
    {"model": 12, "max_tokens": 2, "messages": CAPITAL_QUESTION},
]
MALFORMED_COMPLETIONS = [
    {"model": MODEL, "max_tokens": 2},
    {"model": MODEL, "max_tokens": 2, "prompt": ""},
    {"model": MODEL, "max_tokens": 2, "prompt": []},
    {"model": MODEL, "max_tokens": 2, "prompt": [[]]},
    {"model": MODEL, "max_tokens": 2, "prompt": ["a", 1]},
    {"model": MODEL, "max_tokens": 2, "prompt": [1, [2]]},
    {"model": MODEL, "max_tokens": 2, "prompt": [-1, 5]},
    {"model": MODEL, "max_tokens": 2, "prompt": [10**9]},
    {"model": MODEL, "max_tokens": 2, "prompt": {"text": "hi"}},
    {"model": MODEL, "max_tokens": 2, "prompt": None},
]


@pytest.mark.parametrize("body", MALFORMED_CHAT, ids=range(len(MALFORMED_CHAT)))
def test_malformed_chat_bodies_are_400(http: httpx.Client, body: dict) -> None:
    assert_openai_error(http.post(CHAT, json=body), 400)


def test_image_part_to_text_only_model_says_why(http: httpx.Client) -> None:
    error = assert_openai_error(http.post(CHAT, json=MALFORMED_CHAT[0]), 400, contains="does not accept images")
    assert MODEL in error["message"] and "messages[0].content[1]" in error["message"]


@pytest.mark.parametrize("body", MALFORMED_COMPLETIONS, ids=range(len(MALFORMED_COMPLETIONS)))
def test_malformed_completion_bodies_are_400(http: httpx.Client, body: dict) -> None:
    assert_openai_error(http.post(COMPLETIONS, json=body), 400)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/tokenize"])
@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "smol", "messages": [',
        b"not json at all",
        b"",
        b"\xff\xfe\x00",
        b"[1, 2, 3]",
        b'"just a string"',
        b"null",
        b"42",
    ],
)
def test_invalid_json_is_400(http: httpx.Client, path: str, raw: bytes) -> None:
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert_openai_error(response, 400)


def test_wrong_content_type_is_4xx(http: httpx.Client) -> None:
    response = http.post(CHAT, content=json.dumps(chat_body()), headers={"Content-Type": "text/plain"})
    assert 400 <= response.status_code < 500
    assert "error" in response.json()


# ---- context length --------------------------------------------------------------------------
def test_prompt_plus_max_tokens_over_context_is_400_with_numbers(http: httpx.Client) -> None:
    ids = [1000] * 2000
    error = assert_openai_error(http.post(COMPLETIONS, json=completion_body(prompt=ids, max_tokens=100)), 400)
    for number in ("2048", "2100", "2000", "100"):
        assert number in error["message"], error
    # Exactly at the limit is fine (checked without generating: max_tokens makes it 1 over).
    error = assert_openai_error(http.post(COMPLETIONS, json=completion_body(prompt=ids, max_tokens=49)), 400)
    assert "2049" in error["message"]


def test_prompt_alone_over_context_is_400(http: httpx.Client) -> None:
    long_text = "hello " * 2100
    for path, body in [
        (COMPLETIONS, {"model": MODEL, "prompt": [1000] * 2100}),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": long_text}]}),
    ]:
        error = assert_openai_error(http.post(path, json=body), 400)
        assert "2048" in error["message"], error
        assert "-" not in error["message"].split("2048", 1)[1], f"negative token count in: {error['message']}"


def test_a_reused_request_id_runs_beside_the_first_and_leaves_it_alone(http: httpx.Client) -> None:
    """A client-chosen request_id that is already in flight names the second response too (as vLLM), and
    must not hijack or abort the first request: the engine's own ids differ."""
    body = completion_body(
        prompt="Count to twenty:", max_tokens=20, ignore_eos=True, stream=True, request_id="dup-request-id"
    )
    with http.stream("POST", COMPLETIONS, json=body) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        second = http.post(COMPLETIONS, json={**body, "stream": False})
        assert second.status_code == 200, second.text
        assert second.json()["id"] == "cmpl-dup-request-id"
        assert second.json()["usage"]["completion_tokens"] == 20
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    final = json.loads(rest[-2][5:])
    assert final["choices"][0]["finish_reason"] == "length"


# ---- authentication --------------------------------------------------------------------------
PROTECTED = [
    ("GET", "/v1/models", None),
    ("POST", CHAT, chat_body()),
    ("POST", COMPLETIONS, completion_body()),
    ("POST", "/tokenize", {"model": MODEL, "prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
]


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[p for _, p, _ in PROTECTED])
@pytest.mark.parametrize(
    "auth",
    [None, "Bearer wrong-key", f"Basic {API_KEY}", "Bearer", API_KEY],
    ids=["missing", "wrong", "basic", "empty", "no-scheme"],
)
def test_protected_routes_need_the_key(anon: httpx.Client, method: str, path: str, body, auth) -> None:
    headers = {"Authorization": auth} if auth is not None else {}
    response = anon.request(method, path, json=body, headers=headers)
    error = assert_openai_error(response, 401)
    assert error["type"] == "AuthenticationError"


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_protected_routes_accept_the_key(http: httpx.Client, method: str, path: str, body) -> None:
    assert http.request(method, path, json=body).status_code == 200


@pytest.mark.parametrize("path", ["/health", "/version", "/metrics"])
def test_probe_routes_are_open(anon: httpx.Client, path: str) -> None:
    response = anon.get(path)
    assert response.status_code == 200, response.text
    if path == "/version":
        assert response.json()["version"]
    if path == "/metrics":
        assert "pagoda:num_requests_running" in response.text


# ---- fuzzing ---------------------------------------------------------------------------------
json_scalars = st.none() | st.booleans() | st.integers(-(2**66), 2**66) | st.floats() | st.text(max_size=12)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
small_ints = st.integers(-3, 4)
# Right types and values a client may legitimately send (the engine must handle every mix of them).
VALID_FIELDS = {
    "model": st.just(MODEL),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.sampled_from([-1, 0, 1, 5, 50]),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "logprobs": st.booleans() | st.integers(0, 5),
    "top_logprobs": st.integers(0, 5),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "echo": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "request_id": st.uuids().map(str),
}
# Right types, values in and out of range.
TYPED_FIELDS = {
    **VALID_FIELDS,
    "model": st.sampled_from([MODEL, "other", ""]),
    "n": st.integers(-1, 3),
    "temperature": st.floats(-2, 3) | st.sampled_from([float("inf"), float("nan"), 0.0]),
    "top_p": st.floats(-1, 2),
    "top_k": st.integers(-3, 50),
    "min_p": st.floats(-1, 2),
    "repetition_penalty": st.floats(-1, 3),
    "seed": st.integers(-(2**64), 2**65),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(-5, 60000), max_size=3),
    "min_tokens": small_ints,
    "logprobs": st.booleans() | st.integers(-2, 25),
    "top_logprobs": st.integers(-2, 25),
    "request_id": st.text(max_size=6),
}
# Wrong types too.
ANY_FIELDS = {name: values | json_values for name, values in TYPED_FIELDS.items()}
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)})
OTHER_PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["image_url", "input_audio", "text"]) | json_values},
    optional={"text": json_values, "image_url": json_values},
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | json_values},
    optional={
        "content": st.text(max_size=30) | st.lists(TEXT_PART | OTHER_PART, max_size=3) | json_values,
        "name": st.text(max_size=5) | json_values,
    },
)
MESSAGES = st.lists(MESSAGE, min_size=1, max_size=3) | json_values
VALID_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant"]),
            "content": st.text(max_size=30) | st.lists(TEXT_PART, min_size=1, max_size=2),
        }
    ),
    min_size=1,
    max_size=3,
)
VALID_PROMPTS = (
    st.text(min_size=1, max_size=30)
    | st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=2)
    | st.lists(st.integers(0, 49151), min_size=1, max_size=8)
)
PROMPTS = (
    st.text(max_size=30)
    | st.lists(st.text(max_size=10), max_size=3)
    | st.lists(st.integers(-10, 60000), max_size=8)
    | st.lists(st.lists(st.integers(-1, 60000), max_size=4), max_size=3)
    | json_values
)


def _not_a_length(value) -> bool:
    """A junk max_tokens that cannot ask for a long completion: not an int, not null (null is valid,
    "up to the context length": ~2,000 tokens per sample, minutes on a 2-core CI machine, which made
    the client time out and Hypothesis replay the example while shrinking it), and nothing that
    pydantic's lax mode turns into a large int (2000.0, " 2000")."""
    if value is None or isinstance(value, int):
        return False
    if isinstance(value, float):
        return not (value.is_integer() and value > 4)
    if isinstance(value, str):
        try:
            return int(value.strip().replace("_", "")) <= 4
        except ValueError:
            return True
    return True


def fuzz_bodies(main_field: str, main_values: st.SearchStrategy) -> st.SearchStrategy:
    """Random bodies, from plausible (right field names and types, values in and out of range) to
    junk; max_tokens is always small (or junk that is not a length) so the valid ones finish quickly."""

    def shaped(main: st.SearchStrategy, max_tokens: st.SearchStrategy, fields: dict) -> st.SearchStrategy:
        return st.fixed_dictionaries(
            {main_field: main, "max_tokens": max_tokens}, optional={**fields, "junk": json_values}
        )

    valid_main = {"messages": VALID_MESSAGES, "prompt": VALID_PROMPTS}[main_field]
    kinds = (
        [shaped(valid_main, st.integers(1, 3), VALID_FIELDS)] * 4
        + [shaped(main_values, small_ints, TYPED_FIELDS)] * 3
        + [
            shaped(main_values, small_ints | json_values.filter(_not_a_length), ANY_FIELDS),
            st.dictionaries(st.text(max_size=8), json_values, max_size=5) | json_values,
        ]
    )
    return st.sampled_from(kinds).flatmap(lambda kind: kind)


def post_json(client: httpx.Client, path: str, body) -> httpx.Response:
    # json.dumps, not httpx's encoder: also sends NaN / Infinity, which Python clients can produce.
    return client.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def assert_client_error_or_success(response: httpx.Response) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        assert_openai_error(response, response.status_code)
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in response.text, response.text[-500:]
    else:
        assert response.json()["choices"]


def _too_big(body) -> bool:
    """Skip combinations that are valid but slow (many samples or many prompts)."""
    if not isinstance(body, dict):
        return False
    n, prompt = body.get("n"), body.get("prompt")
    return (isinstance(n, int) and n > 3) or (isinstance(prompt, list) and len(prompt) > 3)


FUZZ = settings(
    max_examples=60,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@FUZZ
@given(body=fuzz_bodies("messages", MESSAGES))
def test_fuzz_chat_never_5xx(http: httpx.Client, body) -> None:
    if not _too_big(body):
        assert_client_error_or_success(post_json(http, CHAT, body))


@FUZZ
@given(body=fuzz_bodies("prompt", PROMPTS))
def test_fuzz_completions_never_5xx(http: httpx.Client, body) -> None:
    if not _too_big(body):
        assert_client_error_or_success(post_json(http, COMPLETIONS, body))


# ---- engine death (runs last: it breaks the shared server) ------------------------------------
@pytest.mark.kills_engine
def test_dead_engine_gives_503_with_retry_after(server, http: httpx.Client, anon: httpx.Client) -> None:
    engine_pid = server.engine_pid()
    launcher = server.proc.pid
    # The launcher is paused first, so the API process must notice the death on its own (its pidfd watch of
    # the core) and keep answering 503 for as long as we look; resumed, the launcher stops it and exits 1.
    os.kill(launcher, signal.SIGSTOP)
    try:
        # Requests sent 0-440 ms after the kill race the death: each still gets its 503 within a second.
        assert_answered_503(fire_after_kill(server.url, lambda: os.kill(engine_pid, signal.SIGKILL)))
        deadline = time.monotonic() + 15
        while anon.get("/health").status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 after the engine process was killed"
            time.sleep(0.2)
        health = anon.get("/health")
        assert_openai_error(health, 503)
        assert "Retry-After" in health.headers

        for path, body in [
            (CHAT, chat_body()),
            (COMPLETIONS, completion_body()),
            (CHAT, chat_body(stream=True)),
            (COMPLETIONS, completion_body(stream=True)),
        ]:
            response = http.post(path, json=body)
            error = assert_openai_error(response, 503)
            assert error["type"] == "ServiceUnavailableError"
            assert int(response.headers["Retry-After"]) > 0
        # Client mistakes are still reported as such, and the probes still answer.
        assert_openai_error(http.post(CHAT, json=chat_body(model="nope")), 404)
        assert anon.get("/metrics").status_code == 200
        assert anon.get("/version").status_code == 200
    finally:
        os.kill(launcher, signal.SIGCONT)
    # A dead core ends the server: 503 first, then a non-zero exit (a supervisor restarts it).
    assert server.proc.wait(timeout=30) != 0
