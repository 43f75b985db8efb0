"""Every environment variable Pagoda reads, declared once: its name, type, default and what it changes.

Nothing else in the package reads `os.environ` for these names; the launcher (`pagoda/launch/`) only
*sets* variables for its children (PROMETHEUS_MULTIPROC_DIR). `Env.value` reads the environment each time
it is asked, but most users of a switch ask once and keep the answer for the life of the process
(`once=True` below: set it before the process starts; a test flips it in a subprocess or by
monkeypatching the cached decision). The fast-path switches are the A/B switches of
`docs/performance.md`'s fast-path table: each row there names the benchmark that shows its gain.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Env:
    name: str
    kind: type  # bool | str | float
    default: Any
    doc: str  # what it is for; for a switch, what "0" turns off
    once: bool = False  # its users decide once per process (the first use or startup) and keep the answer

    @property
    def value(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        if self.kind is bool:
            return raw not in ("0", "false", "False", "no")
        try:
            return self.kind(raw)
        except ValueError:
            return self.default


# ---- fast paths (all on by default; "0" falls back to the general path, for A/B runs and debugging)
FUSED_OPS = Env(
    "PAGODA_FUSED_OPS",
    bool,
    True,
    "the fused Triton norm/rotary/activation/LF kernels (kernels/rms_norm.py, rotary.py, activation.py, "
    "localized_filter.py); 0: the PyTorch ops",
    once=True,
)
GEMV = Env(
    "PAGODA_GEMV", bool, True, "the one-row Triton GEMV for steps of one token (kernels/gemv.py); 0: cuBLAS", once=True
)
GEMV_LOOP_ROWS = Env(
    "PAGODA_GEMV_LOOP_ROWS",
    int,
    None,
    "matmuls of up to this many rows whose K fits one GEMV tile take the GEMV's row loop (kernels/gemv.py; "
    "default: policy.GEMV_LOOP_ROWS by weight size); 1: only one-row matmuls take the GEMV",
    once=True,
)
PDL = Env(
    "PAGODA_PDL", bool, True, "programmatic dependent launch between small steps' kernels (kernels/pdl.py)", once=True
)
CPU_INT4 = Env(
    "PAGODA_CPU_INT4",
    bool,
    True,
    "on the CPU, a GGUF model's 4-bit linear layers stay 4-bit (layers/quantization/cpu_int4.py); 0: float32",
    once=True,
)
CPU_INT8_LM_HEAD = Env(
    "PAGODA_CPU_INT8_LM_HEAD",
    bool,
    True,
    "beside the bf16 LM head, steps of few rows multiply by an int8 copy of it (layers/quantization/cpu_int4.py); "
    "0: the bf16 copy at every step",
    once=True,
)
CPU_KV_IN_PLACE = Env(
    "PAGODA_CPU_KV_IN_PLACE",
    bool,
    True,
    "the CPU attention reads a request whose cache blocks are one run through a view, without gathering them "
    "(layers/torch_attention.py); 0: always gathered",
    once=True,
)
CPU_LEAN_DECODE = Env(
    "PAGODA_CPU_LEAN_DECODE",
    bool,
    True,
    "a CPU step of decode rows only runs each Llama-family layer in the fewest PyTorch calls, bit for bit the "
    "general path (models/llama_cpu_decode.py); 0: the general path",
    once=True,
)
CPU_BF16_LM_HEAD = Env(
    "PAGODA_CPU_BF16_LM_HEAD",
    bool,
    True,
    "on a CPU with native bf16, a GGUF model with 4-bit layers multiplies its LM head by a bf16 copy of the "
    "float32 weight (layers/quantization/cpu_int4.py); 0: float32",
    once=True,
)
CPU_KV_REUSE_FIRST = Env(
    "PAGODA_CPU_KV_REUSE_FIRST",
    bool,
    True,
    "on the CPU, the KV pool hands out freed blocks before never-used ones, so its resident memory follows the "
    "peak in use (engine/block_manager.py); 0: never-used first, as on a GPU",
    once=True,
)
CPU_KV_RESERVE_TOKENS = Env(
    "PAGODA_CPU_KV_RESERVE_TOKENS",
    int,
    2048,
    "on the CPU, how many tokens of freed blocks (cached prefixes) the KV pool keeps before it reuses the oldest "
    "ahead of a never-used block (at most --max-model-len): more keeps more prefixes through other traffic and "
    "costs resident memory, ~45 KiB a token for the default model's float32 cache (engine/block_manager.py)",
    once=True,
)
CPU_PREFIX_COPY_TOKENS = Env(
    "PAGODA_CPU_PREFIX_COPY_TOKENS",
    int,
    1024,
    "on the CPU, a prefix-cache hit of at most this many tokens (a chat's shared system prompt) whose blocks do "
    "not continue into a run is copied into the request's own blocks while at most 2 other requests run, so its "
    "decode steps attend one run in place instead of gathering the cache every layer every step "
    "(engine/block_manager.py); 0: hits are always shared",
    once=True,
)
API_WARM_UP = Env(
    "PAGODA_API_WARM_UP",
    bool,
    True,
    "each API process prepares one small chat prompt (with a tiny image for a vision-language model) before it "
    "takes connections, so its first request does not pay the first-use costs (server/warm_up.py); 0: none",
    once=True,
)
LAUNCHER_EXEC = Env(
    "PAGODA_LAUNCHER_EXEC",
    bool,
    True,
    "`pagoda serve`'s launcher execs a fresh image to supervise from once its checks pass, leaving the checks' "
    "modules and tokenizer behind (launch/supervise.py); 0: it supervises in the checking image",
    once=True,
)
LORA_KERNELS = Env(
    "PAGODA_LORA_KERNELS",
    bool,
    True,
    "the Triton shrink/expand pair for LoRA adapters (kernels/lora.py); 0: the PyTorch reference (no CUDA graphs)",
    once=True,
)
LORA_STACKED = Env(
    "PAGODA_LORA_STACKED",
    bool,
    True,
    "LoRA kernels: adapters' A stacked under each eligible decoder layer's weight, so small steps get the shrink "
    "from the layer's own matmul (lora/layers.py); 0: the shrink is a launch of its own",
    once=True,
)
LORA_SIDE_STREAM = Env(
    "PAGODA_LORA_SIDE_STREAM",
    bool,
    True,
    "LoRA kernels: each adapted layer's shrink on a side stream, beside the layer's own matmul (lora/layers.py); "
    "0: after it, on the step's stream",
    once=True,
)
PP_MICRO_BATCHES = Env(
    "PAGODA_PP_MICRO_BATCHES",
    bool,
    True,
    "several micro-batches in flight through CPU pipeline stages (config.engine.resolve_micro_batches); 0: one "
    "step at a time",
    once=True,
)
SPEC_LEAN_GREEDY = Env(
    "PAGODA_SPEC_LEAN_GREEDY",
    bool,
    True,
    "a speculative step whose every row is greedy with proposals, and none asks for a grammar, penalties or "
    "logprobs, is verified in a dozen launches (worker/spec_rows.py); 0: the general verification",
    once=True,
)
SPEC_DEFERRED_OUTPUTS = Env(
    "PAGODA_SPEC_DEFERRED_OUTPUTS",
    bool,
    True,
    "with async scheduling, a step read at once for its proposals has its outputs (detokenizing, stop strings) "
    "made after the next step is launched, while the GPU runs it (engine/llm_engine.py); 0: before the next step "
    "is scheduled",
    once=True,
)
SPEC_DECODE_ROWS = Env(
    "PAGODA_SPEC_DECODE_ROWS",
    bool,
    True,
    "a CUDA-graph verification step of a model without per-sequence state runs each of its tokens as a decode row "
    "of its own, through a decode bucket (worker/graph_runner.py); 0: through a mixed-step bucket",
    once=True,
)
MIXED_STEP_GRAPHS = Env(
    "PAGODA_MIXED_STEP_GRAPHS",
    bool,
    True,
    "CUDA graphs for steps that mix prefill chunks and decode rows (worker/graph_runner.py); 0: such steps run eagerly",
    once=True,
)
ENCODER_GRAPH_PATCHES = Env(
    "PAGODA_ENCODER_GRAPH_PATCHES",
    int,
    8192,
    "the multimodal encoder's forwards of up to this many patch rows (8192: two 1000x750 images) replay CUDA graphs, "
    "one per set of item shapes met 3 times (worker/encoder_graphs.py); 0: always eager",
    once=True,
)
ENCODER_CAPTURE_THREAD = Env(
    "PAGODA_ENCODER_CAPTURE_THREAD",
    bool,
    True,
    "the multimodal encoder's CUDA graphs are captured on a thread of their own while the engine runs the key "
    "eagerly (worker/encoder_graphs.py); 0: inside the step that meets the key, which waits for the capture",
    once=True,
)
RESIZE_THREADS = Env(
    "PAGODA_RESIZE_THREADS",
    int,
    None,
    "threads that resize one image's bands at once in the API process, bit for bit PIL's resize "
    "(frontend/multimodal/banded_resize.py; default: up to 4 and the machine's cores); 1: PIL's resize on one thread",
)
VISION_CUDNN_AFTER = Env(
    "PAGODA_VISION_CUDNN_AFTER",
    int,
    3,
    "the vision tower's attention takes cuDNN (whose first call of each new shape compiles a kernel on the engine's "
    "thread) from the Nth tower forward that meets a shape on, FlashAttention before it (layers/segment_attention.py); "
    "1: cuDNN from the first call (PyTorch's choice), 0: never",
    once=True,
)

# ---- settings
API_KEY = Env(
    "PAGODA_API_KEY", str, None, "the API key `pagoda serve` requires (--api-key wins), and the one the clients send"
)
CACHE_DIR = Env("PAGODA_CACHE_DIR", str, None, "where converted GGUF checkpoints are cached (~/.cache/pagoda)")
GGUF_CONVERSION_CACHE = Env(
    "PAGODA_GGUF_CONVERSION_CACHE",
    bool,
    True,
    "keep a small GGUF checkpoint's config and dequantized weights under PAGODA_CACHE_DIR (later starts skip "
    "parsing and dequantizing it); 0: read the .gguf file every time",
)
OPENAI_API_KEY = Env(
    "OPENAI_API_KEY", str, None, "the key `pagoda bench` / `pagoda batch` send (before PAGODA_API_KEY)"
)


@dataclass(frozen=True)
class _VllmSwitch(Env):
    """A vLLM switch read as vLLM reads it: on only for "1" or "true" (any case, surrounding spaces ignored),
    off for anything else (so "yes" or "on" turn nothing on, as they do not in vLLM)."""

    @property
    def value(self) -> bool:
        return os.environ.get(self.name, "").strip().lower() in ("1", "true")


ALLOW_RUNTIME_LORA_UPDATING = _VllmSwitch(
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    bool,
    False,
    "vLLM's name for --allow-runtime-lora-updating: /v1/load_lora_adapter and /v1/unload_lora_adapter; on only "
    'for "1" or "true" (any case), as in vLLM',
)
HTTP_TIMEOUT_KEEP_ALIVE = Env(
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
    float,
    75.0,
    "vLLM's name for --timeout-keep-alive's default, in seconds (Pagoda's 75, vLLM's 5: longer than clients keep "
    "an idle pooled connection, so none reuses one the server is closing at that moment)",
)
TP_INIT_TIMEOUT_S = Env(
    "PAGODA_TP_INIT_TIMEOUT_S",
    float,
    120.0,
    "seconds the tensor-parallel ranks have to meet at startup (torch.distributed / NCCL init) before serve fails",
)
TP_HEARTBEAT_TIMEOUT_S = Env(
    "PAGODA_TP_HEARTBEAT_TIMEOUT_S",
    float,
    5.0,
    "seconds without a heartbeat after which a tensor-parallel rank counts as hung and the engine core exits",
)
TP_STEP_TIMEOUT_S = Env(
    "PAGODA_TP_STEP_TIMEOUT_S",
    float,
    600.0,
    "seconds one tensor-parallel step (or control call) may take before its collectives count as hung",
)

CORE_HEARTBEAT_TIMEOUT_S = Env(
    "PAGODA_CORE_HEARTBEAT_TIMEOUT_S",
    float,
    5.0,
    "seconds without a heartbeat from the engine core process (a thread of it beats twice a second, however long "
    "a step takes) after which `pagoda serve` counts the core as hung: the API processes answer 503, the core is "
    "killed and the server exits 1",
)

GRAMMAR_COMPILE_TIMEOUT_S = Env(
    "PAGODA_GRAMMAR_COMPILE_TIMEOUT_S",
    float,
    30.0,
    "seconds a structured-output request's grammar may take to compile before the request is refused (400)",
)

# ---- diagnostics (unset in production)
CORE_PROFILE = Env(
    "PAGODA_CORE_PROFILE",
    str,
    None,
    "diagnostics: a file path; the engine core's serving loop runs under cProfile and writes its pstats there when "
    "the server stops (the loop's Python runs slower meanwhile)",
)
CORE_TRACE = Env(
    "PAGODA_CORE_TRACE",
    str,
    None,
    "diagnostics: PATH[,SKIP[,STEPS]]; the engine core records STEPS (200) engine steps after the first SKIP (300) "
    "under torch.profiler, CPU and CUDA, and writes a Chrome trace to PATH (engine/core_trace.py; "
    "benchmarks/profile/core_trace_summary.py reads it)",
)

# ---- fault injection, for tests only (unset in production)
TEST_LONG_STEP_S = Env(
    "PAGODA_TEST_LONG_STEP_S",
    float,
    0.0,
    "tests only: the engine core's first step that runs requests first keeps its loop busy on the CPU for this "
    "many seconds (a legitimately long step, which the core's heartbeat must not take for a hang); 0: off",
)

# ---- read, never set by Pagoda
TRITON_INTERPRET = Env(
    "TRITON_INTERPRET",
    bool,
    False,
    "Triton's CPU interpreter: the kernels run on the CPU (tests), so GPU-only paths stay off",
    once=True,
)
OMP_NUM_THREADS = Env(
    "OMP_NUM_THREADS", int, None, "threads per engine process on the CPU when --cpu-threads is not given (OpenMP's)"
)
RAY_ADDRESS = Env("RAY_ADDRESS", str, "auto", "the Ray cluster `--distributed-executor-backend ray` joins")
CUDA_VISIBLE_DEVICES = Env("CUDA_VISIBLE_DEVICES", str, None, "which GPUs this process sees (reported by doctor)")

ALL: tuple[Env, ...] = tuple(v for v in globals().values() if isinstance(v, Env))
