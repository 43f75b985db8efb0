"""5,200 generated request bodies against a real `pagoda serve`, streaming and not: never a 5xx.

The bodies run from well-formed (right fields and types, values in range: they generate) through
out-of-range values to junk (wrong types, nulls, nested lists and objects, huge and negative ints,
NaN and infinities, unicode, lone surrogates, strings of a few KB, unknown fields, bodies that are
not objects or not JSON), for /v1/chat/completions, /v1/completions, /tokenize and /detokenize.
Every answer must be a success of the right shape or a 4xx in OpenAI's error shape; a stream must
end with [DONE] and carry no error event; the server must log no traceback.

The server is a tiny random-weight Llama with the embedded model's tokenizer and chat template (every
id the tokenizer produces is in its vocabulary), so the engine, detokenizer and templates all run,
cheaply: well-formed bodies ask for 1-3 tokens, and unset fields get its generation_config.json's
4 tokens, greedy. Hypothesis draws the seeds (derandomized: the same 5,200 bodies every run), a
thread pool sends each body as it is made, 12 at a time, and the failures are listed at the end,
each with its body and seed. Left out, because they are valid requests that would only be slow: more
than 3 samples (`n`) and token counts between 17 and max_model_len reached by pydantic's coercions
("100", 100.0).
"""

from __future__ import annotations

import json
import math
import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2e_helpers import API_KEY, MODEL
from e2e_server import ServerProcess
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

EXAMPLES = 5200
CONCURRENCY = 12
VOCAB = 49152  # SmolLM2's tokenizer: 49,152 pieces
MAX_MODEL_LEN = 256
DEFAULT_MAX_TOKENS = 4  # the tiny model's generation_config.json max_new_tokens
CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory):
    from pagoda.models.gguf_checkpoint import default_gguf_path, load_gguf_tokenizer

    folder = tmp_path_factory.mktemp("fuzz-model")
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    (folder / "config.json").write_text(json.dumps(config))
    # Unset fields: few tokens, greedy (sampling 49,152 logits costs ~2 ms a row on a CPU; bodies that
    # set a temperature still sample).
    (folder / "generation_config.json").write_text(
        json.dumps({"max_new_tokens": DEFAULT_MAX_TOKENS, "temperature": 0.0})
    )
    load_gguf_tokenizer(default_gguf_path()).save_pretrained(str(folder))
    proc = ServerProcess(
        folder.parent / f"{folder.name}-serve.log",
        [
            str(folder),
            "--load-format",
            "dummy",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            "32",
            "--max-waiting-requests",
            "10000",
            "--skip-preflight",
        ],
        # One torch thread: the model is tiny, and idle OpenMP workers spinning for work took
        # 5x the engine's CPU, out of the two cores the API process and this client share.
        env={"OMP_NUM_THREADS": "1"},
    )
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


# ---- the bodies ------------------------------------------------------------------------------------
# Hypothesis draws one seed per body; the body is built from it here. Built from Hypothesis's own
# strategies, bodies this rich cost ~10 ms each to draw on a 2-core machine (a minute for 5,200,
# on top of the requests themselves); built here, under 1 ms.
HUGE = [2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**100, -(2**63), -(2**63) - 1, -(2**64), 10**30]
ODD_TEXT = [
    "",
    " ",
    "\x00",
    "\ud800",
    "a\udfff b",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "{{ messages }}",
    "{% for m in messages %}",
    "\u202e\u200b",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🐍",
    "null",
    "NaN",
    "1e999",
    "-1",
    "\r\n\t",
    "\ufeff",
]
PLAIN = [
    "What is the capital of France?",
    "Hello",
    "Count to five:",
    "a b c",
    "1 + 1 =",
    "Ünïcödé ✓",
    "日本語",
    "مرحبا",
    "🙂 emoji",
    "tab\tand\nnewline",
]
# Code point ranges of generated text: ASCII, controls, Latin, Greek, Hebrew and Arabic (right to left),
# Devanagari, CJK, emoji, combining marks, lone surrogates, private use, specials, the astral planes.
RANGES = [
    (0x20, 0x7E),
    (0x00, 0x1F),
    (0xA0, 0x24F),
    (0x370, 0x3FF),
    (0x590, 0x6FF),
    (0x900, 0x97F),
    (0x4E00, 0x9FFF),
    (0x1F300, 0x1F6FF),
    (0x300, 0x36F),
    (0xD800, 0xDFFF),
    (0xE000, 0xF8FF),
    (0xFFF0, 0xFFFF),
    (0x10000, 0x10FFFF),
]
ROLES = ["system", "developer", "user", "assistant", "tool"]
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
TEMPLATES = [
    "{{ messages[0]['content'] }}",
    "plain text",
    "{% if %}",
    "{{ raise_exception('no') }}",
    "{{ messages | length }}",
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
]
_AS_INT = TypeAdapter(int | None)


