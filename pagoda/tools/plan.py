"""`pagoda plan`: the memory arithmetic of a deployment, from config.json alone.

The model is built on PyTorch's meta device (no weights, no memory), so parameter counts are exact
for our implementation, and the KV-cache shape comes from `worker.memory.kv_cache_spec` — the very
function the engine sizes its cache with. On the CPU the block count is `memory.cpu_num_blocks`,
identical to the engine's; on a GPU the engine profiles one worst-case step, which the planner
estimates (weights + activations of one `max_num_batched_tokens` step + sampler logits + a fixed
CUDA-context allowance), so the engine logs the planner's prediction next to what it allocated.
`--kv-cache-dtype fp8` counts the cache at 1 byte per element (Yuan2's LF state stays in the model
dtype: it is not KV cache). The valid tensor-parallel sizes and the reasons against the requested one come from
`config.parallel`, the rule `pagoda serve` refuses by.

With pipeline stages each stage is planned on its own meta model (`Plan.stages`, also `pagoda doctor`'s pipeline
line through `pipeline_stages`); the fullest stage's GPU sizes the cache. `--cpu-offload-gb G` moves the layers
serve would move (`models.weight_offload.choose_layers`) out of the GPU's weights, less the two staging slots that
stay; `--enable-lora` adds the slots the runner's own `attach_lora` allocates (on the meta model, as tensor-parallel
rank 0 holds it) to what the GPU holds before the cache is sized (on the CPU the KV budget is its own).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from pagoda.config import KV_CACHE_DTYPES, KV_CACHE_STORAGE, EngineArgs, resolve_kv_cache_dtype, text_field
from pagoda.config.engine import (
    _device_config,
    resolve_gpu_memory_utilization,
    resolve_max_model_len,
    resolve_max_num_batched_tokens,
)
from pagoda.config.lora import LoRAConfig, resolve_lora
from pagoda.config.parallel import (
    pipeline_parallel_error,
    tensor_parallel_error,
    tensor_parallel_problems,
    valid_tensor_parallel_sizes,
)
from pagoda.config.quantization import QUANTIZATION_CHOICES, QuantConfig, resolve_quantization
from pagoda.distributed.stages import stage_layer_range
from pagoda.errors import ConfigError
from pagoda.worker import memory

GiB = memory.GiB
# The engine's knobs keep the engine's defaults here: `pagoda plan` plans what `pagoda serve` would run.
ENGINE_DEFAULTS = EngineArgs()
# Memory torch reports as total on each GPU (GiB), for --gpu presets.
GPU_MEMORY_GIB = {
    "h200": 139.8,
    "h100": 79.2,
    "h100-80g": 79.2,
    "a100-80g": 79.2,
    "a100-40g": 39.4,
    "l40s": 44.4,
    "a10g": 22.0,
    "l4": 22.0,
    "4090": 23.6,
    "3090": 23.6,
}
CUDA_CONTEXT_BYTES = GiB // 2  # memory held outside PyTorch's allocator (context, cuBLAS workspaces)
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class Plan:
    architecture: str
    dtype: str
    tensor_parallel_size: int
    device: str
    memory_bytes_per_gpu: int
    gpu_memory_utilization: float
    max_model_len: int
    block_size: int
    max_num_batched_tokens: int
    weights_bytes_total: int
    weights_bytes_per_gpu: int
    kv_bytes_per_token: int  # whole model (all layers, all KV heads)
    kv_bytes_per_token_per_gpu: int
    state_bytes_per_sequence: int  # Yuan2 LF state (all layers), 0 for other models
    activation_bytes_estimate: int
    kv_blocks: int  # usable blocks per GPU (the null block excluded)
    kv_tokens: int
    max_concurrency: float  # requests of max_model_len tokens that fit at once
    typical_len: int
    concurrency_at_typical_len: float
    recommended_max_num_seqs: int | None  # None: the model leaves no room for a KV cache (does not fit)
    fits_one_max_len_request: bool
    valid_tensor_parallel_sizes: list[int]  # every size up to the attention head count (config/parallel.py)
    tensor_parallel_problems: list[str]  # why tensor_parallel_size does not fit ([] when it does)
    image_tokens: int | None = None  # placeholder tokens per image (Qwen2-VL), at --image
    image_tokens_per_request: int | None = None
    notes: list[str] = field(default_factory=list)
    quantization: str = "none"  # the weights' quantization (QuantConfig.describe()), "none" when unquantized
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "bfloat16" (2 bytes) | "fp8" (e4m3: 1 byte per element)
    pipeline_parallel_size: int = 1
    # Per pipeline stage (one entry without pp), `pipeline_stages`: its decoder layers first_layer..last_layer,
    # and per GPU its resident weight bytes, its weight bytes in host memory (--cpu-offload-gb), its LoRA
    # slots' bytes and its layers' KV bytes per token.
    stages: list[dict[str, int]] = field(default_factory=list)
    cpu_offload_gb: float = 0.0
    offloaded_bytes_per_gpu: int = 0  # the fullest stage's decoder-layer weights in host memory (not counted above)
    max_loras: int = 0  # 0: LoRA off
    max_lora_rank: int = 0
    lora_bytes_per_gpu: int = 0  # the fullest stage's LoRA slots, allocated before the KV cache is sized


def _meta_model(
    hf_config: dict[str, Any], max_model_len: int, stage: int = 0, pipeline_size: int = 1, tp: int = 1
) -> Any:
    """The model on the meta device: pipeline `stage`'s layers only (all of them at pipeline_size 1), as
    tensor-parallel rank 0 of `tp` holds them (the whole layers at tp 1)."""
    import torch  # lazy: torch (`pagoda plan` runs without it)

    from pagoda.distributed import parallel_state  # lazy: torch (`pagoda plan` runs without it)
    from pagoda.models.registry import get_model_class  # lazy: torch (`pagoda plan` runs without it)

    architecture = (hf_config.get("architectures") or ["<missing>"])[0]
    parallel_state.assume_rank(0, tp, stage, pipeline_size)
    try:
        with torch.device("meta"):
            return get_model_class(architecture)(hf_config, max_model_len)
    finally:
        parallel_state.assume_rank(0, 1)


def _stage_ranges(hf_config: dict[str, Any], pipeline_size: int) -> list[range]:
    layers = int(text_field(hf_config, "num_hidden_layers"))
    return [stage_layer_range(layers, s, pipeline_size) for s in range(pipeline_size)]


def _stage_footprint(
    hf_config: dict[str, Any],
    max_model_len: int,
    stage: int,
    pipeline_size: int,
    quantization: QuantConfig | None,
    dtype_bytes: int,
    tp: int,
) -> tuple[Any, int, int]:
    """(meta model, weight bytes, weight bytes per GPU) of one pipeline stage, quantized as it would be held."""
    model = _meta_model(hf_config, max_model_len, stage, pipeline_size)
    if quantization is not None:
        import torch  # lazy: torch (`pagoda plan` runs without it)

        from pagoda.layers.quantization import process_after_loading, quantize_linear_layers

        try:
            quantize_linear_layers(model, quantization, torch.float32, torch.device("meta"))
        except ValueError as exc:  # as the loader refuses it: a projection the format cannot hold
            raise ConfigError(f"{quantization.describe()}: {exc}", "quantization") from None
        if quantization.method == "fp8" and not quantization.serialized:
            process_after_loading(model)  # fp8 at load: the weights as they will be held (meta: no work)
    return (model, *_weights_bytes(model.named_parameters(), dtype_bytes, tp))


def _weights_bytes(named_parameters: Iterable[tuple[str, Any]], dtype_bytes: int, tp: int) -> tuple[int, int]:
    """(total, per GPU) of these parameters (by their names in the model). Per GPU: everything split tp ways
    except what the scheme replicates (norms, biases, Yuan's LF convolutions (docs/models.md, Yuan2: tensor
    parallelism), the small router, Qwen2-VL's vision tower). Floating-point parameters count in the model
    dtype; quantized ones (fp8, packed int4) at their size."""
    total = replicated = 0
    seen = set()
    for name, param in named_parameters:
        if id(param) in seen:  # tied embeddings count once
            continue
        seen.add(id(param))
        quantized = not param.is_floating_point() or param.element_size() == 1  # int32-packed, fp8
        size = param.numel() * (param.element_size() if quantized else dtype_bytes)
        total += size
        if param.dim() < 2 or ".lf_gate." in name or ".mlp.gate." in name or name.startswith("visual."):
            replicated += size
    return total, replicated + (total - replicated) // tp


def _offload(layer_bytes: list[int], cpu_offload_gb: float) -> tuple[int, int]:
    """(bytes moved to host memory, bytes of the GPU staging slots) of one GPU's decoder layers (their bytes
    per GPU, in order) under --cpu-offload-gb: serve's own choice of layers (`models/weight_offload.py`), whose
    parameters then alias two GPU slots of one layer's size (one when a single layer moved)."""
    from pagoda.models.weight_offload import choose_layers  # lazy: torch (`pagoda plan` runs without it)

    chosen = choose_layers(layer_bytes, int(cpu_offload_gb * GiB))
    if not chosen:
        return 0, 0
    return sum(layer_bytes[i] for i in chosen), min(len(chosen), 2) * layer_bytes[chosen[0]]


