"""Engine configuration: one frozen dataclass per concern, composed into `EngineConfig`.

The user-facing knobs (LLM kwargs, CLI flags) map one-to-one onto fields here. `EngineConfig.create`
resolves "auto"/None values once, with the model's own config in hand, and validates them; nothing
writes back into a config afterwards. Facts discovered at run time (number of KV blocks, EOS ids)
live in separate result objects (`worker.memory.KVCacheLayout`, `frontend.tokenizer.TokenizerInfo`).
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from pagoda import envs
from pagoda.config.knobs import knob
from pagoda.config.lora import LORA_DTYPES, LoRAConfig, resolve_lora
from pagoda.config.parallel import ParallelConfig, pipeline_parallel_error, tensor_parallel_error
from pagoda.config.quantization import QUANTIZATION_CHOICES, QuantConfig, resolve_quantization
from pagoda.errors import ConfigError
from pagoda.spec_decode.config import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")
# --kv-cache-dtype: the spellings accepted, and what each resolves to ("fp8" is e4m3, as in vLLM).
KV_CACHE_DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "fp8": "fp8", "fp8_e4m3": "fp8"}
# What a resolved --kv-cache-dtype other than "auto" stores: its name (logs, /metrics) and bytes per element.
KV_CACHE_STORAGE = {"fp8": ("fp8_e4m3", 1), "bfloat16": ("bfloat16", 2)}
# Defaults that "None"/"auto" knobs resolve to in `EngineConfig.create` (also read by `pagoda plan`).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_CPU_KV_CACHE_GIB = 4.0
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# The model without a `model` argument: the embedded GGUF (models/gguf_checkpoint.py), and its served name.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class EngineArgs:
    """The user-facing engine knobs, exactly as `LLM(...)` takes them and `--flag`s spell them.

    Each field is one knob and carries its `--flag` help (cli/args.py generates the flags from it; `LLM(**kwargs)`
    forwards here), so a new knob is one edit here, plus its field in the section that uses it (`create` copies
    same-named fields). Unresolved: None / "auto" mean "decide from the model and the hardware" in
    `EngineConfig.create`. The defaults are written here only: the resolved sections below have none.
    """

    model: str | None = knob(
        None, "HF model folder, hub id or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    )
    tokenizer: str | None = knob(None, "tokenizer folder or hub id (default: the model's)")
    dtype: str = knob("auto", "auto | float32 | float16 | bfloat16")
    max_model_len: int | None = knob(None, "context length cap (default: from the model config)")
    max_num_seqs: int = knob(256, "maximum requests per step")
    scheduling_policy: str = knob(
        "fcfs",
        "fcfs (first come, first served) | priority (a request's `priority`, lower first, ties in arrival "
        "order; the lowest-priority running request is preempted first)",
        choices=("fcfs", "priority"),
    )
    max_num_batched_tokens: int | None = knob(
        None, f"token budget per step (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS})"
    )
    max_encoder_tokens_per_step: int | None = knob(
        None,
        "most image/video placeholder tokens whose vision-encoder output one step computes; a prompt chunk "
        "stops before an item that does not fit, so running decodes are not held up by many images at once "
        "(default: no limit beyond --max-num-batched-tokens)",
    )
    block_size: int = knob(16, "tokens per KV cache block")
    enable_prefix_caching: bool = knob(True, "reuse KV blocks across requests that share a prefix")
    kv_cache_dtype: str = knob(
        "auto",
        "auto (the model dtype) | bfloat16 (on the CPU beside float32 weights: half the KV memory, attention "
        "still computed in float32) | fp8 (= fp8_e4m3: FP8 e4m3 K/V with a per-layer scale from the checkpoint's "
        "k_scale/v_scale, else 1.0; about twice the blocks in the same memory)",
    )
    gpu_memory_utilization: float | None = knob(
        None,
        f"fraction of GPU memory the engine may use (default {DEFAULT_GPU_MEMORY_UTILIZATION}; on the CPU "
        "--cpu-kv-cache-space-gib sets the KV budget instead)",
    )
    num_gpu_blocks_override: int | None = knob(None, "exact number of KV blocks (testing)")
    cpu_offload_gb: float = knob(
        0,
        "GiB of decoder-layer weights per GPU kept in pinned host memory and copied in as each layer runs (a "
        "model slightly too large for the card; every step then reads them over the host link; CUDA only)",
    )
    cpu_kv_cache_space_gib: float = knob(DEFAULT_CPU_KV_CACHE_GIB, "KV cache budget in GiB when running on the CPU")
    cpu_threads: int | None = knob(
        None,
        "threads each engine rank computes with on the CPU (default: the cores this process may run on, shared "
        "among the ranks; served, the API processes take one each for their own work)",
    )
    device: str = knob("auto", "auto | cpu | cuda")
    tensor_parallel_size: int = knob(
        1,
        "ranks (GPUs) to shard the model over: attention heads, MLP and vocabulary split N ways; gloo on the CPU",
        flags=("-tp",),
    )
    pipeline_parallel_size: int = knob(
        1,
        "pipeline stages to split the decoder layers into, each its own tensor-parallel group of ranks; "
        "activations pass stage to stage (gloo on the CPU)",
        flags=("-pp",),
    )
    distributed_executor_backend: str = knob(
        "mp",
        "how the ranks (tensor x pipeline parallel) run: mp (local processes) | ray (actors on a running Ray "
        "cluster, across machines; RAY_ADDRESS names it)",
        choices=("mp", "ray"),
    )
    seed: int = knob(0, "random seed for requests without their own seed")
    trust_remote_code: bool = knob(
        False, "accepted for vLLM compatibility: Pagoda never runs code shipped in a model folder"
    )
    skip_tokenizer_init: bool = knob(False, "do not load a tokenizer (token-id prompts only)")
    load_format: str = knob(
        "auto", "auto (the checkpoint's weights) | dummy (random weights of the right shapes, for benchmarks)"
    )
    attention_backend: str = knob(
        "auto", "auto (triton on a CUDA GPU, torch on the CPU) | torch | triton (Triton kernels, CUDA only)"
    )
    enforce_eager: bool = knob(
        False, "never capture CUDA graphs: run every decode step eagerly (slower; for debugging)"
    )
    max_cudagraph_capture_size: int | None = knob(
        None,
        "largest step replayed from a CUDA graph: decode steps of up to this many requests and mixed steps needing "
        "a graph of up to this many tokens; larger steps run eagerly, and fewer graphs are captured at startup "
        "(default: decode steps up to --max-num-seqs, mixed steps up to 2048 tokens)",
    )
    speculative_config: str | dict | None = knob(
        None,
        'speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' (prompt lookup; '
        'also prompt_lookup_min/max, disable_by_batch_size), {"method": "suffix"} (the prompt, the output and '
        "finished requests' outputs; vLLM's suffix_decoding_* keys) or "
        '{"method": "draft_model", "model": ...} (a smaller model of the same tokenizer); greedy '
        "outputs stay token for token the same",
    )
    async_scheduling: bool | None = knob(
        None,
        "schedule and launch the next step while the GPU runs the current one (default: on with CUDA, off on the "
        "CPU; a request that stops on EOS costs one discarded token)",
    )
    quantization: str | None = knob(
        None,
        "weight quantization: fp8 (FP8 e4m3 weights; a bf16/fp16 checkpoint is quantized at load) | awq | gptq | "
        "compressed-tensors | gguf (vLLM's spelling for a .gguf model, which loads as without it) (default: what the "
        "checkpoint's quantization_config says; none for unquantized)",
        flags=("-q",),
        choices=QUANTIZATION_CHOICES,
    )
    enable_lora: bool = knob(False, "serve LoRA adapters beside the base model (--lora-modules; docs/lora.md)")
    max_loras: int = knob(1, "LoRA adapters in one step (requests of others wait)")
    max_lora_rank: int = knob(16, "the largest LoRA rank an adapter may have (1-512)")
    max_cpu_loras: int | None = knob(None, "LoRA adapters kept read in host memory, LRU (default: --max-loras)")
    lora_dtype: str = knob("auto", "dtype of the adapters' weights (auto: the model's)", choices=LORA_DTYPES)
    enable_tower_connector_lora: bool = knob(
        False,
        "adapters may adapt the multimodal encoder too (Qwen2-VL's patch embedding, vision blocks and merger); its "
        "slots take GPU memory from the KV cache",
    )
    lora_target_modules: tuple[str, ...] | None = knob(
        None,
        "only these layers take adapters, by name as the checkpoint or Pagoda calls them (q_proj or qkv_proj, "
        "w1, ...); default: every adaptable layer (the others' slots take GPU memory from the KV cache)",
    )
    default_mm_loras: str | dict | None = knob(
        None,
        'an adapter for each modality, JSON \'{"image": "path/to/peft-folder"}\': a prompt with images (videos) '
        "that names no adapter runs with it; served, it is also listed under the modality's name",
    )


# The resolved sections. They have no defaults of their own: `EngineConfig.create` builds them from `EngineArgs`
# (a field named like a knob is copied from it, the others are resolved there), so every default is written once.


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    model: str  # where the model is: an HF folder (a hub id resolved to its snapshot) or a .gguf file, never None
    # What the model is called: the model argument as the user gave it (a hub id stays a hub id, as vLLM names
    # it), or the embedded default's own name when none was given. The served name unless --served-model-name.
    name: str
    tokenizer: str  # where the tokenizer comes from (defaults to `model`)
    dtype: str  # resolved torch dtype name: "float32" | "float16" | "bfloat16"
    max_model_len: int  # resolved context cap (prompt + output tokens)
    hf_config: dict[str, Any] = field(repr=False, hash=False, compare=False)  # the model's config.json
    trust_remote_code: bool
    skip_tokenizer_init: bool
    seed: int
    load_format: str
    quantization: QuantConfig | None  # resolved from the checkpoint and --quantization (None: unquantized)

    @property
    def architecture(self) -> str:
        return str((self.hf_config.get("architectures") or ["<missing>"])[0])

    @property
    def vocab_size(self) -> int:
        return int(text_field(self.hf_config, "vocab_size"))


def text_field(hf_config: dict[str, Any], key: str, default: Any = None) -> Any:
    """A language-model field of config.json, top level or nested under `text_config` (the layout
    transformers 5 writes for multimodal models)."""
    if key in hf_config:
        return hf_config[key]
    return (hf_config.get("text_config") or {}).get(key, default)


# Why a swap space other than 0 is refused (`pagoda serve --swap-space N`, `LLM(swap_space=N)`).
SWAP_SPACE_REASON = (
    "preempted requests are recomputed, not swapped to host memory (their prompt blocks stay in the prefix "
    "cache while free, so a resumed request re-reads them): there is no swap space to size"
)


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    block_size: int  # tokens per KV block
    enable_prefix_caching: bool
    kv_cache_dtype: str  # "auto" (the model dtype) | "bfloat16" (beside a float32 model) | "fp8" (e4m3)
    gpu_memory_utilization: float  # fraction of GPU memory for the whole engine
    gpu_memory_utilization_given: bool  # set by the user (on the CPU, where it does nothing, that is logged)
    num_gpu_blocks_override: int | None  # exact pool size (tests, debugging)
    cpu_kv_cache_space_gib: float  # KV budget when running on the CPU
    # Hand out freed blocks before never-used ones once this many tokens of them wait (the CPU: the pool's pages
    # become resident memory when first written, so the resident part follows the peak in use plus that reserve
    # of cached prefixes; see engine/block_manager.py). None: never-used blocks first (a GPU's pool is committed).
    freed_block_reserve_tokens: int | None
    # A prefix hit of at most this many tokens that does not continue into a run of blocks is copied into the
    # request's own blocks rather than shared (the CPU, where attention reads one run in place: see
    # engine/block_manager.py). 0: hits are always shared.
    copied_prefix_hit_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int  # requests in one step
    max_num_batched_tokens: int  # token budget of one step
    max_model_len: int  # copy of ModelConfig.max_model_len for the scheduler
    # Placeholder tokens of multimodal items a step may start encoding (None: only the token budget
    # bounds them); an item larger than this still runs, alone in its step.
    max_encoder_tokens_per_step: int | None = None
    # Step N+1 is scheduled and launched while step N runs on the GPU: each running request counts
    # its not-yet-seen token as pending, and the runner feeds it from the GPU (see llm_engine.step).
    async_scheduling: bool
    scheduling_policy: str  # "fcfs" | "priority"
    # Speculative decoding (`pagoda/spec_decode/`): proposals per request per step, verified by the model.
    speculative: SpeculativeConfig | None = None
    # Steps in flight through the pipeline stages at once, each over requests no other in-flight step
    # holds (`Scheduler`, `worker/pipeline_link.py`): pipeline_parallel_size on the CPU, else 1.
    micro_batches: int = 1
    max_loras_per_step: int = 0  # distinct LoRA adapters among running requests (max_loras; 0: adapters off)


@dataclass(frozen=True, kw_only=True)
class DeviceConfig:
    device: str  # resolved: "cpu" or "cuda"
    attention_backend: str  # resolved: "torch" or "triton"
    cuda_graphs: bool  # decode steps replay CUDA graphs (cuda + triton, not enforce_eager)
    max_cudagraph_capture_size: int | None  # the largest graph captured (rows / tokens); None: no cap
    cpu_offload_gb: float  # GiB of layer weights per GPU streamed from host memory (0: none)
    cpu_threads: int | None = None  # --cpu-threads (None: the available cores shared among the ranks)


S = TypeVar("S", bound="DataclassInstance")


def _section(cls: type[S], args: EngineArgs, **resolved: Any) -> S:
    """A section from the resolved values, its other fields copied from the same-named knobs."""
    copied = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name not in resolved}
    return cls(**copied, **resolved)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    parallel: ParallelConfig
    lora: LoRAConfig | None = None  # None: adapters off

    @classmethod
    def create(cls, args: EngineArgs | None = None, **overrides: Any) -> EngineConfig:
        """Resolve and validate every knob once. Reads the model's config (not its weights)."""
        from pagoda.models.source import resolve_model_source  # lazy: torch (config must import without it)

        a = dataclasses.replace(args or EngineArgs(), **overrides)
        _check(
            a.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            "block_size",
            f"block_size must be a power of two in [1, 128], got {a.block_size}",
        )
        _check(a.max_num_seqs >= 1, "max_num_seqs", f"max_num_seqs must be >= 1, got {a.max_num_seqs}")
        _check(
            a.max_encoder_tokens_per_step is None or a.max_encoder_tokens_per_step >= 1,
            "max_encoder_tokens_per_step",
            f"max_encoder_tokens_per_step must be >= 1, got {a.max_encoder_tokens_per_step}",
        )
        _check(
            a.max_cudagraph_capture_size is None or a.max_cudagraph_capture_size >= 1,
            "max_cudagraph_capture_size",
            f"max_cudagraph_capture_size must be >= 1, got {a.max_cudagraph_capture_size}",
        )
        utilization = resolve_gpu_memory_utilization(a.gpu_memory_utilization)
        _check(
            a.num_gpu_blocks_override is None or a.num_gpu_blocks_override >= 2,
            "num_gpu_blocks_override",
            f"num_gpu_blocks_override must be >= 2, got {a.num_gpu_blocks_override}",
        )
        _check(a.dtype in _DTYPES, "dtype", f"dtype must be one of {', '.join(_DTYPES)}; got {a.dtype!r}")
        kv_cache_dtype = resolve_kv_cache_dtype(a.kv_cache_dtype)
        _check(a.device in ("auto", "cpu", "cuda"), "device", f"device must be auto, cpu or cuda; got {a.device!r}")
        _check(
            a.load_format in ("auto", "dummy"),
            "load_format",
            f"load_format must be auto or dummy; got {a.load_format!r}",
        )
        _check(
            a.attention_backend in ("auto", "torch", "triton"),
            "attention_backend",
            f"attention_backend must be auto, torch or triton; got {a.attention_backend!r}",
        )

        _check(
            a.distributed_executor_backend in ("mp", "ray"),
            "distributed_executor_backend",
            f"distributed_executor_backend must be mp or ray; got {a.distributed_executor_backend!r}",
        )
        device = _resolve_device(a.device)
        source = resolve_model_source(a.model)
        hf_config = source.hf_config
        # Before any weight is read: sizes the model cannot split, GPUs that are not there, a missing Ray.
        _check_parallel(a, hf_config, device)
        # Before any weight is read: an unsupported quantized folder would otherwise fail half-way through loading.
        quantization = resolve_quantization(
            a.quantization, source.location, source.kind, hf_config, read_tensor_names=a.load_format != "dummy"
        )
        dtype = _resolve_dtype(a.dtype, hf_config, device)
        kv_cache_dtype = _bf16_cache_beside(kv_cache_dtype, dtype, device)

        max_model_len = resolve_max_model_len(a.max_model_len, hf_config)
        speculative = resolve_speculative(a, hf_config, device)
        max_num_batched_tokens = resolve_max_num_batched_tokens(a.max_num_batched_tokens, a.max_num_seqs)
        lora = resolve_lora(
            a.enable_lora,
            a.max_loras,
            a.max_lora_rank,
            a.max_cpu_loras,
            a.lora_dtype,
            a.enable_tower_connector_lora,
            a.default_mm_loras,
            a.lora_target_modules,
        )

        return cls(
            model=_section(
                ModelConfig,
                a,
                model=source.location,
                name=a.model if a.model is not None else DEFAULT_MODEL_NAME,
                tokenizer=a.tokenizer or source.location,
                dtype=dtype,
                max_model_len=max_model_len,
                hf_config=hf_config,
                quantization=quantization,
            ),
            cache=_section(
                CacheConfig,
                a,
                kv_cache_dtype=kv_cache_dtype,
                gpu_memory_utilization=utilization,
                gpu_memory_utilization_given=a.gpu_memory_utilization is not None,
                freed_block_reserve_tokens=(
                    max(0, min(envs.CPU_KV_RESERVE_TOKENS.value, max_model_len))
                    if device == "cpu" and envs.CPU_KV_REUSE_FIRST.value
                    else None
                ),
                # Only where a request's run is attended in place: a cache of the model's own dtype.
                copied_prefix_hit_tokens=(
                    max(0, envs.CPU_PREFIX_COPY_TOKENS.value)
                    if device == "cpu" and kv_cache_dtype == "auto" and envs.CPU_KV_IN_PLACE.value
                    else 0
                ),
            ),
            scheduler=_section(
                SchedulerConfig,
                a,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                async_scheduling=device == "cuda" if a.async_scheduling is None else a.async_scheduling,
                micro_batches=resolve_micro_batches(a.pipeline_parallel_size, device),
                speculative=speculative,
                max_loras_per_step=lora.max_loras if lora else 0,
            ),
            device=_device_config(
                device,
                a.attention_backend,
                a.enforce_eager or (lora is not None and not envs.LORA_KERNELS.value),  # the reference: eager
                a.max_cudagraph_capture_size,
                a.cpu_offload_gb,
                a.cpu_threads,
            ),
            parallel=_section(ParallelConfig, a),
            lora=lora,
        )

    @property
    def kv_cache_dtype_name(self) -> str:
        """What the KV cache holds, as logs and /metrics name it: "fp8_e4m3", "bfloat16" or the model dtype."""
        return KV_CACHE_STORAGE.get(self.cache.kv_cache_dtype, (self.model.dtype, 0))[0]

    def replace_cache(self, **changes: Any) -> EngineConfig:
        """A new config with some cache fields changed (the original stays frozen)."""
        return dataclasses.replace(self, cache=dataclasses.replace(self.cache, **changes))


