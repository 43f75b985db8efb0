"""A PEFT LoRA folder read onto this model's adaptable layers.

The folder holds `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `target_modules`, ...) and
`adapter_model.safetensors` (or PEFT's older `adapter_model.bin`, unpickled as plain tensors only) with, per
adapted projection, `<prefix>.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r] (a convolution's,
flattened: `_as_matrix`). The scale s = lora_alpha / r (rsLoRA: lora_alpha / √r) is folded into B. A projection
the model fuses (`q_proj` into `qkv_proj`, through the model's `packed_modules_mapping`) becomes that part of the
fused layer; one tensor for all parts of a fused layer (Yuan M32's expert `w1`) is split between them. What Pagoda
cannot serve exactly is refused by name: DoRA, per-module ranks or alphas, trained biases, `modules_to_save`,
a rank above `--max-lora-rank`, a target that is not one of the model's adaptable linear layers, shapes that
differ from the base model's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from pagoda.errors import ModelLoadError
from pagoda.layers.linear import Linear
from pagoda.lora.adapter_folder import adapter_failure as _fail
from pagoda.lora.adapter_folder import check_adapter_folder
from pagoda.lora.layers import LoRASlots
from pagoda.lora.request import LoRARequest
from pagoda.models.base import CausalLM
from pagoda.models.source import load_bin_shard

_PREFIXES = ("base_model.model.",)
_LAYER_INDEX = re.compile(r"\.layers\.\d+\.")


@dataclass
class LoRAAdapter:
    """An adapter on the host: {(layer name, part name): (A [r, in], s·B [out_part, r])}."""

    request: LoRARequest
    rank: int
    weights: dict[tuple[str, str | None], tuple[torch.Tensor, torch.Tensor]]

    @property
    def id(self) -> int:
        return self.request.lora_int_id

    def by_layer(self) -> dict[str, dict[str | None, tuple[torch.Tensor, torch.Tensor]]]:
        out: dict[str, dict[str | None, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, part), pair in self.weights.items():
            out.setdefault(layer, {})[part] = pair
        return out


def _module_of(name: str) -> tuple[str, str] | None:
    """(module path, 'A' or 'B') of a PEFT tensor name, without the PEFT prefix; None for other entries."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
    for which in ("A", "B"):
        suffix = f".lora_{which}.weight"
        if name.endswith(suffix):
            return name[: -len(suffix)], which
    return None


