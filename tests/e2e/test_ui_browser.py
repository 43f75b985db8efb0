"""The playground (`/`) and the dashboard (`/dashboard`) in a real headless Chromium, against a real
`pagoda serve` of a tiny random Qwen2-VL (test_qwen2vl_serve's model: the real Qwen2 vocabulary, images
capped at 64 placeholder tokens), with the API key on: the page asks for the key, streams an answer, stops
one mid-way (and /metrics then counts an abort and no request still running), counts a dropped image's tokens
before sending it, shows the server's own error message, and the dashboard's numbers and charts move while
requests run; and `pagoda router`'s page, in front of that server, shows the backend and tokens per key.

Chromium is the system's (Debian's `chromium` package, or PAGODA_CHROMIUM), driven by Playwright without its
own browser download; without a Chromium binary the tests are skipped. With PAGODA_UI_SCREENSHOTS=<folder>
(e.g. docs/images) each page is also saved as a PNG at desktop width and at 360 px.

Like every e2e module, the tests run in one xdist group (tests/conftest.py groups them by module): one server,
one browser, in order on one worker.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_helpers import API_KEY, MODEL, metric, scrape
from e2e_server import free_port, running_server
from test_qwen2vl_serve import (  # noqa: F401 (qwen2vl_folder: a fixture)
    MAX_PIXELS,
    TINY_MP4_TOKENS,
    encoded,
    image_tokens,
    qwen2vl_folder,
    tiny_mp4,
)


def chromium_binary() -> str | None:
    candidates = [os.environ.get("PAGODA_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"]
    for name in candidates:
        if name and (path := shutil.which(name)):
            return path
    return None


CHROMIUM = chromium_binary()
if CHROMIUM is None:
    pytest.skip(
        "no Chromium binary (apt-get install chromium, or set PAGODA_CHROMIUM): browser tests skipped",
        allow_module_level=True,
    )
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")

SCREENSHOTS = os.environ.get("PAGODA_UI_SCREENSHOTS")
DESKTOP = {"width": 1280, "height": 860}
PHONE = {"width": 360, "height": 760}
TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def ui_server(qwen2vl_folder, tmp_path_factory) -> Iterator:  # noqa: F811 (the imported fixture)
    flags = ["--model", qwen2vl_folder, "--max-model-len", "4096"]
    flags += ["--mm-processor-kwargs", json.dumps({"max_pixels": MAX_PIXELS})]
    flags += ["--limit-mm-per-prompt", '{"image": 2, "video": 1}']
    with running_server(tmp_path_factory.mktemp("ui") / "serve.log", flags) as proc:
        yield proc


@pytest.fixture(scope="module")
def browser() -> Iterator:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        )
        yield browser
        browser.close()


def card_text(card: str) -> str:
    """A JS expression for a dashboard card's value text, '' until the first /metrics poll has built the card
    (a predicate that threw on the missing element failed the wait, and the page, at once)."""
    return f"(document.getElementById('value-{card}')?.textContent ?? '')"


@pytest.fixture
def page(browser, ui_server):
    context = browser.new_context(base_url=ui_server.url, viewport=DESKTOP)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


@pytest.fixture(scope="module")
def http(ui_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=ui_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        yield client


def assert_fits_360px(page) -> None:
    """Readable on a phone: at 360 px wide nothing makes the page scroll sideways."""
    page.set_viewport_size(PHONE)
    try:
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= PHONE["width"], f"{page.url} is {width} px wide at 360 px"
    finally:
        page.set_viewport_size(DESKTOP)


def screenshot(page, name: str) -> None:
    """Desktop and 360 px PNGs of the page as it is, when PAGODA_UI_SCREENSHOTS names a folder."""
    if not SCREENSHOTS:
        return
    folder = Path(SCREENSHOTS)
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / f"{name}-desktop.png"), full_page=True)
    page.set_viewport_size(PHONE)
    page.wait_for_timeout(300)
    page.screenshot(path=str(folder / f"{name}-360px.png"), full_page=True)
    page.set_viewport_size(DESKTOP)


def open_playground(page) -> None:
    """Load `/` without a key: the page asks for it (the API answered 401), keeps it, shows the model."""
    page.goto("/")
    sync_api.expect(page.locator("#key-note")).to_contain_text("Invalid or missing API key")  # the server's words
    key = page.get_by_label("API key", exact=True)
    key.fill(API_KEY)
    key.press("Enter")
    sync_api.expect(page.locator("#model-name")).to_have_text(f"model: {MODEL}")
    sync_api.expect(page.locator("#key-form")).to_be_hidden()


def send_and_wait(page, text: str) -> None:
    """Type `text` into the message box, send it with Enter, and wait for the answer to finish."""
    prompt = page.get_by_label("Message", exact=False)
    prompt.fill(text)
    prompt.press("Enter")  # keyboard only
    sync_api.expect(page.locator("#status")).to_contain_text("tokens in")


def set_sampling(page, max_tokens: int, **more: str) -> None:
    page.get_by_label("Max tokens").fill(str(max_tokens))
    for label, value in more.items():
        page.get_by_label(label, exact=True).fill(value)


def record_answer_lengths(page) -> None:
    """Every length the last assistant message's text has had, as the page rendered it (window.__lengths)."""
    page.evaluate(
        """() => {
            window.__lengths = [];
            new MutationObserver(() => {
                const all = document.querySelectorAll('#transcript .msg.assistant .text');
                if (all.length) window.__lengths.push(all[all.length - 1].textContent.length);
            }).observe(document.getElementById('transcript'), {subtree: true, childList: true, characterData: true});
        }"""
    )