def _as_int(value: object) -> int | None:
    """What pydantic reads an int field's value as (lax: "12" and 12.0 are 12); None if it refuses it."""
    try:
        return _AS_INT.validate_python(value)
    except (ValidationError, TypeError, ValueError, OverflowError):
        return None


class BodyMaker:
    """Request bodies from one seed: mostly well-formed (the engine must serve them), the rest with
    values out of range, of the wrong type, or junk."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    # ---- values
    def text(self, longest: int = 12) -> str:
        rng = self.rng
        roll = rng.random()
        if roll < 0.1:
            return rng.choice(ODD_TEXT)
        if roll < 0.15:  # a few KB at most: the HTTP layer's own size limits are not what this tests
            return ((self.text(5) or "x") * rng.randint(60, 900))[:4096]
        ranges = rng.sample(RANGES, rng.randint(1, 3))
        return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(0, longest)))

    def plain(self) -> str:
        return self.rng.choice(PLAIN)

    def big_int(self) -> int:
        rng = self.rng
        return rng.choice([rng.choice(HUGE), rng.randint(-(2**70), 2**70), rng.randint(-5, 10)])

    def odd_float(self) -> float:
        rng = self.rng
        return rng.choice([math.nan, math.inf, -math.inf, 1e308, -1e308, 1e-300, -0.0, rng.uniform(-1e9, 1e9)])

    def _scalar(self) -> object:
        return self.rng.choice(
            [
                lambda: None,
                lambda: self.rng.random() < 0.5,
                self.big_int,
                self.odd_float,
                self.text,
                lambda: self.text(3),
            ]
        )()

    def junk(self, depth: int = 0) -> object:
        roll = self.rng.random()
        if depth < 3 and roll < 0.2:
            return [self.junk(depth + 1) for _ in range(self.rng.randint(0, 3))]
        if depth < 3 and roll < 0.35:
            return {self.text(6): self.junk(depth + 1) for _ in range(self.rng.randint(0, 3))}
        return self._scalar()

    def choose(self, valid, wrong=None, p_valid: float = 0.8):  # type: ignore[no-untyped-def]
        """valid() mostly; else wrong() (a value of the right type out of range) or junk."""
        roll = self.rng.random()
        if roll < p_valid:
            return valid()
        if wrong is not None and roll < (1 + p_valid) / 2:
            return wrong()
        return self.junk()

    def count(self, valid, most: int):  # type: ignore[no-untyped-def]
        """An int field that sets how much work a valid request does: never read as more than
        `most` unless so large that the server refuses it at once (past max_model_len)."""
        while True:
            value = self.choose(valid, lambda: self.rng.choice([0, -1, -3, *HUGE]), p_valid=0.85)
            number = _as_int(value)
            if number is None or number <= most or number > MAX_MODEL_LEN:
                return value

    def max_tokens(self) -> object:
        rng = self.rng
        return self.count(lambda: rng.choice([1, 1, 2, 2, 3, 3, None, rng.randint(4, 16)]), 16)

    def n(self) -> object:
        # n above 3 is left out: valid up to 128, where each sample costs as much as a request.
        while True:
            value = self.choose(lambda: self.rng.randint(1, 3), lambda: self.rng.choice([0, -1, -(2**64)]))
            number = _as_int(value)
            if number is None or number <= 3:
                return value

    def token_ids(self, longest: int = 12) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, longest))]

    def odd_token_ids(self) -> list[int]:
        rng = self.rng
        return [
            rng.choice([rng.randrange(VOCAB), -1, VOCAB, VOCAB + 7, rng.choice(HUGE)]) for _ in range(rng.randint(0, 6))
        ]

    # ---- fields
    def sampling_fields(self) -> dict:
        rng, c = self.rng, self.choose
        return {
            "n": self.n,
            "temperature": lambda: c(lambda: rng.choice([0, 0.0, rng.uniform(0, 2)]), self.odd_float),
            "top_p": lambda: c(lambda: rng.uniform(0.01, 1), lambda: rng.choice([0, -0.5, 1.5, math.nan])),
            "top_k": lambda: c(lambda: rng.choice([-1, 0, 1, 5, 50, VOCAB, VOCAB + 1]), self.big_int),
            "min_p": lambda: c(lambda: rng.uniform(0, 1), self.odd_float),
            "presence_penalty": lambda: c(lambda: rng.uniform(-2, 2), self.odd_float),
            "frequency_penalty": lambda: c(lambda: rng.uniform(-2, 2), self.odd_float),
            "repetition_penalty": lambda: c(lambda: rng.uniform(0.5, 2), lambda: rng.choice([0, -1, 1e308, 1e-300])),
            "seed": lambda: c(lambda: rng.randint(0, 2**63), self.big_int),
            "stop": lambda: c(
                lambda: rng.choice([self.plain(), [self.plain() for _ in range(rng.randint(0, 3))]]),
                lambda: [self.text() for _ in range(rng.randint(0, 10))],
            ),
            "stop_token_ids": lambda: c(lambda: self.token_ids(3), self.odd_token_ids),
            "ignore_eos": lambda: c(lambda: rng.random() < 0.5, lambda: None),
            "min_tokens": lambda: c(lambda: rng.randint(0, 1), self.big_int),
            "skip_special_tokens": lambda: c(lambda: rng.random() < 0.5, lambda: None),
            "spaces_between_special_tokens": lambda: c(lambda: rng.random() < 0.5, lambda: None),
            "include_stop_str_in_output": lambda: c(lambda: rng.random() < 0.5, lambda: None),
            "stream_options": lambda: c(
                lambda: {k: rng.random() < 0.5 for k in STREAM_OPTIONS if rng.random() < 0.6},
                lambda: {"include_usage": self.junk()},
            ),
            "user": lambda: c(lambda: self.text(8), lambda: self.text(4000)),
            "request_id": lambda: c(lambda: f"fuzz-{rng.getrandbits(64):x}", self.text),
            "logit_bias": self.junk,  # fields this server does not know: ignored
            "response_format": self.junk,
            "tool_choice": self.junk,
        }

    def message(self) -> object:
        rng = self.rng
        if rng.random() < 0.05:
            return self.junk()
        message: dict = {"role": self.choose(lambda: rng.choice(ROLES), lambda: rng.choice(["bogus", "", "USER"]))}
        if rng.random() < 0.9:
            message["content"] = rng.choice([self.text, self.text, self.parts, lambda: None, self.junk])()
        for key in ("name", "tool_calls", "tool_call_id", self.text(5)):
            if rng.random() < 0.1:
                message[key] = rng.choice([self.text, self.junk])()
        return message

    def parts(self) -> list:
        rng = self.rng
        makers = [
            lambda: {"type": "text", "text": self.text()},
            lambda: {"type": "text", "text": self.text()},
            lambda: {
                "type": rng.choice(["image_url", "image", "video", "input_audio"]),
                "image_url": rng.choice([{"url": self.text()}, self.junk()]),
            },
            lambda: {"type": self.junk(), "text": self.junk()},
            self.junk,
        ]
        return [rng.choice(makers)() for _ in range(rng.randint(0, 3))]

    def messages(self) -> object:
        rng = self.rng
        roll = rng.random()
        if roll < 0.65:  # a conversation the model answers
            history = [
                {
                    "role": rng.choice(["system", "user", "assistant"]),
                    "content": rng.choice([self.plain(), [{"type": "text", "text": self.plain()}]]),
                }
                for _ in range(rng.randint(0, 2))
            ]
            return history + [{"role": "user", "content": self.plain()}]
        if roll < 0.93:
            return [self.message() for _ in range(rng.randint(1, 4))]
        return rng.choice([[], self.junk()])

    def prompt(self) -> object:
        rng = self.rng
        return rng.choice(
            [
                self.plain,
                self.plain,
                self.plain,
                self.token_ids,
                self.token_ids,
                lambda: [self.plain() for _ in range(rng.randint(1, 3))],
                lambda: [self.token_ids(6) for _ in range(rng.randint(1, 3))],
                lambda: self.text(4000),
                self.text,
                self.odd_token_ids,
                lambda: [self.odd_token_ids() for _ in range(rng.randint(0, 3))],
                lambda: [rng.choice([self.text(), rng.randrange(VOCAB)]) for _ in range(rng.randint(1, 3))],
                self.junk,
            ]
        )()

    # ---- bodies
    def with_fields(self, body: dict, fields: dict, most: int = 5) -> dict:
        rng = self.rng
        for name in rng.sample(sorted(fields), rng.randint(0, most)):
            body[name] = fields[name]()
        if rng.random() < 0.15:  # fields nobody defined
            body.update({self.text(8): self.junk() for _ in range(rng.randint(1, 2))})
        return body

    def generation(self, main: str, value: object, fields: dict) -> dict:
        rng = self.rng
        body = {
            main: value,
            "max_tokens": self.max_tokens(),
            "stream": self.choose(lambda: rng.random() < 0.5, p_valid=0.92),
        }
        if rng.random() < 0.9:
            body["model"] = self.choose(lambda: MODEL, lambda: self.text(4000), p_valid=0.9)
        return self.with_fields(body, fields)

    def chat(self) -> dict:
        rng, c = self.rng, self.choose
        fields = {
            **self.sampling_fields(),
            "max_completion_tokens": self.max_tokens,
            "logprobs": lambda: c(lambda: rng.random() < 0.5, self.big_int),
            "top_logprobs": lambda: c(lambda: rng.randint(0, 5), lambda: rng.choice([-1, 21, 1000, 2**64])),
            "add_generation_prompt": lambda: c(lambda: rng.random() < 0.7, lambda: None),
            "continue_final_message": lambda: c(lambda: rng.random() < 0.3, lambda: None),
            "chat_template": lambda: c(lambda: rng.choice(TEMPLATES), p_valid=0.5),
            "chat_template_kwargs": lambda: c(lambda: {rng.choice(["enable_thinking", "custom", "date"]): self.junk()}),
            "mm_processor_kwargs": self.junk,
            "tools": self.junk,
        }
        return self.generation("messages", self.messages(), fields)

    def completion(self) -> dict:
        rng, c = self.rng, self.choose
        fields = {
            **self.sampling_fields(),
            "logprobs": lambda: c(lambda: rng.randint(0, 5), self.big_int),
            "echo": lambda: c(lambda: rng.random() < 0.5, lambda: None),
            "suffix": lambda: c(lambda: None, self.text),
            "best_of": lambda: c(lambda: rng.choice([None, 1]), lambda: rng.choice([0, 2, -(2**64)])),
        }
        return self.generation("prompt", self.prompt(), fields)

    def tokenize(self) -> object:
        rng = self.rng
        roll = rng.random()
        if roll < 0.45:
            body = {"prompt": self.choose(lambda: rng.choice([self.plain(), self.text(), self.text(4000)]))}
        elif roll < 0.9:
            body = {"messages": self.messages()}
        else:
            return {key: self.junk() for key in rng.sample(["prompt", "messages", "model", "add_special_tokens"], 2)}
        fields = {
            "model": lambda: self.choose(lambda: MODEL, self.text),
            "add_special_tokens": lambda: self.choose(lambda: rng.random() < 0.5),
            "add_generation_prompt": lambda: self.choose(lambda: rng.random() < 0.5),
        }
        return self.with_fields(body, fields, most=3)

    def detokenize(self) -> object:
        rng = self.rng
        body = {
            "tokens": self.choose(lambda: [rng.randrange(VOCAB) for _ in range(rng.randint(0, 20))], self.odd_token_ids)
        }
        return self.with_fields(body, {"model": lambda: self.choose(lambda: MODEL, self.text)}, most=1)

    def not_an_object(self) -> object:
        rng = self.rng
        return rng.choice(
            [
                lambda: rng.choice([self._scalar(), [self.junk()]]),
                lambda: bytes(rng.randrange(256) for _ in range(rng.randint(0, 40))),
                lambda: b'{"messages": [{"role": "user", "content": "hi"}',
            ]
        )()  # bytes: sent as they are

    def request(self) -> tuple[str, object]:
        rng = self.rng
        path = rng.choice([CHAT] * 8 + [COMPLETIONS] * 7 + [TOKENIZE] * 2 + [DETOKENIZE] * 2)
        if rng.random() < 0.03:
            return path, self.not_an_object()
        return path, {
            CHAT: self.chat,
            COMPLETIONS: self.completion,
            TOKENIZE: self.tokenize,
            DETOKENIZE: self.detokenize,
        }[path]()


# ---- checking the answers ----------------------------------------------------------------------
def _error_shape(response: httpx.Response) -> str | None:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return "4xx body is not {'error': {...}}"
    if not (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and error["message"]
        and isinstance(error.get("type"), str)
        and error.get("code") == response.status_code
        and (error.get("param") is None or isinstance(error["param"], str))
    ):
        return "4xx error lacks message/type/param/code"
    return None


def _stream_problem(text: str) -> str | None:
    events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    if not events or events[-1] != "[DONE]":
        return "stream does not end with [DONE]"
    for event in events[:-1]:
        try:
            chunk = json.loads(event)
        except ValueError:
            return f"stream event is not JSON: {event[:100]}"
        if "error" in chunk:
            return f"error event in a 200 stream: {event[:300]}"
    return None


def problem(path: str, response: httpx.Response) -> str | None:
    """What is wrong with this answer, or None."""
    status = response.status_code
    if status >= 500:
        return f"{status}"
    if status >= 400:
        return _error_shape(response)
    if status != 200:
        return f"unexpected status {status}"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return _stream_problem(response.text)
    try:
        data = response.json()
    except ValueError:
        return "200 body is not JSON"
    expected = {CHAT: "choices", COMPLETIONS: "choices", TOKENIZE: "tokens", DETOKENIZE: "prompt"}[path]
    return None if expected in data else f"200 body lacks {expected!r}"


class Sender:
    """Sends each generated request as soon as it is drawn, CONCURRENCY at a time, and keeps score."""

    def __init__(self, base_url: str):
        self.client = httpx.Client(
            base_url=base_url,
            timeout=120,
            headers={"Authorization": f"Bearer {API_KEY}"},
            limits=httpx.Limits(max_connections=CONCURRENCY),
        )
        self.pool = ThreadPoolExecutor(CONCURRENCY)
        self.slots = threading.BoundedSemaphore(4 * CONCURRENCY)  # how far generation may run ahead
        self.lock = threading.Lock()
        self.statuses: Counter[tuple[str, int | str]] = Counter()
        self.streamed_ok = 0
        self.failures: list[str] = []

    def submit(self, seed: int, path: str, body: object) -> None:
        self.slots.acquire()
        self.pool.submit(self._send, seed, path, body)

    def _send(self, seed: int, path: str, body: object) -> None:
        try:
            # json.dumps writes NaN and Infinity as Python clients do; bytes go out as they are.
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            try:
                response = self.client.post(path, content=content, headers={"Content-Type": "application/json"})
                found, status = problem(path, response), response.status_code
            except Exception as exc:  # noqa: BLE001 - a worker thread's error would vanish otherwise
                response, found, status = None, f"no answer: {type(exc).__name__}: {exc}", "no answer"
            with self.lock:
                self.statuses[(path, status)] += 1
                if status == 200 and "event-stream" in response.headers.get("content-type", ""):
                    self.streamed_ok += 1
                if found is not None:
                    text = response.text[:300] if response is not None else ""
                    self.failures.append(
                        f"POST {path} -> {found} (BodyMaker({seed}).request())\n"
                        f"  body: {content[:600]!r}\n  answer: {text}"
                    )
        finally:
            self.slots.release()

    def finish(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()


def test_fuzzed_bodies_never_get_a_5xx(fuzz_server: ServerProcess) -> None:
    sender = Sender(fuzz_server.url)

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(seed=st.integers(0, 2**64 - 1))
    def send(seed: int) -> None:
        sender.submit(seed, *BodyMaker(seed).request())

    try:
        send()
    finally:
        sender.finish()
    total = sum(sender.statuses.values())
    by_path = Counter({path: 0 for path in (CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE)})
    ok: Counter[str] = Counter()
    statuses: Counter[int | str] = Counter()
    for (path, status), count in sender.statuses.items():
        by_path[path] += count
        ok[path] += count if status == 200 else 0
        statuses[status] += count
    summary = (
        f"{total} requests; per endpoint {dict(by_path)}; 200s {dict(ok)}; 200 streams "
        f"{sender.streamed_ok}; statuses {dict(statuses)}"
    )
    assert not sender.failures, f"{len(sender.failures)} bad answers ({summary}):\n" + "\n".join(sender.failures[:15])
    assert total >= 5000, summary
    # The mix must keep reaching the engine, not only the validators.
    assert min(by_path.values()) >= 500 and all(ok[path] >= 100 for path in by_path), summary
    assert sender.streamed_ok >= 200, summary
    assert "Traceback" not in fuzz_server.log_tail(10**7), fuzz_server.log_tail()
    print(summary)