def resolve_speculative(a: EngineArgs, hf_config: dict[str, Any], device: str = "cpu") -> SpeculativeConfig | None:
    """The parsed --speculative-config, refused in one line where this version cannot verify proposals."""
    spec = parse_speculative_config(a.speculative_config)
    if spec is None:
        return None
    if spec.draft_model is not None:
        _check_draft_model(spec.draft_model, hf_config)
    if a.pipeline_parallel_size > 1:
        raise ConfigError(
            "--speculative-config is not supported with pipeline parallelism (its micro-batches would each need "
            "their own proposals) yet.",
            "speculative_config",
        )
    return spec


def _check_draft_model(draft: str, hf_config: dict[str, Any]) -> None:
    """A draft model must share the target's vocabulary. A draft that cannot be read is named as the draft, so
    that the line does not read as the target's."""
    param = "speculative_config"
    from pagoda.models.source import resolve_model_source  # lazy: torch (config must import without it)

    try:
        draft_config = resolve_model_source(draft).hf_config
    except ConfigError as exc:  # ModelLoadError included: the same class, the setting it came from first
        raise type(exc)(f"--speculative-config draft model: {exc.message}", param) from None
    theirs, ours = _vocab_size(draft_config), _vocab_size(hf_config)
    if theirs != ours:
        raise ConfigError(
            f"--speculative-config draft model {draft!r} has a vocabulary of {theirs} tokens, the target {ours}: "
            "a draft must use the target's tokenizer.",
            param,
        )


