"""Requests fired in the moments after an engine core is killed (the tests that kill one use this, so the
race costs no server start of its own): each must be answered 503 with Retry-After within a second.
None may wait on the dead core until its client gives up.

The waves span half a second: a killed core takes a while to die (its memory is torn down before its
sockets close), and the requests that hung were those sent after its sockets closed but before the
API process noticed the death."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from e2e_helpers import API_KEY, CAPITAL_QUESTION, MODEL

HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


@dataclass
class Answer:
    stream: bool
    status: int | None  # None: no answer (the connection failed)
    seconds: float  # from sending the request to the end of the response
    body: str
    retry_after: str | None


def _request(k: int) -> tuple[str, dict, bool]:
    stream = k % 2 == 1
    if k % 4 < 2:
        return (
            "/v1/completions",
            {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 20, "stream": stream},
            stream,
        )
    return (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CAPITAL_QUESTION, "max_tokens": 20, "stream": stream},
        stream,
    )


def fire_after_kill(
    url: str, kill: Callable[[], None], waves: int = 12, per_wave: int = 2, gap_s: float = 0.04
) -> list[Answer]:
    """Connect first (so nothing waits on a TCP handshake), kill, then send `waves` waves of requests
    `gap_s` apart (0-440 ms after the kill by default): completions and chat, streamed and not."""
    parts = urlsplit(url)
    count = waves * per_wave
    conns = [http.client.HTTPConnection(parts.hostname, parts.port, timeout=5) for _ in range(count)]
    for conn in conns:
        conn.connect()
    answers: list[Answer | None] = [None] * count

    def send(k: int) -> None:
        path, body, stream = _request(k)
        started = time.monotonic()
        try:
            conns[k].request("POST", path, body=json.dumps(body), headers=HEADERS)
            response = conns[k].getresponse()
            text = response.read().decode(errors="replace")
            answers[k] = Answer(
                stream, response.status, time.monotonic() - started, text, response.getheader("Retry-After")
            )
        except (OSError, http.client.HTTPException) as exc:
            answers[k] = Answer(stream, None, time.monotonic() - started, repr(exc), None)
        finally:
            conns[k].close()

    kill()
    threads = []
    for wave in range(waves):
        for k in range(wave * per_wave, (wave + 1) * per_wave):
            threads.append(threading.Thread(target=send, args=(k,), daemon=True))
            threads[-1].start()
        time.sleep(gap_s)
    for thread in threads:
        thread.join(10)
    return [a if a is not None else Answer(False, None, 10.0, "no answer", None) for a in answers]


def assert_answered_503(answers: list[Answer], within_s: float = 1.0) -> None:
    """Every request answered within `within_s`: a 503 with Retry-After, or (a stream admitted in the
    instant before the death was known) a 200 whose stream ends with a 503 error event and [DONE]."""
    slow = [(a.seconds, a.status, a.body[:200]) for a in answers if a.seconds >= within_s or a.status is None]
    assert not slow, f"{len(slow)} of {len(answers)} requests not answered within {within_s} s: {slow}"
    for a in answers:
        if a.status == 503:
            assert a.retry_after and int(a.retry_after) > 0, a
            assert json.loads(a.body)["error"]["type"] == "ServiceUnavailableError", a
        else:
            assert a.stream and a.status == 200, a
            assert '"code": 503' in a.body and a.body.rstrip().endswith("data: [DONE]"), a
