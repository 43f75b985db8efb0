"""`python -m pagoda batch` end to end: against the live session server (text JSONL success path, 401 and
image-on-a-text-model 400 error paths) and against a fault-injecting HTTP server on 127.0.0.1 (429 with
Retry-After, 503, 409, resets, slow responses, never-retried 4xx, a web page with images), plus kill -9 /
resume and SIGINT draining.

The fault server answers /v1/chat/completions with OpenAI-shaped JSON. What it does to a request is written in
the request's text: `id=KEY do=DIRECTIVE` (directives in `FaultServer._decide`); it counts attempts per KEY.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from e2e_helpers import API_KEY, MODEL

# ---------------------------------------------------------------------------------------------- fault server


def png(w: int, h: int, color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


GALLERY = {  # path -> (content type, bytes)
    "/gallery/img/a.png": ("image/png", png(64, 48, (250, 0, 0))),
    "/gallery/img/a-copy.png": ("image/png", png(64, 48, (250, 0, 0))),  # same bytes as a.png
    "/static/b.png": ("image/png", png(80, 80, (0, 250, 0))),
    "/gallery/img/small.png": ("image/png", png(40, 30, (0, 0, 250))),
    "/gallery/img/big.png": ("image/png", png(200, 150, (250, 250, 0))),
    "/gallery/img/lazy.png": ("image/png", png(50, 60, (0, 250, 250))),
    "/og/cover.png": ("image/png", png(120, 63, (250, 0, 250))),
    "/gallery/img/speck.png": ("image/png", png(1, 1, (0, 0, 0))),  # 1x1, innocent name
    "/t/pixel.gif": ("image/gif", b"GIF89a\x01\x00\x01\x00\x00\x00\x00;"),
    "/gallery/img/logo.svg": ("image/svg+xml", b"<svg xmlns='http://www.w3.org/2000/svg'/>"),
}
GALLERY_HTML = """<!doctype html><html><head>
<meta property="og:image" content="/og/cover.png"><title>Gallery</title></head><body>
<img src="img/a.png" alt="relative">
<img src="/static/b.png">
<img src="img/small.png" srcset="img/small.png 400w, img/big.png 1600w">
<img src="data:image/gif;base64,R0lGODlhAQABAAAAACw=" data-src="img/lazy.png">
<img src="img/a.png#again"><img src="img/a-copy.png">
<img src="img/speck.png"><img src="/t/pixel.gif" width="1" height="1"><img src="img/logo.svg">
<img src="img/missing.png">
</body></html>"""
EXPECTED_PAGE_IMAGES = [
    "/og/cover.png",
    "/gallery/img/a.png",
    "/static/b.png",
    "/gallery/img/big.png",
    "/gallery/img/lazy.png",
]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args: Any) -> None:
        pass

    def _send(
        self, status: int, data: bytes, ctype: str = "application/json", headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        fault = self.server.fault
        path = self.path.split("?", 1)[0]
        if path == "/gallery/index.html":
            self._send(200, GALLERY_HTML.encode(), "text/html; charset=utf-8")
        elif path in GALLERY:
            with fault.lock:
                fault.image_gets[path] += 1
            self._send(200, GALLERY[path][1], GALLERY[path][0])
        else:
            self._send(404, b"not found", "text/plain")

    def do_POST(self) -> None:
        fault = self.server.fault
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        text, image = "", None
        for message in body.get("messages", []):
            content = message.get("content")
            if isinstance(content, str):
                text = content
            elif isinstance(content, list):
                for part in content:
                    if part.get("type") == "text":
                        text = part["text"]
                    elif part.get("type") == "image_url":
                        image = part["image_url"]["url"]
        m = re.search(r"id=(\S+)", text)
        key = m.group(1) if m else text
        d = re.search(r"do=(\S+)", text)
        directive = d.group(1) if d else "ok"
        with fault.lock:
            fault.attempts[key] += 1
            n = fault.attempts[key]
            fault.log.append(
                {
                    "key": key,
                    "n": n,
                    "t": time.monotonic(),
                    "phase": fault.phase,
                    "image": image,
                    "text": text,
                    "model": body.get("model"),
                    "auth": self.headers.get("Authorization"),
                    "body": body,
                }
            )
            delay = fault.delay
        if delay:
            time.sleep(delay)
        action = fault.decide(directive, n)
        if action[0] == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()
            return
        if action[0] == "sleep":
            time.sleep(action[1])
            action = (200, {})
        status, headers = action
        if status == 200:
            payload = {
                "id": f"chatcmpl-{key}-{n}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model"),
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": f"seen {key}"}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12},
            }
            headers = {**headers, "x-request-id": f"fault-{key}-{n}"}
        else:
            payload = {
                "error": {
                    "message": f"injected {status} for {key} (attempt {n})",
                    "type": "injected_error",
                    "code": f"injected_{status}",
                }
            }
        try:
            self._send(status, json.dumps(payload).encode(), headers=headers)
        except OSError:
            pass  # the client gave up (timeout)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fault: FaultServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # resets and client timeouts are the point here


class FaultServer:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attempts: Counter = Counter()
        self.image_gets: Counter = Counter()
        self.log: list[dict[str, Any]] = []
        self.delay = 0.0
        self.phase = 0
        self.httpd = _Server(("127.0.0.1", 0), _Handler)
        self.httpd.fault = self
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def reset(self) -> None:
        with self.lock:
            self.attempts.clear()
            self.image_gets.clear()
            self.log.clear()
            self.delay = 0.0
            self.phase = 0

    @staticmethod
    def decide(directive: str, n: int) -> tuple:
        """ok | r429:N:SECONDS | r429ms:N:MS | r503:N | e409:N | r500 | reset:N | slow:N:SECONDS | eSTATUS.
        N = how many first attempts misbehave."""
        kind, *args = directive.split(":")
        if kind == "ok":
            return 200, {}
        if kind == "r429":
            return (429, {"Retry-After": args[1]}) if n <= int(args[0]) else (200, {})
        if kind == "r429ms":
            return (429, {"retry-after-ms": args[1]}) if n <= int(args[0]) else (200, {})
        if kind == "r503":
            return (503, {}) if n <= int(args[0]) else (200, {})
        if kind == "e409":
            return (409, {}) if n <= int(args[0]) else (200, {})
        if kind == "r500":
            return 500, {}
        if kind == "reset":
            return ("reset",) if n <= int(args[0]) else (200, {})
        if kind == "slow":
            return ("sleep", float(args[1])) if n <= int(args[0]) else (200, {})
        if kind.startswith("e") and kind[1:].isdigit():
            return int(kind[1:]), {}
        raise AssertionError(f"unknown directive {directive}")

    def times(self, key: str) -> list[float]:
        return [e["t"] for e in self.log if e["key"] == key]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def fault_server() -> Iterator[FaultServer]:
    server = FaultServer()
    yield server
    server.close()


@pytest.fixture
def fault(fault_server: FaultServer) -> FaultServer:
    fault_server.reset()
    return fault_server


# ---------------------------------------------------------------------------------------------- helpers


def batch_cmd(base_url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pagoda", "batch", "--base-url", base_url, "--no-progress", *args]


def batch(base_url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(batch_cmd(base_url, *args), capture_output=True, text=True, timeout=timeout, check=False)


def rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def batch_line(cid: str, text: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "fault-model", "messages": [{"role": "user", "content": text}], **body},
    }


def write_jsonl(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------- live server


def test_text_jsonl_against_live_server_then_resume(base_url: str, tmp_path: Path) -> None:
    questions = ["What is 2+2?", "Name a colour.", "Say hello."]
    lines = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": q}], "max_tokens": 4, "temperature": 0},
        }
        for i, q in enumerate(questions)
    ]
    lines[0]["body"]["model"] = MODEL  # the others get the server's first model id
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    args = [
        "--api-key",
        API_KEY,
        "--input",
        str(src),
        "--output",
        str(out),
        "--concurrency",
        "2",
        "--ordered-json",
        str(tmp_path / "ordered.json"),
    ]
    proc = batch(base_url, *args)
    assert proc.returncode == 0, proc.stderr
    got = rows(out)
    assert sorted(r["custom_id"] for r in got) == ["q0", "q1", "q2"]
    for r in got:
        assert r["error"] is None and r["id"].startswith("batch_req_")
        assert r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert body["model"] == MODEL and isinstance(body["choices"][0]["message"]["content"], str)
        assert 1 <= body["usage"]["completion_tokens"] <= 4
        assert r["x_meta"]["attempts"] == 1 and r["x_meta"]["source"].endswith(f"in.jsonl:{int(r['custom_id'][1]) + 1}")
    assert rows(tmp_path / "out.errors.jsonl") == []
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["succeeded"] == 3 and summary["failed"] == 0 and summary["complete"]
    assert summary["completion_tokens"] == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in got)
    assert API_KEY not in json.dumps(summary)
    ordered = json.loads((tmp_path / "ordered.json").read_text())
    assert [r["custom_id"] for r in ordered] == ["q0", "q1", "q2"]

    again = batch(base_url, *args)  # resume: nothing left to send
    assert again.returncode == 0, again.stderr
    assert "3 of 3 already done" in again.stderr
    assert len(rows(out)) == 3
    assert json.loads((tmp_path / "out.summary.json").read_text())["to_send"] == 0

    # A wrong key: 401 is never retried, recorded with its body.
    bad = batch(
        base_url,
        "--api-key",
        "wrong",
        "--model",
        MODEL,
        "--input",
        str(src),
        "--output",
        str(tmp_path / "bad.jsonl"),
        "--max-retries",
        "3",
    )
    assert bad.returncode == 1, bad.stderr
    errors = rows(tmp_path / "bad.errors.jsonl")
    assert len(errors) == 3 and rows(tmp_path / "bad.jsonl") == []
    for r in errors:
        assert r["response"]["status_code"] == 401 and r["x_meta"]["attempts"] == 1
        assert r["x_meta"]["retryable"] is False and r["error"]["message"].startswith("HTTP 401")


def test_images_on_a_text_only_model_fail_with_400_once(base_url: str, tmp_path: Path) -> None:
    folder = tmp_path / "pics"
    (folder / "nested").mkdir(parents=True)
    a, b = png(40, 40, (1, 2, 3)), png(64, 32, (9, 8, 7))
    (folder / "one.png").write_bytes(a)
    (folder / "nested" / "two.png").write_bytes(b)
    (folder / "readme.txt").write_text("not an image")
    out = tmp_path / "res.jsonl"
    args = [
        "--api-key",
        API_KEY,
        "--model",
        MODEL,
        "--images",
        str(folder),
        "--prompt",
        "Describe {filename}",
        "--max-tokens",
        "4",
        "--output",
        str(out),
        "--max-retries",
        "2",
    ]
    proc = batch(base_url, *args)
    assert proc.returncode == 1, proc.stderr
    errors = rows(tmp_path / "res.errors.jsonl")
    assert rows(out) == [] and len(errors) == 2
    by_hash = {r["x_meta"]["image_sha256"]: r for r in errors}
    assert set(by_hash) == {sha(a), sha(b)}
    for r in errors:
        assert r["response"]["status_code"] == 400 and r["x_meta"]["attempts"] == 1
        assert "does not accept images" in r["error"]["message"]
        assert isinstance(r["response"]["body"], dict)  # the server's error body is kept
    ids = sorted(r["custom_id"] for r in errors)

    again = batch(base_url, *args)  # failures are retried on a rerun, and keep one row per id
    assert again.returncode == 1, again.stderr
    errors2 = rows(tmp_path / "res.errors.jsonl")
    assert sorted(r["custom_id"] for r in errors2) == ids  # deterministic ids
    assert all(r["x_meta"]["attempts_before"] == 1 for r in errors2)

    skipped = batch(base_url, *args, "--no-retry-failed")
    assert skipped.returncode == 1 and "2 earlier failure(s) skipped" in skipped.stderr
    assert len(rows(tmp_path / "res.errors.jsonl")) == 2


# ---------------------------------------------------------------------------------------------- fault server

RETRY_CASES = {  # key: (directive, expected attempts, final status or error code)
    "ra429": ("r429:1:1", 2, 200),
    "ms429": ("r429ms:2:150", 3, 200),
    "s503": ("r503:2", 3, 200),
    "c409": ("e409:1", 2, 200),
    "rst": ("reset:1", 2, 200),
    "slow": ("slow:1:3", 2, 200),
    "dead500": ("r500", 4, 500),
    "e400": ("e400", 1, 400),
    "e401": ("e401", 1, 401),
    "e404": ("e404", 1, 404),
    "e413": ("e413", 1, 413),
    "e422": ("e422", 1, 422),
}


def test_retry_rules(fault: FaultServer, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [batch_line(k, f"id={k} do={d}") for k, (d, _, _) in RETRY_CASES.items()])
    out = tmp_path / "out.jsonl"
    t0 = time.monotonic()
    proc = batch(
        fault.url,
        "--api-key",
        "k1",
        "--input",
        str(src),
        "--output",
        str(out),
        "--concurrency",
        "6",
        "--max-retries",
        "3",
        "--timeout",
        "1",
    )
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - t0 < 20
    ok = {r["custom_id"]: r for r in rows(out)}
    failed = {r["custom_id"]: r for r in rows(tmp_path / "out.errors.jsonl")}
    assert set(ok) | set(failed) == set(RETRY_CASES) and not set(ok) & set(failed)
    for key, (_, attempts, final) in RETRY_CASES.items():
        assert fault.attempts[key] == attempts, (key, fault.attempts[key])
        row = ok.get(key) or failed[key]
        assert row["x_meta"]["attempts"] == attempts, key
        if final == 200:
            assert key in ok and row["response"]["status_code"] == 200
            assert row["response"]["request_id"] == f"fault-{key}-{attempts}"
            assert len(row["x_meta"]["history"]) == attempts - 1
        else:
            assert key in failed and row["response"]["status_code"] == final
            assert row["response"]["body"]["error"]["code"] == f"injected_{final}"  # the server's body is kept
            assert row["error"]["code"] == f"injected_{final}"
            assert [h["status"] for h in row["x_meta"]["history"]] == [final] * attempts
    # Retry-After: 1 s honoured (the SDK's backoff alone would be <= 0.5 s).
    t = fault.times("ra429")
    assert t[1] - t[0] >= 0.95
    assert ok["ra429"]["x_meta"]["history"][0]["retry_after"] is True
    t = fault.times("ms429")
    assert all(0.14 <= t[i + 1] - t[i] < 1.5 for i in range(2))  # < 1.5: ra429's 1 s pause may hold it
    # Exponential backoff with jitter for 500 (0.5, 1, 2 s times 0.75..1).
    t = fault.times("dead500")
    gaps = [t[i + 1] - t[i] for i in range(3)]
    for gap, base in zip(gaps, (0.5, 1.0, 2.0)):
        assert 0.75 * base - 0.05 <= gap <= base + 1.2, gaps  # +1.2: a Retry-After pause may hold the bucket
    assert failed["dead500"]["x_meta"]["retryable"] is True
    assert [h["code"] for h in ok["slow"]["x_meta"]["history"]] == ["timeout"]
    assert [h["code"] for h in ok["rst"]["x_meta"]["history"]] == ["connection_error"]
    assert all(e["auth"] == "Bearer k1" for e in fault.log)
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["succeeded"] == 6 and summary["failed"] == 6
    assert summary["retries"] == sum(a - 1 for _, a, _ in RETRY_CASES.values())
    assert summary["status_counts"]["200"] == 6


def test_kill_9_mid_run_then_resume(fault: FaultServer, tmp_path: Path) -> None:
    keys = [f"k{i:02d}" for i in range(36)]
    directives = {k: "ok" for k in keys}
    directives.update({"k03": "e400", "k17": "e422", "k05": "r503:1", "k30": "e404"})
    src = write_jsonl(tmp_path / "in.jsonl", [batch_line(k, f"id={k} do={directives[k]}") for k in keys])
    out, err = tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
    cmd = batch_cmd(fault.url, "--input", str(src), "--output", str(out), "--concurrency", "3", "--max-retries", "2")
    fault.delay = 0.12
    with open(tmp_path / "run1.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(rows(out) if out.exists() else []) < 8:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    first = rows(out)
    done_first = {r["custom_id"] for r in first}
    assert 8 <= len(first) < len(keys) - 3, "the run should have been killed midway"
    # What a kill in the middle of a write leaves: half a row for a request that is not done.
    pending = next(k for k in keys if k not in done_first and directives[k] == "ok")
    partial = json.dumps({"id": "batch_req_x", "custom_id": pending, "response": {"status_code": 200}})
    with open(out, "a") as f:
        f.write(partial[: len(partial) // 2])

    fault.phase = 1
    fault.delay = 0.0
    proc2 = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc2.returncode == 1, proc2.stderr  # three requests fail for good (400, 422, 404)
    assert "truncated last line" in proc2.stderr
    assert f"{len(done_first)} of {len(keys)} already done" in proc2.stderr
    final_ok = rows(out)  # every line parses
    final_err = rows(err)
    seen = Counter(r["custom_id"] for r in final_ok + final_err)
    assert set(seen) == set(keys) and all(v == 1 for v in seen.values()), seen
    assert {r["custom_id"] for r in final_err} == {"k03", "k17", "k30"}
    assert all(r["response"]["status_code"] == 200 for r in final_ok)
    resent = {e["key"] for e in fault.log if e["phase"] == 1}
    assert not resent & done_first, "requests already in the output were sent again"
    assert resent == set(keys) - done_first
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["complete"] and summary["total_succeeded"] == len(keys) - 3

    third = subprocess.run([*cmd, "--no-retry-failed"], capture_output=True, text=True, timeout=60, check=False)
    assert third.returncode == 1 and f"{len(keys) - 3} of {len(keys)} already done" in third.stderr
    assert Counter(r["custom_id"] for r in rows(out) + rows(err)) == Counter(keys)


def test_sigint_drains_in_flight_and_flushes(fault: FaultServer, tmp_path: Path) -> None:
    keys = [f"s{i:02d}" for i in range(30)]
    src = write_jsonl(tmp_path / "in.jsonl", [batch_line(k, f"id={k}") for k in keys])
    out = tmp_path / "out.jsonl"
    fault.delay = 0.6
    proc = subprocess.Popen(
        batch_cmd(fault.url, "--input", str(src), "--output", str(out), "--concurrency", "3"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(fault.log) < 4:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 130, stderr
    assert "in-flight" in stderr
    sent = {e["key"] for e in fault.log}
    written = {r["custom_id"] for r in rows(out)}
    assert 4 <= len(sent) < len(keys)
    assert written == sent, "every request in flight at SIGINT finished and was written; nothing new started"
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["interrupted"] and summary["not_run"] == len(keys) - len(written)


def test_scraped_page_images(fault: FaultServer, tmp_path: Path) -> None:
    page = f"{fault.url}/gallery/index.html"
    out = tmp_path / "page.jsonl"
    t0 = time.monotonic()
    proc = batch(
        fault.url,
        "--page",
        page,
        "--model",
        "vl",
        "--prompt",
        "id={url} Describe {filename}",
        "--system",
        "Be brief.",
        "--max-tokens",
        "16",
        "--output",
        str(out),
        "--rps",
        "10",
        "--concurrency",
        "4",
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert "5 image(s) found" in proc.stderr
    expected = {fault.url + p: GALLERY[p][1] for p in EXPECTED_PAGE_IMAGES}
    requests = [e for e in fault.log if e["image"]]
    assert sorted(e["key"] for e in requests) == sorted(expected)
    for e in requests:  # the bytes that were fetched are the bytes that were sent
        header, b64 = e["image"].split(",", 1)
        assert header == "data:image/png;base64" and base64.b64decode(b64) == expected[e["key"]]
        assert e["model"] == "vl" and e["body"]["max_tokens"] == 16
        assert e["body"]["messages"][0] == {"role": "system", "content": "Be brief."}
        assert e["text"].endswith("Describe " + e["key"].rsplit("/", 1)[1])
    assert elapsed >= 0.35  # 5 requests at 10/s: the token bucket spaces them >= 0.4 s apart in total
    got = rows(out)
    assert len(got) == 5 and all(r["x_meta"]["page"] == page for r in got)
    assert {r["x_meta"]["image_sha256"] for r in got} == {sha(d) for d in expected.values()}
    summary = json.loads((tmp_path / "page.summary.json").read_text())
    skipped = {s["url"].replace(fault.url, ""): s["reason"] for s in summary["config"]["scraped"][0]["skipped"]}
    assert skipped["/gallery/img/a-copy.png"] == "duplicate content"
    assert "below 32 px" in skipped["/gallery/img/speck.png"]
    assert skipped["/t/pixel.gif"] == "tracking-pixel name"
    assert skipped["/gallery/img/logo.svg"] == "svg"
    assert "404" in skipped["/gallery/img/missing.png"]
    assert fault.image_gets["/gallery/img/small.png"] == 0  # the srcset's largest candidate only

    # --send-urls passes the URLs through; --max-pixels downscales what is inlined; --detail goes with each image.
    fault.reset()
    urls_out = tmp_path / "urls.jsonl"
    proc = batch(
        fault.url, "--page", page, "--model", "vl", "--prompt", "id=u:{url}", "--send-urls", "--output", str(urls_out)
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(e["image"] for e in fault.log) == sorted(expected)
    fault.reset()
    small_out = tmp_path / "small.jsonl"
    proc = batch(
        fault.url,
        "--page",
        page,
        "--model",
        "vl",
        "--prompt",
        "id=s:{url}",
        "--max-pixels",
        "2500",
        "--detail",
        "low",
        "--output",
        str(small_out),
    )
    assert proc.returncode == 0, proc.stderr
    for e in fault.log:
        im = Image.open(io.BytesIO(base64.b64decode(e["image"].split(",", 1)[1])))
        assert im.width * im.height <= 2500
        image_part = e["body"]["messages"][-1]["content"][0]
        assert image_part["image_url"]["detail"] == "low"
    big = next(r for r in rows(small_out) if r["x_meta"]["image_url"].endswith("/big.png"))
    assert (
        big["x_meta"]["image_size"] == [200, 150]
        and big["x_meta"]["sent_size"][0] * big["x_meta"]["sent_size"][1] <= 2500
    )


def test_url_list_and_usage_errors(fault: FaultServer, tmp_path: Path) -> None:
    urls = tmp_path / "urls.txt"
    urls.write_text(
        f"# two images and a missing one\n{fault.url}/static/b.png\n{fault.url}/og/cover.png\n"
        f"{fault.url}/static/b.png\n{fault.url}/nope.png\n"
    )
    out = tmp_path / "u.jsonl"
    proc = batch(
        fault.url,
        "--urls",
        str(urls),
        "--model",
        "vl",
        "--prompt",
        "id={filename}",
        "--output",
        str(out),
        "--max-retries",
        "1",
    )
    assert proc.returncode == 1, proc.stderr
    assert len(rows(out)) == 2  # the repeated URL is sent once
    assert sorted(e["key"] for e in fault.log) == ["b.png", "cover.png"]
    errors = rows(tmp_path / "u.errors.jsonl")
    assert len(errors) == 1 and errors[0]["error"]["code"] == "fetch_http_error"
    assert errors[0]["response"] is None and errors[0]["x_meta"]["attempts"] == 0  # no chat request was sent

    dup = write_jsonl(tmp_path / "dup.jsonl", [batch_line("a", "x"), batch_line("b", "y"), batch_line("a", "z")])
    proc = batch(fault.url, "--input", str(dup), "--output", str(tmp_path / "d.jsonl"))
    assert proc.returncode == 2 and "dup.jsonl:3: duplicate custom_id 'a' (first on line 1)" in proc.stderr
    proc = batch(fault.url, "--output", str(tmp_path / "d.jsonl"))
    assert proc.returncode == 2 and "give --input" in proc.stderr
    proc = batch(
        fault.url,
        "--images",
        str(tmp_path),
        "--prompt",
        "{nope}",
        "--model",
        "m",
        "--output",
        str(tmp_path / "d.jsonl"),
    )
    assert proc.returncode == 2 and "unknown placeholder {nope}" in proc.stderr