def _vocab_size(hf_config: dict[str, Any]) -> int | None:
    text = hf_config.get("text_config")
    return hf_config.get("vocab_size") or (text.get("vocab_size") if isinstance(text, dict) else None)


# The resolvers of the knobs whose value needs no hardware: `EngineConfig.create` and `pagoda plan` share them.
def resolve_micro_batches(pipeline_parallel_size: int, device: str) -> int:
    """One micro-batch per pipeline stage on the CPU (gloo), so that the stages compute at once. On CUDA
    one: several have not been measured on two GPUs yet. PAGODA_PP_MICRO_BATCHES=0 keeps one anywhere."""
    if device != "cpu" or not envs.PP_MICRO_BATCHES.value:
        return 1
    return pipeline_parallel_size


def resolve_gpu_memory_utilization(requested: float | None) -> float:
    utilization = DEFAULT_GPU_MEMORY_UTILIZATION if requested is None else requested
    _check(
        0 < utilization <= 1,
        "gpu_memory_utilization",
        f"gpu_memory_utilization must be in (0, 1], got {utilization}",
    )
    return utilization


def resolve_max_model_len(requested: int | None, hf_config: dict[str, Any]) -> int:
    """--max-model-len, or the model's own context (config.json); never more than that."""
    derived_len = derived_max_model_len(hf_config)
    max_model_len = derived_len if requested is None else requested
    _check(max_model_len >= 1, "max_model_len", f"max_model_len must be >= 1, got {max_model_len}")
    if max_model_len > derived_len:
        raise ConfigError(
            f"max_model_len={max_model_len} is larger than the model's maximum context "
            f"({derived_len} from config.json); lower --max-model-len.",
            "max_model_len",
        )
    return max_model_len