def _lora_bytes(
    hf_config: dict[str, Any],
    max_model_len: int,
    stage: int,
    pipeline_size: int,
    tp: int,
    lora: LoRAConfig,
    dtype: str,
    max_tokens: int,
) -> int:
    """Bytes per GPU of the LoRA slots the runner allocates on one stage's GPU (`LoRAManager`), by the runner's
    own `attach_lora` on the stage's meta model as tensor-parallel rank 0 holds it (an invalid tp: the whole
    layers' slots split evenly, as the other per-GPU numbers assume)."""
    import torch  # lazy: torch (`pagoda plan` runs without it)

    from pagoda.lora.layers import LoRAStep  # lazy: torch (`pagoda plan` runs without it)
    from pagoda.lora.manager import attach_lora

    ranks = 1 if tensor_parallel_problems(hf_config, tp) else tp
    model = _meta_model(hf_config, max_model_len, stage, pipeline_size, ranks)
    slots, _ = attach_lora(model, lora, getattr(torch, dtype), torch.device("meta"), max_tokens)
    if not slots:
        return 0
    tensors = [t for slot in slots.values() for t in (slot.a, slot.b, slot.bounds)]
    # The step's token mapping, shared by the decoder's layers (an encoder's is sized per call, and small).
    tensors += {id(s.step): s.step.meta for s in slots.values() if isinstance(s.step, LoRAStep)}.values()
    return sum(t.numel() * t.element_size() for t in tensors) * ranks // tp


