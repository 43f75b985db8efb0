"""Small helpers shared by the end-to-end tests (SSE parsing, metrics scraping, error-shape checks)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smol"
API_KEY = "test-key"
# Greedy answers that tests compare on the shared server. With its own system message the first token's margin is
# ~1.8 nats under either 4-bit CPU kernel; the bare question (the README's; `test_readme_quickstart` asks it of a
# fresh server) starts from the template's default system prompt, whose cached KV may come from a step of other
# rows and the other kernel, and its first two candidates are 0.03-0.15 apart (it then answers "L'Étoile, ...").
CAPITAL_QUESTION = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


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


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def engine_is_idle(http: httpx.Client) -> bool:
    samples = scrape(http)
    return (
        metric(samples, "pagoda:num_requests_running") == 0
        and metric(samples, "pagoda:num_requests_waiting") == 0
        and metric(samples, "pagoda:kv_cache_usage_perc") == 0
    )


def wait_engine_idle(http: httpx.Client, timeout: float = 60.0) -> None:
    """Block until the shared server's engine neither runs nor queues a request.

    Tests that compare two greedy runs of one request need this: an earlier test on the worker may leave
    requests behind (a client that hung up mid-stream, one that timed out), and a request batched beside
    them meets other GEMM shapes (the CPU 4-bit path changes kernels above 64 rows), which can flip a
    near-tie token. Batch invariance is not promised, by us or by vLLM; equal batches are."""
    assert wait_until(lambda: engine_is_idle(http), timeout), f"engine still busy after {timeout:.0f} s"


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