def test_playground_streams_an_answer_shows_the_prompt_and_the_servers_errors(page, http):
    open_playground(page)
    set_sampling(page, 48, **{"Temperature": "1", "Seed": "7", "System prompt": "You are terse."})
    record_answer_lengths(page)
    prompt = page.get_by_label("Message", exact=False)
    prompt.fill("What is the capital of France?")
    prompt.press("Enter")  # keyboard only
    sync_api.expect(page.locator("#status")).to_contain_text("tokens in")
    lengths = page.evaluate("window.__lengths")
    answer = page.locator("#transcript .msg.assistant .text").last.text_content()
    assert answer, "no answer text"
    # Streamed: the answer grew in several steps, not in one go.
    assert len({n for n in lengths if n > 0}) >= 3, lengths
    sync_api.expect(page.locator("#transcript .msg.user")).to_have_text("userWhat is the capital of France?")

    # The exact prompt: what /tokenize renders for this conversation (system, user, assistant), with its count.
    page.get_by_text("Show the exact prompt").click()
    sync_api.expect(page.locator("#exact-count")).to_contain_text("tokens (of 4096")
    shown = page.locator("#exact-prompt").text_content()
    assert "<|im_start|>system\nYou are terse.<|im_end|>" in shown and shown.endswith("<|im_start|>assistant\n")
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": answer},
    ]
    count = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["count"]
    assert page.locator("#exact-count").text_content().startswith(f"{count} tokens")
    assert_fits_360px(page)
    screenshot(page, "playground")

    # A request the server refuses: its own message, as the server wrote it.
    set_sampling(page, 100_000)
    prompt.fill("again")
    page.get_by_role("button", name="Send").click()
    again = [*messages, {"role": "user", "content": "again"}]  # what the page sent
    refused = http.post("/v1/chat/completions", json={"model": MODEL, "messages": again, "max_tokens": 100_000})
    assert refused.status_code == 400
    sync_api.expect(page.locator("#error")).to_have_text(refused.json()["error"]["message"])
    assert page.locator("#transcript .msg.user").count() == 1, "a refused message must not join the conversation"


def test_stop_aborts_the_request_and_the_server_frees_it(page, http):
    before = metric(scrape(http), "vllm:request_success_total", finished_reason="abort")
    open_playground(page)
    set_sampling(page, 3000, Temperature="1")
    prompt = page.get_by_label("Message", exact=False)
    stop_button = page.get_by_role("button", name="Stop")
    for turn, stop in enumerate((lambda: stop_button.click(), lambda: prompt.press("Escape"))):
        prompt.fill("Tell me a very long story.")
        prompt.press("Enter")
        answer = page.locator("#transcript .msg.assistant .text").nth(turn)
        sync_api.expect(answer).not_to_be_empty()  # mid-answer: 3000 tokens take this model far longer
        sync_api.expect(stop_button).to_be_enabled()
        stop()
        sync_api.expect(page.locator("#status")).to_have_text("Stopped")
        sync_api.expect(page.locator("#transcript .msg.assistant").nth(turn)).to_contain_text("[stopped]")
        sync_api.expect(stop_button).to_be_disabled()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        samples = scrape(http)
        aborted = metric(samples, "vllm:request_success_total", finished_reason="abort")
        if aborted >= before + 2 and metric(samples, "vllm:num_requests_running") == 0:
            break
        time.sleep(0.2)
    assert aborted == before + 2, "the stopped requests are not counted as aborted in /metrics"
    assert metric(samples, "vllm:num_requests_running") == 0
    assert metric(samples, "vllm:kv_cache_usage_perc") == 0, "the aborted request's KV blocks were not freed"


