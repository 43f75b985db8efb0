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

import torch
from torch import nn

from pagoda.distributed import parallel_state
from pagoda.errors import ModelLoadError
from pagoda.layers.linear import default_weight_loader, loader_reads_shards, read_weight
from pagoda.models.quantization import tensor_quantization
from pagoda.models.registry import get_model_class
from pagoda.models.source import ModelSource, format_bytes

logger = logging.getLogger(__name__)


def load_model(
    source: ModelSource, max_model_len: int, dtype: torch.dtype, device: str, load_format: str = "auto"
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
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    if load_format == "dummy":
        init_dummy_weights(model)
        logger.info(
            "Random (--load-format dummy) weights: %s in %.1f s",
            format_bytes(_param_bytes(model)),
            time.perf_counter() - started,
        )
    else:
        load_weights(model, source)
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
    return model.eval()


def _param_bytes(model: nn.Module) -> int:
    """Bytes the parameters hold (tied ones once): what the weights cost in memory."""
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in unique.values())


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Small random values in every parameter (`--load-format dummy`): speed depends on shapes only,
    and a config.json is all a benchmark then needs, not gigabytes of checkpoint."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for param in model.parameters():
        values = torch.rand(param.shape, generator=generator, dtype=torch.float32) * 2e-3 - 1e-3
        param.copy_(values.to(param.dtype))


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

    def __init__(self, model: nn.Module):
        self.model = model
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.mapping: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
        self.rename = getattr(model, "map_weight_name", lambda n: n)
        self.loaded: set[str] = set()

    def target(self, checkpoint_name: str) -> WeightTarget | None:
        """None for entries the model skips; KeyError when no parameter matches."""
        name = self.rename(checkpoint_name)
        if self.model.skip_weight(name):
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


def load_weights(model: nn.Module, source: ModelSource) -> None:
    router = WeightRouter(model)
    for name, tensor in source.iter_weights():
        try:
            target = router.target(name)
        except KeyError as exc:
            # Checked again here for what the early check cannot see without unpickling (.bin shards).
            quantized = tensor_quantization([name])
            if quantized is not None:
                raise ModelLoadError(quantized.message(source.location), "model") from None
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
    for name in params:
        fused = name.split(".")[-2]
        expected = [f"{name}:{s}" for s in shards_of[fused]] if fused in shards_of else [name]
        missing = [e for e in expected if e not in loaded]
        if missing:
            raise ModelLoadError(
                f"The checkpoint has no weight for {missing[0]!r}; the model folder is "
                "incomplete or its config.json does not match its weights."
            )
