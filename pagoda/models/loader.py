"""Build a model from a `ModelSource`: construct on the meta device, allocate, stream weights in.

Each checkpoint tensor goes to the parameter of the same name, or — for fused projections listed
in the model's `packed_modules_mapping` — to its slice of the fused parameter via the owning
module's `weight_loader`. Every parameter must be written exactly by the checkpoint: a missing weight is an
error naming it, never a silently random tensor.

Tensor parallelism: the model is built after the process joined its group, so its layers hold one
rank's shares; safetensors entries arrive unread (`LazyTensor`) and the layers' loaders read only
their rows or columns of them, so a rank's host memory peaks at about its share of the checkpoint.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagoda import envs
from pagoda.distributed import parallel_state
from pagoda.errors import ModelLoadError
from pagoda.layers.linear import default_weight_loader, loader_reads_shards, read_weight
from pagoda.layers.quantization import UNUSED_LEAVES, process_after_loading, quantize_linear_layers
from pagoda.models.base import CausalLM
from pagoda.models.quantized_checkpoint import tensor_quantization
from pagoda.models.registry import get_model_class
from pagoda.models.source import ModelSource, format_bytes
from pagoda.models.weight_offload import offload_layers

if TYPE_CHECKING:  # the config is built above the models; here only its fields are read
    from pagoda.config.quantization import QuantConfig

logger = logging.getLogger(__name__)


def load_model(
    source: ModelSource,
    max_model_len: int,
    dtype: torch.dtype,
    device: str,
    load_format: str = "auto",
    quantization: QuantConfig | None = None,
    cpu_offload_gb: float = 0.0,
) -> nn.Module:
    started = time.perf_counter()
    architecture = (source.hf_config.get("architectures") or ["<missing>"])[0]
    model_class = get_model_class(architecture)
    world = parallel_state.tp_world_size()
    try:
        with torch.device("meta"):
            model = model_class(source.hf_config, max_model_len)
    except ValueError as exc:
        if world == 1:
            raise
        # A dimension the ranks cannot share evenly (heads, vocabulary, intermediate size).
        raise ModelLoadError(f"{architecture} cannot be split over tensor_parallel_size {world}: {exc}.") from None
    model = materialize(model, torch.device(device)).to(dtype)
    model.tie_weights()
    if quantization is not None:
        try:
            quantized = quantize_linear_layers(model, quantization, dtype, torch.device(device))
        except ValueError as exc:  # a projection the format cannot hold (packing, groups over the ranks)
            raise ModelLoadError(f"{architecture} with {quantization.describe()}: {exc}.", "quantization") from None
        logger.info("Quantization: %s in %d linear layers", quantization.describe(), quantized)
    if load_format == "dummy":
        init_dummy_weights(model)
        process_after_loading(model)
        logger.info(
            "Random (--load-format dummy) weights: %s in %.1f s",
            format_bytes(_param_bytes(model)),
            time.perf_counter() - started,
        )
    else:
        load_weights(model, source)
        process_after_loading(model)
        if device == "cpu" and source.kind == "gguf" and quantization is None:
            _keep_gguf_int4(model)
        if device == "cuda":
            torch.cuda.synchronize()  # the copies are queued: the time must include them
        files = source.weight_files()
        on_disk = sum(os.path.getsize(p) for p in files)
        logger.info(
            "Loaded weights: %s in %.1f s (%d file(s), %s on disk; %s on %s)",
            format_bytes(_param_bytes(model)),
            time.perf_counter() - started,
            len(files),
            format_bytes(on_disk),
            str(dtype).removeprefix("torch."),
            device,
        )
    if cpu_offload_gb > 0:  # after loading: the weights move from where they were loaded to host memory
        model.weight_streamer = offload_layers(
            model.stage.own(model.model.layers), cpu_offload_gb, torch.device(device)
        )
    return model.eval()


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """`model.to_empty(device=device)` without its cost: every parameter and buffer of a model built on the meta
    device replaced by an uninitialised tensor of its size, strides and dtype on `device` (tied parameters come
    apart, as with `to_empty`). `to_empty` allocates through `torch.empty_like`, whose meta-tensor path imports
    sympy: a large import that nothing else in serving needs, on every engine's startup."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                fresh = torch.empty_strided(param.size(), param.stride(), dtype=param.dtype, device=device)
                module._parameters[name] = nn.Parameter(fresh, requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty_strided(
                    buffer.size(), buffer.stride(), dtype=buffer.dtype, device=device
                )
    return model


def _keep_gguf_int4(model: nn.Module) -> None:
    """The GGUF's 4-bit layers back to 4 bits (`layers/quantization/cpu_int4.py`), and one line saying so."""
    from pagoda.kernels import policy
    from pagoda.layers.quantization import cpu_int4

    if not envs.CPU_INT4.value:
        logger.info("CPU weights: float32 (PAGODA_CPU_INT4=0)")
        return
    if not cpu_int4.available():
        logger.info("CPU weights: float32 (this torch has no CPU int4 kernel)")
        return
    packed, q8, kept = cpu_int4.pack_int4_layers(model)
    heads = cpu_int4.bf16_lm_heads(model) if packed + q8 and envs.CPU_BF16_LM_HEAD.value else 0
    embeddings = cpu_int4.int8_embeddings(model) if packed + q8 else 0
    head = "bf16 (PAGODA_CPU_BF16_LM_HEAD)" if heads else "float32"
    if heads and cpu_int4.int8_head_available():
        head += f", int8 up to {policy.CPU_INT8_HEAD_MAX_ROWS} rows"
    logger.info(
        "CPU weights: %d linear layers 4-bit and %d of 5-8-bit levels as two 4-bit halves (group %d; PyTorch's int4"
        " kernel up to %d rows, %s above), %d float32; LM head %s; embedding %s",
        packed,
        q8,
        cpu_int4.GROUP,
        policy.CPU_INT4_MAX_ROWS,
        "bf16" if cpu_int4.native_bf16() else "float32",
        kept,
        head,
        "int8 (its Q8_0 levels)" if embeddings else "float32",
    )


def _param_bytes(model: nn.Module) -> int:
    """Bytes the parameters hold (tied ones once): what the weights cost in memory."""
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in unique.values())


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Small random values in every parameter (`--load-format dummy`): speed depends on shapes only,
    and a config.json is all a benchmark then needs, not gigabytes of checkpoint. Values are drawn where
    the parameter lives, by that device's generator: drawing a GPU model's billions of values on the host
    and copying them over made startup scale with the host's speed."""
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        if getattr(param, "optional", False):
            continue  # already holds its default (a GPTQ g_idx: rows in order)
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        generator = generators[device]
        if not param.dtype.is_floating_point:  # packed 4-bit weights and zero points: any bits
            bits = torch.randint(
                -(2**31), 2**31 - 1, param.shape, generator=generator, dtype=torch.int64, device=device
            )
            param.copy_(bits.to(param.dtype))
            continue
        if device.type == "cpu":  # drawn in float32 and rounded: the values CPU tests were written against
            values = torch.rand(param.shape, generator=generator, dtype=torch.float32) * 2e-3 - 1e-3
            param.copy_(values.to(param.dtype))
        elif param.element_size() > 1:
            param.uniform_(-1e-3, 1e-3, generator=generator)
        else:  # fp8: no uniform_ kernel, drawn in bf16
            draws = torch.empty(param.shape, dtype=torch.bfloat16, device=device)
            param.copy_(draws.uniform_(-1e-3, 1e-3, generator=generator))