def drop_file(page, selector: str, data: bytes, name: str, mime: str) -> None:
    """Drag-and-drop of a file onto `selector`, as the browser delivers it (a DataTransfer with a File)."""
    page.evaluate(
        """([selector, b64, name, mime]) => {
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const transfer = new DataTransfer();
            transfer.items.add(new File([bytes], name, {type: mime}));
            const target = document.querySelector(selector);
            target.dispatchEvent(new DragEvent('dragover', {dataTransfer: transfer, bubbles: true, cancelable: true}));
            target.dispatchEvent(new DragEvent('drop', {dataTransfer: transfer, bubbles: true, cancelable: true}));
        }""",
        [selector, base64.b64encode(data).decode(), name, mime],
    )


def test_image_drop_shows_its_token_count_and_gets_an_answer(page, http):
    open_playground(page)
    set_sampling(page, 12)
    # Not an image after all: the server's own message.
    drop_file(page, "#drop", b"not a png", "broken.png", "image/png")
    sync_api.expect(page.locator("#error")).not_to_be_empty()
    broken = "data:image/png;base64," + base64.b64encode(b"not a png").decode()
    refused = http.post(
        "/tokenize",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": broken}}]}],
        },
    )
    assert refused.status_code == 400
    sync_api.expect(page.locator("#error")).to_have_text(refused.json()["error"]["message"])

    drop_file(page, "#drop", encoded(100, 75), "photo.png", "image/png")
    # <|vision_start|> + the image's placeholders + <|vision_end|>, by docs/models.md's formula (not the server's code)
    expected = image_tokens(100, 75) + 2
    sync_api.expect(page.locator("#image-tokens")).to_have_text(f"Image: {expected} tokens")
    sync_api.expect(page.locator("#error")).to_be_empty()
    assert_fits_360px(page)
    screenshot(page, "image-upload")
    send_and_wait(page, "Describe this image.")
    assert page.locator("#transcript .msg.user img").count() == 1
    assert page.locator("#transcript .msg.assistant .text").last.text_content()
    sync_api.expect(page.locator("#attachment")).to_be_hidden()
    screenshot(page, "image-answer")


def test_video_drop_shows_its_token_count_and_gets_an_answer(page):
    open_playground(page)
    set_sampling(page, 6)
    drop_file(page, "#drop", tiny_mp4(), "clip.mp4", "video/mp4")
    sync_api.expect(page.locator("#image-tokens")).to_have_text(f"Video: {TINY_MP4_TOKENS} tokens")
    sync_api.expect(page.locator("#error")).to_be_empty()
    send_and_wait(page, "What happens?")
    assert page.locator("#transcript .msg.user video").count() == 1
    assert page.locator("#transcript .msg.assistant .text").last.text_content()


def test_dashboard_moves_under_load(page, ui_server):
    page.goto("/dashboard")
    sync_api.expect(page.locator("#status")).to_contain_text("Updated")
    sync_api.expect(page.locator("#value-tokens")).to_have_text("0.0")

    stop = threading.Event()

    def load() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 400, "stream": True}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=ui_server.url, headers=headers, timeout=60) as client:
            while not stop.is_set():
                with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    for _ in response.iter_lines():
                        if stop.is_set():
                            break

    threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        # Output tokens/s above zero, requests running, and the TTFT percentiles of the last minute filled in.
        page.wait_for_function(
            "parseFloat(" + card_text("tokens") + ") > 0"
            " && parseInt(" + card_text("requests") + ") > 0"
            " && " + card_text("ttft") + ".endsWith('ms')"
            " && " + card_text("itl") + ".endsWith('ms')"
            " && " + card_text("step") + ".includes('ms')",
            timeout=TIMEOUT_MS,
        )
        chart = page.locator("#chart-tokens")
        assert float(chart.get_attribute("data-max")) > 1, "the tokens/s chart drew no load"
        assert_fits_360px(page)
        if SCREENSHOTS:
            page.wait_for_timeout(15_000)  # some history in the charts
        screenshot(page, "dashboard")
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)