def resolve_max_num_batched_tokens(requested: int | None, max_num_seqs: int) -> int:
    """--max-num-batched-tokens, or the default budget (at least one token per sequence of a step)."""
    tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs) if requested is None else requested
    _check(tokens >= 1, "max_num_batched_tokens", f"max_num_batched_tokens must be >= 1, got {tokens}")
    return tokens


def _bf16_cache_beside(kv_cache_dtype: str, dtype: str, device: str) -> str:
    """A bfloat16 cache is a CPU choice beside float32 weights (the PyTorch attention widens what it reads);
    beside bfloat16 weights it is the model's own cache ("auto")."""
    if kv_cache_dtype != "bfloat16":
        return kv_cache_dtype
    if dtype == "bfloat16":
        return "auto"
    if device != "cpu":
        raise ConfigError(
            f"--kv-cache-dtype bfloat16 beside --dtype {dtype} is for the CPU; on a GPU serve --dtype bfloat16 "
            "(its cache is bfloat16 then) or use --kv-cache-dtype fp8.",
            "kv_cache_dtype",
        )
    return kv_cache_dtype


def resolve_kv_cache_dtype(choice: str) -> str:
    """--kv-cache-dtype → "auto" | "fp8", or a one-line refusal naming the choices (also `pagoda plan`'s)."""
    resolved = KV_CACHE_DTYPES.get(choice)
    if resolved is not None:
        return resolved
    if choice == "fp8_e5m2":
        message = "kv_cache_dtype fp8_e5m2 is not supported; use fp8 (e4m3)"
    else:
        message = f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {choice!r}"
    raise ConfigError(message, "kv_cache_dtype")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ConfigError(message, param)