@dataclass
class _Footprint:
    spec: memory.KVCacheSpec  # stage 0's cache shape over every decoder layer: the whole model's KV per token
    gpu_spec: memory.KVCacheSpec  # stage 0's cache per GPU: KV heads split (or replicated) tp ways
    weights_total: int
    stages: list[dict[str, int]]
    fullest: dict[str, int]  # the stage whose GPU holds the most weights and LoRA slots


def _footprint(
    hf_config: dict[str, Any],
    *,
    tp: int,
    pp: int,
    max_model_len: int,
    dtype: str,
    quantization: QuantConfig | None,
    cache_dtype_bytes: int,
    enable_prefix_caching: bool,
    cpu_offload_gb: float,
    lora: LoRAConfig | None,
    lora_tokens: int,
) -> _Footprint:
    """What each pipeline stage's GPUs hold (the knobs resolved by the caller)."""
    dtype_bytes = _DTYPE_BYTES[dtype]
    problem = pipeline_parallel_error(hf_config, pp)
    if problem is not None:
        raise ConfigError(problem, "pipeline_parallel_size")
    built = [_stage_footprint(hf_config, max_model_len, s, pp, quantization, dtype_bytes, tp) for s in range(pp)]
    # Stage 0 holds the most layers: its KV spec sizes every stage's pool, as in the engine.
    spec = memory.kv_cache_spec(built[0][0], dtype_bytes, enable_prefix_caching, cache_dtype_bytes)
    # Per GPU, KV heads split tp ways, or are replicated when there are fewer KV heads than GPUs: each GPU then
    # holds one whole KV head, its cache and its rows of the K/V projections (per layer: kv_extra more bytes).
    kv_heads_per_gpu = max(1, spec.num_kv_heads // tp)
    kv_extra = 0
    if spec.num_kv_heads < tp:
        layer_kv = 2 * spec.num_kv_heads * spec.head_dim * int(text_field(hf_config, "hidden_size")) * dtype_bytes
        kv_extra = layer_kv // spec.num_kv_heads - layer_kv // tp
    gpu_spec = memory.KVCacheSpec(
        spec.num_layers,
        kv_heads_per_gpu,
        spec.head_dim,
        spec.dtype_bytes,
        spec.state_bytes_per_seq,
        spec.snapshot_bytes_per_block,
    )
    stages = []
    for s, (r, (model, _, gpu)) in enumerate(zip(_stage_ranges(hf_config, pp), built, strict=True)):
        moved = staging = 0
        if cpu_offload_gb:  # this GPU's bytes of each of the stage's decoder layers, as serve measures them
            layer_bytes = [
                _weights_bytes(((f"model.layers.{i}.{n}", p) for n, p in layer.named_parameters()), dtype_bytes, tp)[1]
                + kv_extra
                for i, layer in zip(r, model.stage.own(model.model.layers), strict=True)
            ]
            moved, staging = _offload(layer_bytes, cpu_offload_gb)
        lora_bytes = (
            _lora_bytes(hf_config, max_model_len, s, pp, tp, lora, dtype, lora_tokens) if lora is not None else 0
        )
        stages.append(
            {
                "first_layer": r.start,
                "last_layer": r.stop - 1,
                "weights_bytes_per_gpu": gpu + len(r) * kv_extra - moved + staging,
                "offloaded_bytes_per_gpu": moved,
                "lora_bytes_per_gpu": lora_bytes,
                # its layers' K and V, split (or replicated) over the stage's GPUs as for the whole model
                "kv_bytes_per_token_per_gpu": gpu_spec.bytes_per_token() * len(r) // max(spec.num_layers, 1),
            }
        )
    if pp > 1:  # the whole model's K and V per token: every stage's layers
        spec = dataclasses.replace(spec, num_layers=int(text_field(hf_config, "num_hidden_layers")))
    fullest = max(stages, key=lambda st: st["weights_bytes_per_gpu"] + st["lora_bytes_per_gpu"])
    return _Footprint(spec, gpu_spec, sum(total for _, total, _ in built), stages, fullest)


def pipeline_stages(
    hf_config: dict[str, Any],
    *,
    tensor_parallel_size: int = ENGINE_DEFAULTS.tensor_parallel_size,
    pipeline_parallel_size: int = ENGINE_DEFAULTS.pipeline_parallel_size,
    dtype: str = "bfloat16",
    quantization: QuantConfig | None = None,
    kv_cache_dtype: str = ENGINE_DEFAULTS.kv_cache_dtype,
) -> list[dict[str, int]]:
    """`Plan.stages` for these knobs (the others at serve's defaults): `pagoda doctor`'s pipeline line."""
    return make_plan(
        hf_config,
        device="cpu",  # the stages do not depend on the device's memory
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    ).stages


def describe_stage(stage: dict[str, int]) -> str:
    """One stage of `Plan.stages` in words (plan's and doctor's pipeline lines)."""
    text = f"layers {stage['first_layer']}-{stage['last_layer']}, {_size(stage['weights_bytes_per_gpu'])} of weights"
    if stage.get("offloaded_bytes_per_gpu"):
        text += f" (+ {_size(stage['offloaded_bytes_per_gpu'])} in host memory)"
    if stage.get("lora_bytes_per_gpu"):
        text += f", {_size(stage['lora_bytes_per_gpu'])} of LoRA slots"
    return text + f" and {_size(stage['kv_bytes_per_token_per_gpu'])} of KV per token per GPU"


def activation_bytes_estimate(
    hf_config: dict[str, Any], max_num_batched_tokens: int, max_num_seqs: int, dtype_bytes: int
) -> int:
    """One worst-case step: a few [T, hidden] buffers, the fused MLP input [T, 2I], and float32 logits
    (twice: sampler copies) for the sampled rows."""
    hidden = int(text_field(hf_config, "hidden_size"))
    intermediate = int(text_field(hf_config, "intermediate_size") or 4 * hidden)
    vocab = int(text_field(hf_config, "vocab_size"))
    per_token = (6 * hidden + 3 * intermediate) * dtype_bytes
    return max_num_batched_tokens * per_token + 2 * min(max_num_seqs, max_num_batched_tokens) * vocab * 4


def image_tokens(
    hf_config: dict[str, Any],
    model_folder: str | None,
    width: int,
    height: int,
    min_pixels: int | None,
    max_pixels: int | None,
) -> int | None:
    """Placeholder tokens of one image (Qwen2-VL), by the checkpoint's preprocessing rules."""
    if hf_config.get("vision_config") is None:
        return None
    from pagoda.frontend.multimodal.image_processor import VisionPreprocessConfig, smart_resize  # lazy: PIL, numpy

    cfg = VisionPreprocessConfig.from_model_folder(model_folder)
    lo, hi = min_pixels or cfg.min_pixels, max_pixels or cfg.max_pixels
    h, w = smart_resize(height, width, cfg.patch_size * cfg.merge_size, lo, hi)
    return (h // (cfg.patch_size * cfg.merge_size)) * (w // (cfg.patch_size * cfg.merge_size))


def make_plan(
    hf_config: dict[str, Any],
    *,
    model_folder: str | None = None,
    device: str = "cuda",
    memory_bytes_per_gpu: int | None = None,
    gpu_memory_utilization: float | None = ENGINE_DEFAULTS.gpu_memory_utilization,
    tensor_parallel_size: int = ENGINE_DEFAULTS.tensor_parallel_size,
    pipeline_parallel_size: int = ENGINE_DEFAULTS.pipeline_parallel_size,
    max_model_len: int | None = ENGINE_DEFAULTS.max_model_len,
    dtype: str = "bfloat16",
    block_size: int = ENGINE_DEFAULTS.block_size,
    max_num_seqs: int = ENGINE_DEFAULTS.max_num_seqs,
    max_num_batched_tokens: int | None = ENGINE_DEFAULTS.max_num_batched_tokens,
    enable_prefix_caching: bool = ENGINE_DEFAULTS.enable_prefix_caching,
    cpu_kv_cache_space_gib: float = ENGINE_DEFAULTS.cpu_kv_cache_space_gib,
    typical_len: int | None = None,
    image: tuple[int, int] | None = None,
    images_per_request: int = 1,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    quantization: QuantConfig | None = None,
    kv_cache_dtype: str = ENGINE_DEFAULTS.kv_cache_dtype,
    cpu_offload_gb: float = ENGINE_DEFAULTS.cpu_offload_gb,
    lora: LoRAConfig | None = None,
) -> Plan:
    """The plan for these knobs, resolved as `EngineConfig.create` resolves them (the same refusals).
    `lora`: `config.lora.resolve_lora`'s, as serve resolves --enable-lora (None: LoRA off)."""
    if dtype not in _DTYPE_BYTES:
        raise ConfigError(f"dtype must be one of {', '.join(_DTYPE_BYTES)}; got {dtype!r}", "dtype")
    dtype_bytes = _DTYPE_BYTES[dtype]
    kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype)
    cache_dtype_bytes = KV_CACHE_STORAGE[kv_cache_dtype][1] if kv_cache_dtype in KV_CACHE_STORAGE else dtype_bytes
    max_model_len = resolve_max_model_len(max_model_len, hf_config)
    gpu_memory_utilization = resolve_gpu_memory_utilization(gpu_memory_utilization)
    # serve's own check of --cpu-offload-gb (negative, or on the CPU: the same one-line refusal)
    _device_config(device, "torch", True, None, cpu_offload_gb)
    tp = tensor_parallel_size
    if tp < 1:  # no per-GPU numbers to give
        raise ConfigError(tensor_parallel_error(hf_config, tp) or "", "tensor_parallel_size")
    max_num_batched_tokens = resolve_max_num_batched_tokens(max_num_batched_tokens, max_num_seqs)
    pp = pipeline_parallel_size
    # Each pipeline stage's GPUs hold its layers: the plan is the fullest GPU's (the most weights and LoRA slots).
    footprint = _footprint(
        hf_config,
        tp=tp,
        pp=pp,
        max_model_len=max_model_len,
        dtype=dtype,
        quantization=quantization,
        cache_dtype_bytes=cache_dtype_bytes,
        enable_prefix_caching=enable_prefix_caching,
        cpu_offload_gb=cpu_offload_gb,
        lora=lora,
        # The most tokens one step carries (`LoRAManager`: the budget and one per sequence; no speculation here).
        lora_tokens=max_num_batched_tokens + max_num_seqs,
    )
    spec, gpu_spec, fullest = footprint.spec, footprint.gpu_spec, footprint.fullest
    weights_gpu, lora_gpu = fullest["weights_bytes_per_gpu"], fullest["lora_bytes_per_gpu"]
    problems = tensor_parallel_problems(hf_config, tp)
    notes = []
    if problems:
        notes.append(f"{tensor_parallel_error(hf_config, tp)} The per-GPU numbers assume an even split.")
    activations = activation_bytes_estimate(hf_config, max_num_batched_tokens, max_num_seqs, dtype_bytes)
    if device == "cpu":
        memory_bytes_per_gpu = memory_bytes_per_gpu or int(cpu_kv_cache_space_gib * GiB)
        num_blocks = memory.cpu_num_blocks(cpu_kv_cache_space_gib, gpu_spec, block_size, max_num_seqs, max_model_len)
    else:
        if memory_bytes_per_gpu is None:
            raise ConfigError("Give --gpu NAME or --gpu-memory-gib X (or --device cpu).", "gpu")
        # What the engine's profile holds when it sizes the cache: the resident weights (offloaded ones have
        # moved out), the LoRA slots, one worst-case step and the state slots.
        peak = weights_gpu + lora_gpu + activations + gpu_spec.state_pool_bytes(max_num_seqs)
        num_blocks = memory.gpu_num_blocks(
            memory_bytes_per_gpu, gpu_memory_utilization, peak, CUDA_CONTEXT_BYTES, gpu_spec, block_size
        )
    usable = max(num_blocks - 1, 0)
    layout = memory.KVCacheLayout(max(num_blocks, 1), block_size, memory.bytes_per_block(gpu_spec, block_size))
    typical_len = min(typical_len or min(max_model_len, 2048), max_model_len)
    at_typical = layout.max_concurrency(typical_len)
    target = int(0.8 * at_typical)
    recommended = min(1024, target // 8 * 8 if target >= 8 else max(target, 1))
    fits = num_blocks >= memory.blocks_for_request(max_model_len, block_size)
    if not usable and device == "cpu":
        notes.append(f"a KV budget of {_size(memory_bytes_per_gpu)} holds no block: raise --cpu-kv-cache-space-gib")
    elif not usable:
        gpus = "one GPU" if tp * pp == 1 else f"{tp * pp} GPUs"
        notes.append(
            f"the model does not fit on {gpus}: {_size(weights_gpu)} of weights per GPU leave no room for a KV "
            f"cache in {_size(memory_bytes_per_gpu)} x {gpu_memory_utilization}; use more GPUs (--tp, --pp), "
            "quantized weights (-q fp8), --cpu-offload-gb or a larger GPU"
        )
    elif not fits:
        notes.append(
            f"one {max_model_len}-token request does not fit: lower --max-model-len, raise "
            "--gpu-memory-utilization or use more GPUs"
        )
    per_image = per_request = None
    if image is not None:
        per_image = image_tokens(hf_config, model_folder, image[0], image[1], min_pixels, max_pixels)
        if per_image is None:
            notes.append("this model takes no images; --image ignored")
        else:
            per_request = (per_image + 2) * images_per_request  # + <|vision_start|> <|vision_end|>
            if per_request >= max_model_len:
                notes.append(
                    f"{images_per_request} image(s) of {image[0]}x{image[1]} take {per_request} tokens, "
                    f"more than max_model_len {max_model_len}: lower max_pixels"
                )
    architecture = (hf_config.get("architectures") or ["<missing>"])[0]
    return Plan(
        architecture,
        dtype,
        tp,
        device,
        int(memory_bytes_per_gpu),
        gpu_memory_utilization,
        max_model_len,
        block_size,
        max_num_batched_tokens,
        footprint.weights_total,
        weights_gpu,
        spec.bytes_per_token(),
        gpu_spec.bytes_per_token(),
        spec.state_bytes_per_seq,
        activations,
        usable,
        usable * block_size,
        layout.max_concurrency(max_model_len) if usable else 0.0,
        typical_len,
        at_typical if usable else 0.0,
        recommended if usable else None,
        fits,
        valid_tensor_parallel_sizes(hf_config),
        problems,
        per_image,
        per_request,
        notes,
        quantization.describe() if quantization is not None else "none",
        kv_cache_dtype,
        pp,
        footprint.stages,
        cpu_offload_gb,
        fullest["offloaded_bytes_per_gpu"],
        lora.max_loras if lora is not None else 0,
        lora.max_lora_rank if lora is not None else 0,
        lora_gpu,
    )


def _size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_plan(plan: Plan) -> str:
    where = (
        f"CPU, KV budget {_size(plan.memory_bytes_per_gpu)}"
        if plan.device == "cpu"
        else f"{_size(plan.memory_bytes_per_gpu)} per GPU x {plan.gpu_memory_utilization}"
    )
    pp = f", pp={plan.pipeline_parallel_size}" if plan.pipeline_parallel_size > 1 else ""
    fullest = " (the fullest stage)" if pp else ""
    asides = ["the fullest stage"] if pp else []
    if plan.offloaded_bytes_per_gpu:
        asides.append(
            f"{_size(plan.offloaded_bytes_per_gpu)} more in host memory: --cpu-offload-gb {plan.cpu_offload_gb:g}"
        )
    lines = [
        f"{plan.architecture}, {plan.dtype}, tp={plan.tensor_parallel_size}{pp}, {where}",
        f"weights: {_size(plan.weights_bytes_total)} total, {_size(plan.weights_bytes_per_gpu)} per GPU"
        + (f" ({'; '.join(asides)})" if asides else ""),
        f"KV cache per token{_cache_note(plan.kv_cache_dtype)}: "
        f"{_size(plan.kv_bytes_per_token)} ({_size(plan.kv_bytes_per_token_per_gpu)} per GPU)",
    ]
    if plan.max_loras:
        lines.append(
            f"LoRA slots: {_size(plan.lora_bytes_per_gpu)} per GPU{fullest}, allocated before the KV cache "
            f"(--max-loras {plan.max_loras} x --max-lora-rank {plan.max_lora_rank})"
        )
    if pp:
        lines.append("pipeline stages: " + "; ".join(f"{i}: {describe_stage(st)}" for i, st in enumerate(plan.stages)))
    if plan.state_bytes_per_sequence:
        lines.append(f"LF state per sequence: {_size(plan.state_bytes_per_sequence)} (+ the same per cached block)")
    lines += [
        f"activations (estimate, one {plan.max_num_batched_tokens}-token step): "
        f"{_size(plan.activation_bytes_estimate)}",
        f"KV blocks: {plan.kv_blocks} x {plan.block_size} tokens = {plan.kv_tokens} tokens per GPU",
        f"max concurrency: {plan.max_concurrency:.1f} at {plan.max_model_len} tokens, "
        f"{plan.concurrency_at_typical_len:.1f} at {plan.typical_len} tokens",
        (
            f"recommended --max-num-seqs {plan.recommended_max_num_seqs} (80 % of the concurrency at "
            f"{plan.typical_len} tokens, a multiple of 8)"
            if plan.recommended_max_num_seqs is not None
            else "recommended --max-num-seqs: none, the model does not fit (see the note)"
        ),
        f"one {plan.max_model_len}-token request fits: {'yes' if plan.fits_one_max_len_request else 'NO'}",
        f"valid --tensor-parallel-size: {', '.join(str(n) for n in plan.valid_tensor_parallel_sizes)}",
    ]
    if plan.image_tokens is not None:
        lines.append(
            f"image: {plan.image_tokens} tokens each, {plan.image_tokens_per_request} per request with "
            "the vision markers"
        )
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="HF model folder, hub id (online) or .gguf")
    parser.add_argument("--gpu", default=None, help=f"GPU preset: {', '.join(sorted(GPU_MEMORY_GIB))}")
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="memory per GPU instead of --gpu")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    engine = ENGINE_DEFAULTS
    # serve's spellings (-tp, --tensor-parallel-size, ...) and the short --tp / --pp
    parser.add_argument(
        "-tp", "--tensor-parallel-size", "--tp", dest="tp", type=int, default=engine.tensor_parallel_size
    )
    parser.add_argument(
        "-pp", "--pipeline-parallel-size", "--pp", dest="pp", type=int, default=engine.pipeline_parallel_size
    )
    parser.add_argument(
        "--cpu-offload-gb",
        type=float,
        default=engine.cpu_offload_gb,
        help="as `pagoda serve --cpu-offload-gb`: GiB of decoder-layer weights per GPU kept in host memory",
    )
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="as `pagoda serve --enable-lora`: count the LoRA slots (--max-loras x --max-lora-rank) per GPU",
    )
    parser.add_argument(
        "--enable-tower-connector-lora",
        action="store_true",
        help="as `pagoda serve --enable-tower-connector-lora`: count the vision tower's LoRA slots too",
    )
    parser.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        help="as `pagoda serve --lora-target-modules`: count the slots of these layers only",
    )
    parser.add_argument("--max-loras", type=int, default=engine.max_loras)
    parser.add_argument("--max-lora-rank", type=int, default=engine.max_lora_rank)
    parser.add_argument("--max-model-len", type=int, default=engine.max_model_len)
    parser.add_argument("--gpu-memory-utilization", type=float, default=engine.gpu_memory_utilization)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPE_BYTES))
    parser.add_argument("--block-size", type=int, default=engine.block_size)
    parser.add_argument("--max-num-seqs", type=int, default=engine.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=engine.max_num_batched_tokens)
    parser.add_argument("--cpu-kv-cache-space-gib", type=float, default=engine.cpu_kv_cache_space_gib)
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--typical-len", type=int, default=None, help="prompt + output tokens of a typical request")
    parser.add_argument("--image", default=None, help="WxH of the images a request carries (Qwen2-VL)")
    parser.add_argument("--images-per-request", type=int, default=1)
    parser.add_argument("--min-pixels", type=int, default=None)
    parser.add_argument("--max-pixels", type=int, default=None)
    parser.add_argument(
        "-q",
        "--quantization",
        default=engine.quantization,
        choices=QUANTIZATION_CHOICES,
        help="as `pagoda serve --quantization`",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=engine.kv_cache_dtype,
        help=f"as `pagoda serve --kv-cache-dtype`: {' | '.join(KV_CACHE_DTYPES)} (fp8: 1 byte per cached element)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_plan(ns: argparse.Namespace) -> int:
    from pagoda.models.source import resolve_model_source  # lazy: torch (`pagoda plan` runs without it)

    source = resolve_model_source(ns.model)
    if ns.gpu is not None and ns.gpu.lower() not in GPU_MEMORY_GIB:
        raise ConfigError(
            f"Unknown --gpu {ns.gpu!r}; known: {', '.join(sorted(GPU_MEMORY_GIB))}, or pass --gpu-memory-gib.", "gpu"
        )
    gib = GPU_MEMORY_GIB[ns.gpu.lower()] if ns.gpu else ns.gpu_memory_gib
    image = None
    if ns.image:
        try:
            width, height = (int(v) for v in ns.image.lower().split("x"))
        except ValueError:
            raise ConfigError(f"--image must look like 1000x750, got {ns.image!r}", "image") from None
        image = (width, height)
    plan = make_plan(
        source.hf_config,
        model_folder=source.folder if source.kind == "hf" else None,
        device=ns.device,
        memory_bytes_per_gpu=int(gib * GiB) if gib else None,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        tensor_parallel_size=ns.tp,
        pipeline_parallel_size=ns.pp,
        max_model_len=ns.max_model_len,
        dtype=ns.dtype,
        block_size=ns.block_size,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        enable_prefix_caching=ns.enable_prefix_caching,
        cpu_kv_cache_space_gib=ns.cpu_kv_cache_space_gib,
        typical_len=ns.typical_len,
        image=image,
        images_per_request=ns.images_per_request,
        min_pixels=ns.min_pixels,
        max_pixels=ns.max_pixels,
        # As `pagoda serve` resolves it: a layout serve refuses is refused here in the same line.
        quantization=resolve_quantization(ns.quantization, source.location, source.kind, source.hf_config),
        kv_cache_dtype=ns.kv_cache_dtype,
        cpu_offload_gb=ns.cpu_offload_gb,
        # As serve resolves them (the same refusals); --max-cpu-loras is host memory, --lora-dtype serve's auto.
        lora=resolve_lora(
            ns.enable_lora,
            ns.max_loras,
            ns.max_lora_rank,
            None,
            "auto",
            ns.enable_tower_connector_lora,
            target_modules=ns.lora_target_modules,
        ),
    )

    print(json.dumps(asdict(plan), indent=1) if ns.json else format_plan(plan))
    return 0 if plan.fits_one_max_len_request and not plan.tensor_parallel_problems else 1


def _cache_note(kv_cache_dtype: str) -> str:
    return {"fp8": " (fp8 e4m3)", "bfloat16": " (bfloat16)"}.get(kv_cache_dtype, "")