def load_peft_adapter(
    request: LoRARequest,
    model: CausalLM,
    layers: Mapping[str, LoRASlots],
    max_rank: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """The adapter of `request` for `model`, whose adaptable layers are `layers` (module name → slots)."""
    folder, rank, scale = check_adapter_folder(request, max_rank)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in _adapter_tensors(request, folder):
        parsed = _module_of(name)
        if parsed is None:
            raise _fail(request, f"tensor {name!r} is not a LoRA A or B weight (unsupported adapter content)")
        module, which = parsed
        halves.setdefault(module, {})[which] = tensor
    packed = model.packed_modules_mapping
    weights: dict[tuple[str, str | None], tuple[torch.Tensor, torch.Tensor]] = {}
    interleaved: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise _fail(request, f"{module} has lora_{next(iter(pair))} without its other half")
        path = model.map_weight_name(module + ".weight")[: -len(".weight")]
        parent, _, leaf = path.rpartition(".")
        layer, part = (f"{parent}.{packed[leaf][0]}", packed[leaf][1]) if leaf in packed else (path, None)
        held = model.stage_weight_name(path + ".weight") is not None
        if not held and path.startswith(model.encoder_lora_groups):
            continue  # the encoder's layers: the first pipeline stage holds and checks them
        # A decoder layer another pipeline stage holds: checked against the same layer of one this stage
        # holds (decoder layers share their shapes), then left to that stage.
        slots = layers.get(layer if held else _LAYER_INDEX.sub(f".layers.{model.stage.layers[0]}.", layer, 1))
        # One checkpoint tensor for all parts of a fused layer (Yuan M32's expert w1 = [activated | linear]).
        whole = slots is not None and part is None and not slots.row_maps and len(slots.parts) > 1
        if slots is None or not (
            whole or part in (list(slots.row_maps) if slots.row_maps else [p.name for p in slots.parts])
        ):
            if path.startswith(model.encoder_lora_groups):
                raise _fail(
                    request,
                    f"it adapts {module} in the vision tower, which takes adapters only with "
                    "--enable-tower-connector-lora (LLM(enable_tower_connector_lora=True))",
                )
            if ".visual." in f".{path}":
                raise _fail(
                    request,
                    f"it adapts {module} in the vision tower, where only the patch embedding, the blocks' attention "
                    "and MLP projections and the merger's MLP take adapters",
                )
            if _is_linear(model, layer):
                raise _fail(request, f"it adapts {module}, a layer --lora-target-modules leaves without adapter slots")
            raise _fail(request, f"it adapts {module}, which is not an adaptable linear layer of this model")
        a, b = _as_matrix(request, module, pair["A"], "A"), _as_matrix(request, module, pair["B"], "B")
        in_start, in_size, in_full = slots.input_range
        targets = slots.parts if whole else [] if slots.row_maps else [slots.parts[slots.part_index(part)]]
        if slots.row_maps:
            full_rows = slots.row_maps[str(part)][2]
        else:
            full_rows = sum(target.full or target.size for target in targets)
        expected_a, expected_b = (rank, in_full), (full_rows, rank)
        if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise _fail(
                request,
                f"{module} has A {tuple(a.shape)} and B {tuple(b.shape)}, but this base model needs "
                f"A {expected_a} and B {expected_b} (an adapter of another base model?)",
            )
        if not held:
            continue
        if slots.row_maps:
            interleaved.setdefault(layer, {})[str(part)] = (a, b.float() * scale)
            continue
        # This rank's share (tensor parallelism): A's input columns as the layer's, B's rows as each part's (the
        # parts' rows one after the other in B when it covers them all).
        a, first = a[:, in_start : in_start + in_size].to(dtype), 0
        for target in targets:
            rows = b[first + target.start : first + target.start + target.size]
            weights[(layer, target.name if whole else part)] = (a, (rows.float() * scale).to(dtype))
            first += target.full or target.size
    for layer, shards in interleaved.items():
        weights[(layer, None)] = _stacked(layers[layer], shards, rank, dtype)
    if not halves:
        raise _fail(request, "it holds no LoRA weights")
    return LoRAAdapter(request, rank, weights)


def _as_matrix(request: LoRARequest, module: str, tensor: torch.Tensor, which: str) -> torch.Tensor:
    """A LoRA half as a matrix. A convolution's (PEFT's adapter on a Conv3d, Qwen2-VL's patch embedding, which is
    a Linear here) flattens: A [r, C, T, p, p] in the order of the base kernel's own flattening, B [out, r, 1, 1, 1]
    (PEFT's B is a 1×1×1 conv). A conv B over more than one position has no matrix form."""
    if tensor.dim() <= 2:
        return tensor
    if which == "B" and any(size != 1 for size in tensor.shape[2:]):
        raise _fail(request, f"{module}'s lora_B is a {tuple(tensor.shape[2:])} convolution; only 1×1 ones are served")
    return tensor.reshape(tensor.shape[0], -1)


def _is_linear(model: CausalLM, name: str) -> bool:
    try:
        return isinstance(model.get_submodule(name), Linear)
    except AttributeError:
        return False


def _adapter_tensors(request: LoRARequest, folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the folder's weights: adapter_model.safetensors, else adapter_model.bin."""
    weights_file = folder / "adapter_model.safetensors"
    if weights_file.is_file():
        from safetensors import safe_open  # lazy: only where adapters are served

        with safe_open(str(weights_file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
        return
    if not (folder / "adapter_model.bin").is_file():
        raise _fail(request, "no adapter_model.safetensors (or adapter_model.bin) there")
    try:
        yield from load_bin_shard(str(folder / "adapter_model.bin")).items()
    except ModelLoadError as exc:
        raise _fail(request, exc.message) from None


def _stacked(
    slots: LoRASlots, shards: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One (A, s·B) of rank n·r for a layer whose n projections interleave in its rows (Yuan2's q/k): A stacks
    the projections' A; projection i's B rows land where its weight rows do, in rank columns [i·r, (i+1)·r),
    zero elsewhere, so (x·Aᵀ)·Bᵀ is the sum of the projections' terms, each on its own rows."""
    assert slots.row_maps is not None
    n = len(slots.row_maps)
    a_all = torch.zeros(n * rank, slots.input_range[1])
    b_all = torch.zeros(slots.parts[0].size, n * rank)
    for i, (shard, (source, target, _)) in enumerate(slots.row_maps.items()):
        if shard in shards:
            a, b = shards[shard]
            a_all[i * rank : (i + 1) * rank] = a.float()
            b_all[target, i * rank : (i + 1) * rank] = b[source]
    return a_all.to(dtype), b_all.to(dtype)