def _check_parallel(a: EngineArgs, hf_config: dict[str, Any], device: str) -> None:
    problem = tensor_parallel_error(hf_config, a.tensor_parallel_size)
    if problem is not None:
        raise ConfigError(problem, "tensor_parallel_size")
    problem = pipeline_parallel_error(hf_config, a.pipeline_parallel_size)
    if problem is not None:
        raise ConfigError(problem, "pipeline_parallel_size")
    n = a.tensor_parallel_size * a.pipeline_parallel_size
    if n == 1:
        return
    if a.distributed_executor_backend == "ray":
        try:
            import ray  # lazy: optional (ray)  # noqa: F401
        except ImportError:
            raise ConfigError(
                "--distributed-executor-backend ray needs the ray package (pip install 'pagoda[ray]'), and a "
                "running Ray cluster (ray start --head).",
                "distributed_executor_backend",
            ) from None
        return  # Ray counts the cluster's GPUs when it places the ranks
    if device == "cuda":
        import torch  # lazy: torch (pagoda plan and the HTTP tools import config without it)

        gpus = gpu_count_problem(a.tensor_parallel_size, a.pipeline_parallel_size, torch.cuda.device_count())
        if gpus is not None:
            raise ConfigError(f"{gpus[0]}; {gpus[1]}.", "tensor_parallel_size")


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if _cuda_available() else "cpu"
    if device == "cuda" and not _cuda_available():
        raise ConfigError("device='cuda' was requested but no CUDA GPU is visible; use --device cpu.", "device")
    return device