@dataclass
class WeightTarget:
    """Where one checkpoint tensor goes: a parameter (or its shard of a fused one) and the loader."""

    key: str  # "param" or "param:shard", for the completeness check
    param: nn.Parameter
    loader: Callable[..., None]
    shard: str | None


class WeightRouter:
    """Checkpoint names → parameters of a model, the one routing shared by loading and by
    `pagoda doctor` (which dry-runs it on a meta-device model against the safetensors headers)."""

    def __init__(self, model: CausalLM):
        self.model = model
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.mapping: dict[str, tuple[str, str]] = model.packed_modules_mapping  # `models/base.py`
        self.rename = model.map_weight_name
        self.loaded: set[str] = set()
        self.quantized = any(getattr(m, "quant", None) is not None for m in self.modules.values())

    def target(self, checkpoint_name: str) -> WeightTarget | None:
        """None for entries the model skips; KeyError when no parameter matches."""
        name = self.rename(checkpoint_name)
        if self.model.skip_weight(name) or kv_scale_entry(name) is not None:
            return None
        name = self.model.stage_weight_name(name)  # pipeline parallelism: None when another stage holds it
        if name is None:
            return None
        if self.quantized and name.rsplit(".", 1)[-1] in UNUSED_LEAVES:
            return None
        target, shard = _map_name(name, self.mapping)
        param = self.params.get(target)
        if param is None:
            raise KeyError(name)
        owner = self.modules[target.rpartition(".")[0]]
        return WeightTarget(
            f"{target}:{shard}" if shard is not None else target,
            param,
            getattr(owner, "weight_loader", default_weight_loader),
            shard,
        )

    def check_complete(self) -> None:
        _check_complete(self.model, self.params, self.mapping, self.loaded)