def canned_metrics(k: int) -> str:
    """The k-th /metrics snapshot of a made-up server, under the `pagoda:` prefix only (--metrics-prefix pagoda):
    every second 10 first tokens at <= 100 ms and 10 more at <= 1 s, 10 steps of 50 ms busy of which 20 ms
    waiting on the device, 10 prefix-cache queries of which 5 hit, two GPUs 90 % and 50 % busy, 10 speculative
    rows with 40 proposals of which 20 held, two LoRA adapters running and one waiting."""
    label = 'model_name="m"'
    lines = [
        f"pagoda:num_requests_running{{{label}}} 3",
        f"pagoda:num_requests_waiting{{{label}}} 1",
        f"pagoda:kv_cache_usage_perc{{{label}}} 0.25",
        f"pagoda:generation_tokens_total{{{label}}} {100 * k}",
        f"pagoda:prompt_tokens_total{{{label}}} {40 * k}",
        f'pagoda:request_success_total{{finished_reason="abort",{label}}} 2',
        f'pagoda:request_success_total{{finished_reason="stop",{label}}} {k}',
        f"pagoda:num_preemptions_total{{{label}}} 4",
        f"pagoda:prefix_cache_queries_total{{{label}}} {10 * k}",
        f"pagoda:prefix_cache_hits_total{{{label}}} {5 * k}",
        f"pagoda:engine_steps_total{{{label}}} {10 * k}",
        f"pagoda:engine_core_busy_seconds_total{{{label}}} {0.5 * k}",
        f"pagoda:engine_core_device_wait_seconds_total{{{label}}} {0.2 * k}",
        f'pagoda:gpu_utilization_perc{{gpu="0",tp_rank="0",{label}}} 0.9',
        f'pagoda:gpu_utilization_perc{{gpu="1",tp_rank="1",{label}}} 0.5',
        f"pagoda:spec_decode_num_drafts_total{{{label}}} {10 * k}",
        f"pagoda:spec_decode_num_draft_tokens_total{{{label}}} {40 * k}",
        f"pagoda:spec_decode_num_accepted_tokens_total{{{label}}} {20 * k}",
        'pagoda:lora_requests_info{max_lora="4",waiting_lora_adapters="sql",running_lora_adapters="chat,support"} 1',
    ]
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        for le, count in (("0.01", 0), ("0.1", 10 * k), ("1.0", 20 * k), ("+Inf", 20 * k)):
            lines.append(f'pagoda:{name}_bucket{{le="{le}",{label}}} {count}')
        lines.append(f"pagoda:{name}_count{{{label}}} {20 * k}")
    return "# HELP made up\n" + "\n".join(lines) + "\n"