def _cuda_available() -> bool:
    # Without the driver's library no GPU can be visible, whatever torch was built with: answered without
    # importing torch, so that `pagoda serve`'s launcher and API processes on a CPU machine never load it.
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    import torch  # lazy: torch (pagoda plan and the HTTP tools import config without it)

    return torch.cuda.is_available()


def _device_config(
    device: str,
    attention_backend: str,
    enforce_eager: bool,
    max_cudagraph_capture_size: int | None,
    cpu_offload_gb: float,
    cpu_threads: int | None = None,
) -> DeviceConfig:
    backend = _resolve_attention_backend(attention_backend, device)
    if cpu_threads is not None and cpu_threads < 1:
        raise ConfigError(f"cpu_threads must be >= 1, got {cpu_threads}", "cpu_threads")
    if cpu_offload_gb < 0:
        raise ConfigError(f"cpu_offload_gb must be >= 0, got {cpu_offload_gb}", "cpu_offload_gb")
    if cpu_offload_gb and device != "cuda":
        raise ConfigError(
            "--cpu-offload-gb moves weights from a GPU to host memory; on the CPU they are there already: drop it.",
            "cpu_offload_gb",
        )
    # Graph capture needs a backend whose per-layer work has fixed shapes and no host syncs: the
    # Triton kernels (the PyTorch backend gathers a per-step number of blocks). With offloaded weights a
    # step is bound by their copies, not its launches: eager (models/weight_offload.py).
    return DeviceConfig(
        device=device,
        attention_backend=backend,
        cuda_graphs=device == "cuda" and backend == "triton" and not enforce_eager and not cpu_offload_gb,
        max_cudagraph_capture_size=max_cudagraph_capture_size,
        cpu_offload_gb=cpu_offload_gb,
        cpu_threads=cpu_threads,
    )


