"""Where one image request's time to first token goes, served: the API process's steps timed alone, then a
running server's view of sequential requests.

    python benchmarks/profile/image_ttft_probe.py MODEL_DIR --out FILE.json [--requests 12] [--port 8811]

MODEL_DIR is a Qwen2-VL folder (random weights: `--load-format dummy` is passed). First, in this process, the
steps `pagoda serve`'s API process runs on a 1000x750 random-noise JPEG (vLLM's `random-mm` kind of image) before
the request reaches the engine core, each timed alone (median of 10): base64 decoding, JPEG decoding, resize and
patchify, placeholder expansion with the content hash, and pickling the encoder input. Then a server is started
(`--api-server-count 4`, bfloat16), warmed with 4 requests, and `--requests` streamed chat requests (that image +
20 words, 8 tokens out) are sent one at a time: the client's TTFT per request, and from the server's `/metrics`
(the histograms' sums over the measured requests) its own mean TTFT, the core's queue time (arrival at the core
to first scheduled) and prefill time (first scheduled to first token). TTFT minus those two is the API side and
the transport. Writes {"jpeg_bytes", "offline_ms", "served"} to --out.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import pickle
import re
import statistics
import subprocess
import sys
import time
import urllib.request

import numpy as np
from PIL import Image

from pagoda.frontend.multimodal.image_processor import VisionPreprocessConfig, preprocess_image
from pagoda.frontend.multimodal.media import MediaPolicy, decode_image
from pagoda.frontend.multimodal.prompt import PlaceholderIds, expand_prompt

HISTOGRAMS = ("time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds")


def noise_jpeg(seed: int = 0) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (750, 1000, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG")
    return base64.b64encode(buf.getvalue()).decode()


def api_side(b64: str, repeat: int = 12) -> dict[str, float]:
    """Median ms of each API-side step for one image (the first two runs are warm-up)."""
    cfg = VisionPreprocessConfig()
    steps: dict[str, list[float]] = {k: [] for k in ("b64", "decode", "preprocess", "expand_hash", "pickle")}
    for i in range(repeat):
        t0 = time.perf_counter()
        raw = base64.b64decode(b64)
        t1 = time.perf_counter()
        image = decode_image(raw, MediaPolicy(), "image")
        image.load()
        t2 = time.perf_counter()
        visual = preprocess_image(image, cfg)
        t3 = time.perf_counter()
        _, inputs = expand_prompt([1, 2, 99, 3], [("image", visual)], PlaceholderIds(99, 98), cfg.cache_key())
        t4 = time.perf_counter()
        pickle.dumps(inputs, protocol=5)
        t5 = time.perf_counter()
        if i >= 2:
            for key, a, b in zip(steps, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                steps[key].append((b - a) * 1e3)
    return {k: statistics.median(v) for k, v in steps.items()}


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    values = {}
    for name in HISTOGRAMS:
        for part in ("sum", "count"):
            m = re.search(rf"^pagoda:{name}_{part}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
            values[f"{name}_{part}"] = float(m.group(1)) if m else 0.0
    return values


def first_token_ms(url: str, model: str, b64: str | None, text: str = " ".join(["word"] * 20)) -> float:
    """The client's TTFT of one streamed chat request: the JPEG `b64` and `text`, or `text` alone (b64 None). The
    stream is read to its end: one left early is aborted, and the server then records no queue or prefill time."""
    content: str | list = text
    if b64 is not None:
        content = [
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + b64}},
            {"type": "text", "text": text},
        ]
    body = {"model": model, "max_tokens": 8, "stream": True, "ignore_eos": True}
    body["messages"] = [{"role": "user", "content": content}]
    request = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    first = None
    with urllib.request.urlopen(request) as response:
        for line in response:
            if first is None and line.startswith(b"data:") and b'"content"' in line:
                first = time.perf_counter() - started
    assert first is not None, "no content in the stream"
    return first * 1e3


def served(folder: str, b64: str, requests: int, port: int) -> dict:
    cmd = [sys.executable, "-m", "pagoda", "serve", folder, "--dtype", "bfloat16", "--load-format", "dummy"]
    cmd += ["--max-model-len", "4096", "--api-server-count", "4", "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                if server.poll() is not None:
                    sys.exit(f"the server exited ({server.returncode})")
                time.sleep(1)
        model = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]
        for _ in range(4):
            first_token_ms(url, model, b64)
        before = scrape(url)
        client = [first_token_ms(url, model, b64) for _ in range(requests)]
        after = scrape(url)
    finally:
        server.terminate()
        server.wait(60)
    delta = {k: after[k] - before[k] for k in after}

    def mean_ms(name: str) -> float:
        return 1e3 * delta[f"{name}_sum"] / max(1.0, delta[f"{name}_count"])

    return {
        "client_ttft_ms_median": statistics.median(client),
        "client_ttft_ms": client,
        "server_ttft_ms_mean": mean_ms(HISTOGRAMS[0]),
        "queue_ms_mean": mean_ms(HISTOGRAMS[1]),
        "prefill_ms_mean": mean_ms(HISTOGRAMS[2]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--port", type=int, default=8811)
    args = parser.parse_args()
    b64 = noise_jpeg()
    result = {"jpeg_bytes": len(base64.b64decode(b64)), "offline_ms": api_side(b64)}
    print("API side, ms:", {k: round(v, 2) for k, v in result["offline_ms"].items()})
    result["served"] = served(args.model, b64, args.requests, args.port)
    print(json.dumps({k: v for k, v in result["served"].items() if k != "client_ttft_ms"}, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