def kv_scale_entry(name: str) -> tuple[str, str] | None:
    """(attention module prefix, "k" | "v") for a checkpoint's KV-cache scale: vLLM-style
    `...self_attn.k_scale`, or compressed-tensors' `...self_attn.k_proj.output_scale`."""
    for kind in ("k", "v"):
        for suffix in (f".{kind}_scale", f".{kind}_proj.output_scale"):
            if name.endswith(suffix):
                return name[: -len(suffix)], kind
    return None


def _set_kv_scales(model: nn.Module, scales: dict[str, dict[str, float]]) -> None:
    """Hand each attention layer its checkpoint KV scales (used by an fp8 KV cache). The entries sit
    on the model's attention block (`model.layers.0.self_attn.k_scale`), whose `Attention` module is
    `.attn`; an entry already naming that module (`...self_attn.attn.k_scale`) is taken as well."""
    modules = dict(model.named_modules())
    unmatched = []
    for prefix, found in scales.items():
        attn = modules.get(f"{prefix}.attn", modules.get(prefix))
        setter = getattr(attn, "set_kv_scales", None)
        if setter is None:
            unmatched.append(prefix)
            continue
        try:
            setter(found.get("k", 1.0), found.get("v", 1.0))
        except ValueError as exc:
            raise ModelLoadError(f"Checkpoint KV cache scales of {prefix!r}: {exc}") from None
    if unmatched:
        logger.warning(
            "KV cache scales for %d module(s) with no attention layer (e.g. %r) were ignored",
            len(unmatched),
            unmatched[0],
        )


def load_weights(model: CausalLM, source: ModelSource) -> None:
    router = WeightRouter(model)
    kv_scales: dict[str, dict[str, float]] = {}
    for name, tensor in source.iter_weights():
        entry = kv_scale_entry(router.rename(name))
        if entry is not None:
            kv_scales.setdefault(entry[0], {})[entry[1]] = float(read_weight(tensor, torch.float32).max())
            continue
        try:
            target = router.target(name)
        except KeyError as exc:
            # Checked again here for what the early check cannot see without unpickling (.bin shards).
            quantized = tensor_quantization([name])
            if quantized is not None:
                raise ModelLoadError(
                    quantized.message(source.location, ": config.json has no quantization_config describing it"),
                    "model",
                ) from None
            raise ModelLoadError(
                f"Checkpoint tensor {exc.args[0]!r} has no matching parameter in "
                f"{type(model).__name__}; is config.json's architecture right?"
            ) from None
        if target is None:
            continue
        if not loader_reads_shards(target.loader):
            tensor = read_weight(tensor, target.param.dtype)  # a loader that takes whole tensors
        try:
            target.loader(target.param, tensor, target.shard)
        except ValueError as exc:
            raise ModelLoadError(f"Checkpoint tensor {router.rename(name)!r}: {exc}") from None
        router.loaded.add(target.key)
    router.check_complete()
    _set_kv_scales(model, kv_scales)


def _map_name(name: str, mapping: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    for hf_part, (fused, shard) in mapping.items():
        if f".{hf_part}." in name:
            return name.replace(f".{hf_part}.", f".{fused}."), shard
    return name, None


def _check_complete(
    model: nn.Module, params: dict[str, nn.Parameter], mapping: dict[str, tuple[str, str]], loaded: set[str]
) -> None:
    shards_of: dict[str, list[str]] = {}
    for fused, shard in mapping.values():
        shards_of.setdefault(fused, []).append(shard)
    for name, param in params.items():
        if getattr(param, "optional", False):
            continue
        fused = name.split(".")[-2]
        expected = [f"{name}:{s}" for s in shards_of[fused]] if fused in shards_of else [name]
        missing = [e for e in expected if e not in loaded]
        if missing:
            raise ModelLoadError(
                f"The checkpoint has no weight for {missing[0]!r}; the model folder is "
                "incomplete or its config.json does not match its weights."
            )