def _resolve_attention_backend(choice: str, device: str) -> str:
    # "auto": the Triton kernels on a CUDA GPU (faster than the PyTorch backend at every batch size:
    # benchmarks/h200.py's decode row), the PyTorch one elsewhere.
    if choice == "torch":
        return "torch"
    if choice == "auto":
        if device != "cuda":
            return "torch"
        try:
            import triton  # lazy: optional (triton)  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    if device != "cuda" and not envs.TRITON_INTERPRET.value:  # the interpreter runs on CPU (tests)
        raise ConfigError(
            "attention_backend='triton' needs a CUDA GPU; use --attention-backend torch on the CPU.",
            "attention_backend",
        )
    try:
        import triton  # lazy: optional (triton)  # noqa: F401
    except ImportError:
        raise ConfigError(
            "attention_backend='triton' needs the triton package (pip install triton).", "attention_backend"
        ) from None
    return "triton"


def auto_dtype(hf_config: dict[str, Any], device: str) -> str:
    """What --dtype auto loads on `device` ("cpu" or "cuda"): float32 on the CPU, else the checkpoint's half type
    (bfloat16 when it names none)."""
    if device == "cpu":
        # Half-precision matmuls are slow on most CPUs; float32 is both fast and exact.
        return "float32"
    config_dtype = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16").replace("torch.", "")
    return config_dtype if config_dtype in ("float16", "bfloat16") else "bfloat16"


