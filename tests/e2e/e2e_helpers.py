"""Small helpers shared by the end-to-end tests (SSE parsing, metrics scraping, error-shape checks)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smol"
API_KEY = "test-key"
CAPITAL_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def sse_payloads(response: httpx.Response) -> list[str]:
    """The `data:` payloads of a streamed response, in order (including the final "[DONE]")."""
    return [line[len("data:") :].strip() for line in response.iter_lines() if line.startswith("data:")]


def sse_json(payloads: list[str]) -> list[dict[str, Any]]:
    assert payloads and payloads[-1] == "[DONE]", f"stream must end with [DONE], got {payloads[-3:]}"
    assert "[DONE]" not in payloads[:-1], "[DONE] must be the last event"
    return [json.loads(p) for p in payloads[:-1]]


def scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels without model_name and engine): value}."""
    response = client.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            samples[(s.name, labels)] = s.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def assert_openai_error(response: httpx.Response, status: int, *, contains: str | None = None) -> dict:
    """The status, and a body shaped like OpenAI's: {"error": {"message", "type", "param", "code"}}."""
    assert response.status_code == status, f"expected {status}, got {response.status_code}: {response.text}"
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] == status, error
    if contains is not None:
        assert contains.lower() in error["message"].lower(), error
    return error
