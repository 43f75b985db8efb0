"""What to send: random-word prompts, JSONL datasets, random images, and the arrival schedule.

With `--image WxH` every request is a chat completion whose one user message holds the random text and then
one random JPEG of that size as a base64 data URI, as vLLM's `random-mm` dataset sends them
(`RandomMultiModalDataset` in vllm/benchmarks/datasets/datasets.py: iid uniform RGB noise, `process_image`'s
JPEG data URI, text part first and the image after it, `--random-input-len` text tokens).

A `Workload` turns into request bodies (`payloads`); the sizes it aims for are nominal, the sizes that count
are the server's own `usage.prompt_tokens` / `usage.completion_tokens`, read back per request.
"""

from __future__ import annotations

import base64
import io
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Short, common English words: almost all are one token (with their leading space) in BPE and SentencePiece
# vocabularies, so the word count is a good first guess of the token count; `calibrate` corrects it.
_WORD_TEXT = """
the of and to in is was for on are with as his they be at one have this from or had by word but what some we can
out other were all there when up use your how said an each she which do their time if will way about many then
them write would like so these her long make thing see him two has look more day could go come did number sound
no most people my over know water than call first who may down side been now find any new work part take get
place made live where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move right boy old
too same tell does set three want air well also play small end put home read hand port large spell add even land
here must big high such follow act why ask men change went light kind off need house picture try us again animal
point mother world near build self earth father head stand own page should country found answer school grow
study still learn plant cover food sun four between state keep eye never last let thought city tree cross farm
hard start might story saw far sea draw left late run while press close night real life few north open seem
together next white children begin got walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room friend began idea fish mountain stop once
base hear horse cut sure watch color face wood main enough plain girl usual young ready above ever red list
"""
WORDS = _WORD_TEXT.split()