def test_dashboard_math_on_known_metrics(page):
    """Rates, per-step times, ratios and bucket-interpolated percentiles, checked against hand-computed values."""
    served = []

    def fulfil(route) -> None:
        served.append(1)
        route.fulfill(status=200, content_type="text/plain; version=0.0.4", body=canned_metrics(len(served)))

    page.route("**/metrics", fulfil)
    page.goto("/dashboard")
    page.wait_for_function(card_text("ttft") + ".startsWith('p50')")
    # Deltas: 20 observations a snapshot, 10 in (0.01, 0.1], 10 in (0.1, 1.0]: p50 at the top of the first
    # bucket, p90 / p99 interpolated 80 % / 98 % into the second.
    sync_api.expect(page.locator("#value-ttft")).to_have_text("p50 100.0 ms")
    sync_api.expect(page.locator("#sub-ttft")).to_have_text("p90 820.0 ms · p99 982.0 ms")
    sync_api.expect(page.locator("#value-itl")).to_have_text("p50 100.0 ms")
    sync_api.expect(page.locator("#value-step")).to_have_text("30.00 ms / 20.00 ms")  # (50 - 20) and 20 per step
    sync_api.expect(page.locator("#value-prefix")).to_have_text("50.0 %")
    sync_api.expect(page.locator("#value-kv")).to_have_text("25.0 %")
    sync_api.expect(page.locator("#value-gpu")).to_have_text("70 %")  # the mean of the two GPUs
    sync_api.expect(page.locator("#sub-gpu")).to_have_text("GPU 0: 90 % · GPU 1: 50 %")
    sync_api.expect(page.locator("#value-spec")).to_have_text("3.00 tokens")  # 1 + 20 accepted / 10 rows
    rows = re.compile(r"proposals accepted: 50 % · rows verified: [1-9]\d*0$")  # 10 a snapshot over the window
    sync_api.expect(page.locator("#sub-spec")).to_have_text(rows)
    sync_api.expect(page.locator("#value-lora")).to_have_text("2")  # two adapters running, of 4 a step
    sync_api.expect(page.locator("#sub-lora")).to_have_text("running: chat,support · waiting: sql")
    sync_api.expect(page.locator("#value-requests")).to_have_text("3 / 1")
    sync_api.expect(page.locator("#value-preemptions")).to_have_text("4")
    sync_api.expect(page.locator("#sub-preemptions")).to_have_text("aborted requests: 2")
    sync_api.expect(page.locator("#status")).to_contain_text("pagoda:*")
    rate = float(page.locator("#value-tokens").text_content())
    assert 30 < rate < 300, rate  # 100 tokens a snapshot, a snapshot about every second


ROUTER_KEY = "router-alice-key"


@pytest.fixture(scope="module")
def router_url(ui_server, tmp_path_factory) -> Iterator[str]:
    """`pagoda router` in front of the one server, with one API key ("alice") and fast probes."""
    tmp = tmp_path_factory.mktemp("router")
    config = tmp / "router.toml"
    config.write_text(
        f'backends = ["{ui_server.url}"]\nbackend_api_key = "{API_KEY}"\n[api_keys]\nalice = "{ROUTER_KEY}"\n'
        "[health]\ninterval = 0.5\ntimeout = 2.0\n"
    )
    port = free_port()
    with open(tmp / "router.log", "wb") as log:
        cmd = [sys.executable, "-m", "pagoda", "router", "--config", str(config), "--host", "127.0.0.1"]
        proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp / "router.log").read_text()
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_router_page_shows_backends_and_tokens_per_key(browser, router_url, ui_server):
    context = browser.new_context(base_url=router_url, viewport=DESKTOP)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto("/")  # no key: the page and what it reads are open
        row = page.locator(f'#backends tr[data-backend="{ui_server.url}"]')
        sync_api.expect(row).to_contain_text("up")
        sync_api.expect(row).to_contain_text("closed")
        sync_api.expect(page.locator("#policy")).to_contain_text("1/1 healthy")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "user": "u1"}
        with httpx.Client(base_url=router_url, headers={"Authorization": f"Bearer {ROUTER_KEY}"}, timeout=60) as c:
            replies = [c.post("/v1/chat/completions", json=body) for _ in range(3)]
        assert all(r.status_code == 200 for r in replies), replies[0].text
        completion_tokens = sum(r.json()["usage"]["completion_tokens"] for r in replies)
        key = page.locator('#keys tr[data-key="alice"]')
        sync_api.expect(key).to_be_visible()
        cells = key.locator("td")
        sync_api.expect(cells.nth(0)).to_have_text("3")  # requests
        sync_api.expect(cells.nth(2)).to_have_text(str(completion_tokens))
        sync_api.expect(page.locator("#value-affinity")).to_have_text("100.0 %")  # one backend owns every session
        assert ROUTER_KEY not in page.content(), "the page shows key labels, never keys"
        # Loading the page asked the router for nothing it refused (no 401 for a favicon, say).
        sync_api.expect(page.locator("#sub-errors")).to_contain_text("rejected: 0")
        assert_fits_360px(page)
        if SCREENSHOTS:
            with httpx.Client(base_url=router_url, headers={"Authorization": f"Bearer {ROUTER_KEY}"}) as c:
                for i in range(12):  # some history in the charts
                    c.post("/v1/chat/completions", json={**body, "user": f"u{i % 3}"}, timeout=60)
                    page.wait_for_timeout(500)
        screenshot(page, "router")
    finally:
        context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