def _resolve_dtype(dtype: str, hf_config: dict[str, Any], device: str) -> str:
    aliases = {"half": "float16", "float": "float32"}
    dtype = aliases.get(dtype, dtype)
    if dtype == "auto":
        dtype = auto_dtype(hf_config, device)
    if dtype == "bfloat16" and device == "cuda" and not _cuda_bf16():
        raise ConfigError("This GPU does not support bfloat16; use --dtype float16.", "dtype")
    return dtype


def _cuda_bf16() -> bool:
    import torch  # lazy: torch (pagoda plan and the HTTP tools import config without it)

    return torch.cuda.is_bf16_supported()


def derived_max_model_len(hf_config: dict[str, Any]) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        value = text_field(hf_config, key)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def gpu_count_problem(tensor_parallel_size: int, pipeline_parallel_size: int, visible: int) -> tuple[str, str] | None:
    """(what is wrong, the fix) when the tp x pp ranks (one GPU each) outnumber the `visible` GPUs, else None:
    serve's refusal and `pagoda doctor`'s gpus line, in the same words."""
    n = tensor_parallel_size * pipeline_parallel_size
    if visible >= n:
        return None
    shown = envs.CUDA_VISIBLE_DEVICES.value
    where = f"CUDA_VISIBLE_DEVICES={shown}" if shown is not None else "CUDA_VISIBLE_DEVICES is not set"
    sizes = f"--tensor-parallel-size {tensor_parallel_size}"
    if pipeline_parallel_size > 1:
        sizes += f" x --pipeline-parallel-size {pipeline_parallel_size}"
    what = f"{sizes} needs {n} GPUs but {visible} {'is' if visible == 1 else 'are'} visible ({where})"
    return what, "lower the parallel sizes or expose more GPUs"