@dataclass
class RequestSpec:
    """One request before it becomes a body: a prompt (completions) or messages (chat)."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    images: list[str] = field(default_factory=list)  # data URIs, appended to the last user message


def random_words(rng: np.random.Generator, n: int) -> str:
    idx = rng.integers(0, len(WORDS), size=max(1, n))
    return " ".join(WORDS[i] for i in idx)


def parse_image_sizes(text: str | None) -> list[tuple[int, int]]:
    """`--image 448x448,1280x720` -> [(448, 448), (1280, 720)]."""
    if not text:
        return []
    sizes = []
    for item in text.split(","):
        item = item.strip().lower()
        w, sep, h = item.partition("x")
        if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
            raise ValueError(f"--image: {item!r} is not WIDTHxHEIGHT (e.g. 448x448)")
        sizes.append((int(w), int(h)))
    return sizes


def random_jpeg_data_uri(rng: np.random.Generator, width: int, height: int) -> str:
    """A random RGB image as a base64 JPEG data URI, as vLLM's `random-mm` dataset builds them: every pixel
    drawn uniformly from 0..255 (noise: the worst case for JPEG, so the upload is as large as it gets), saved
    by Pillow at its default quality. Every image differs, so no server-side image cache can hide the encoder."""
    from PIL import Image  # lazy: PIL, only for --image workloads

    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def image_rng(seed: int, request: int, item: int) -> np.random.Generator:
    """The generator of one image: a function of (seed, request number, item), so a run's images depend
    on --seed only (not on calibration, warm-up sizes or the order images are built in)."""
    return np.random.default_rng([seed, request, item, 0x1A6E])


def load_jsonl(path: str) -> list[RequestSpec]:
    """One JSON object per line: {"prompt": ...} or {"messages": [...]}, optional "max_tokens". An OpenAI Batch
    line ({"custom_id", "method", "url", "body": {...}}) is accepted too: its body is read the same way."""
    specs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc})") from None
            if isinstance(obj, dict) and isinstance(obj.get("body"), dict):
                obj = obj["body"]
            if not isinstance(obj, dict) or not ("prompt" in obj or "messages" in obj):
                raise ValueError(f'{path}:{lineno}: expected an object with "prompt" or "messages"')
            max_tokens = obj.get("max_tokens", obj.get("max_completion_tokens"))
            if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
                raise ValueError(f"{path}:{lineno}: max_tokens must be a positive integer")
            if "messages" in obj:
                if not isinstance(obj["messages"], list) or not obj["messages"]:
                    raise ValueError(f"{path}:{lineno}: messages must be a non-empty list")
                specs.append(RequestSpec(messages=obj["messages"], max_tokens=max_tokens))
            else:
                if not isinstance(obj["prompt"], str):
                    raise ValueError(f"{path}:{lineno}: prompt must be a string")
                specs.append(RequestSpec(prompt=obj["prompt"], max_tokens=max_tokens))
    if not specs:
        raise ValueError(f"{path}: no requests in the file")
    return specs


def _flatten(messages: list[dict[str, Any]]) -> str:
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(str(content or ""))
    return "\n".join(parts)


@dataclass
class Workload:
    """Builds request bodies for one endpoint. `words_per_prompt` is set by calibration (random dataset)."""

    endpoint: str  # "chat" | "completions"
    model: str
    input_len: int
    output_len: int
    seed: int = 0
    dataset: str = "random"
    dataset_specs: list[RequestSpec] | None = None
    image_sizes: list[tuple[int, int]] = field(default_factory=list)
    images_per_request: int = 1
    image_detail: str | None = None  # OpenAI's image_url.detail on every image (None: not sent)
    ignore_eos: bool = False
    temperature: float | None = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    words_per_prompt: int | None = None
    _cursor: int = 0

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        if self.words_per_prompt is None:
            self.words_per_prompt = max(1, self.input_len)

    def next_specs(self, n: int) -> list[RequestSpec]:
        specs = []
        for _ in range(n):
            i, self._cursor = self._cursor, self._cursor + 1
            if self.dataset == "jsonl":
                assert self.dataset_specs
                base = self.dataset_specs[i % len(self.dataset_specs)]
                spec = RequestSpec(prompt=base.prompt, messages=base.messages, max_tokens=base.max_tokens)
            else:
                spec = RequestSpec(prompt=random_words(self.rng, self.words_per_prompt or 1))
            for k in range(self.images_per_request if self.image_sizes else 0):
                w, h = self.image_sizes[(i * self.images_per_request + k) % len(self.image_sizes)]
                spec.images.append(random_jpeg_data_uri(image_rng(self.seed, i, k), w, h))
            specs.append(spec)
        return specs

    def body(self, spec: RequestSpec, max_tokens: int | None = None) -> dict[str, Any]:
        """The JSON body of one streamed request, usage requested in the last chunk."""
        tokens = max_tokens if max_tokens is not None else (spec.max_tokens or self.output_len)
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": tokens,
        }
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extra sampling field; pagoda accepts it too
        if self.endpoint == "chat":
            messages: list[dict[str, Any]] = (
                [dict(m) for m in spec.messages]
                if spec.messages is not None
                else [{"role": "user", "content": spec.prompt or ""}]
            )
            if spec.images:
                last = messages[-1]
                content = last.get("content")
                parts = list(content) if isinstance(content, list) else [{"type": "text", "text": content or ""}]
                detail = {"detail": self.image_detail} if self.image_detail else {}
                parts += [{"type": "image_url", "image_url": {"url": uri, **detail}} for uri in spec.images]
                messages[-1] = {**last, "content": parts}
            body["messages"] = messages
        else:
            body["prompt"] = spec.prompt if spec.prompt is not None else _flatten(spec.messages or [])
        body.update(self.extra_body)
        return body


def arrival_intervals(
    n: int, request_rate: float, burstiness: float = 1.0, rng: np.random.Generator | None = None
) -> np.ndarray:
    """Gaps (s) before each of `n` requests. Gamma-distributed with shape `burstiness` and mean 1/rate:
    burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular. rate inf: everything at t = 0."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(n)
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    rng = rng or np.random.default_rng()
    theta = 1.0 / (request_rate * burstiness)
    return rng.gamma(shape=burstiness, scale=theta, size=n)
