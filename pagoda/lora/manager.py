"""The worker's adapters: read ones kept on the host, the step's ones in device slots.

`attach_lora` gives every adaptable linear layer of the decoder (`Linear.lora`, see `layers/linear.py`) its
slots, and with `--enable-tower-connector-lora` so do those of the encoder's adaptable groups
(`CausalLM.encoder_lora_groups`: Qwen2-VL's patch embedding, vision blocks and merger). `LoRAManager.add` reads a
PEFT folder once (checked against the layers; the host keeps the last `max_cpu_loras` used, least recently used dropped
first, read again from disk if asked for later); `prepare(requests, query_lens)` puts the step's adapters in
slots (an adapter already in a slot stays; a slot whose adapter this step does not use is reused, least
recently used first) and writes the step's mapping every decoder layer reads; `prepare_encoder` maps the rows
of each encoder call the step makes.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np
import torch

from pagoda import envs
from pagoda.config import EngineConfig
from pagoda.config.lora import LoRAConfig
from pagoda.errors import ConfigError
from pagoda.kernels import dispatch, policy
from pagoda.layers.linear import ColumnParallelLinear, Linear, MergedColumnParallelLinear, RowParallelLinear
from pagoda.lora.layers import EncoderLoRAStep, LoRAPart, LoRASlots, LoRAStep
from pagoda.lora.peft import LoRAAdapter, load_peft_adapter
from pagoda.lora.request import LoRARequest
from pagoda.models.base import CausalLM


def _parts(layer: Linear) -> list[LoRAPart]:
    """The layer's output parts, each with this rank's rows of the whole part (tensor parallelism)."""
    if isinstance(layer, MergedColumnParallelLinear):
        offsets = np.cumsum([0, *layer.output_sizes[:-1]]).tolist()
        ranges, fulls = layer.part_ranges, layer.full_output_sizes
        return [
            LoRAPart(name, offset, size, start, full)
            for name, offset, size, (start, _), full in zip(
                layer.shard_names, offsets, layer.output_sizes, ranges, fulls
            )
        ]
    if isinstance(layer, ColumnParallelLinear):
        return [LoRAPart(None, 0, layer.output_size, layer.output_start, layer.full_output_size)]
    return [LoRAPart(None, 0, layer.output_size, 0, layer.output_size)]


def _input_range(layer: Linear) -> tuple[int, int, int]:
    if isinstance(layer, RowParallelLinear):
        return layer.input_start, layer.input_size, layer.full_input_size
    return 0, layer.input_size, layer.input_size


def _stacks(layer: Linear, slots: LoRASlots) -> bool:
    """Whether a decoder layer's A go under its weight (`LoRASlots.stack_under`): the LoRA kernels run on its
    device (`PAGODA_LORA_STACKED` on), its matmul is the plain `linear` (unquantized, not overridden, A in its
    dtype), its output is not all-reduced in place (a row-parallel layer under tensor parallelism reduces a
    contiguous output), and the A rows are at most `policy.LORA_STACKED_MAX_EXTRA` of its output rows."""
    weight = layer.weight
    plain = type(layer).matmul is Linear.matmul and type(layer).forward in (Linear.forward, RowParallelLinear.forward)
    if not (envs.LORA_STACKED.value and plain and layer.quant is None and dispatch.lora_for(weight) is not None):
        return False
    if isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
        return False
    if weight.device != slots.a.device or weight.dtype != slots.a.dtype:
        return False
    return slots.a.numel() <= policy.LORA_STACKED_MAX_EXTRA * weight.numel()


def attach_lora(
    model: CausalLM,
    config: LoRAConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_tokens: int,
    stack: bool = True,
) -> tuple[dict[str, LoRASlots], dict[str, EncoderLoRAStep]]:
    """Slots on every linear layer of the decoder's layers (MoE experts and routers too; not the embedding or the
    LM head), sharing one step mapping for steps of up to max_tokens, and with `config.tower_connector` on those
    of the encoder's adaptable groups, one mapping per group; returns the slots by module name and the groups'
    mappings. stack: decoder layers that can take their A under their weight do (`_stacks`; False where the
    weights alias staging memory: `--cpu-offload-gb`)."""
    step = LoRAStep(config.max_loras, max_tokens, device)
    groups = model.encoder_lora_groups if config.tower_connector else ()
    encoder_steps = {group: EncoderLoRAStep(device) for group in groups}
    targets = target_layer_names(model, config.target_modules)
    layers: dict[str, LoRASlots] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or (targets and name.rpartition(".")[2] not in targets):
            continue
        group = next((g for g in groups if name.startswith(g)), None)
        if group is None and (".layers." not in f".{name}" or "visual" in name):
            continue
        rank, parts, row_maps = config.max_lora_rank, _parts(module), module.lora_row_maps()
        if row_maps:  # interleaved projections: one part, their adapters' ranks stacked (`lora/peft.py`)
            rank, parts = rank * len(row_maps), [LoRAPart(None, 0, module.output_size)]
        layer_step = step if group is None else encoder_steps[group]
        slots = LoRASlots(_input_range(module), parts, config.max_loras, rank, dtype, device, layer_step)
        slots.row_maps = row_maps
        if stack and group is None and _stacks(module, slots):
            slots.stack_under(module.weight, module.bias)
        module.lora = slots
        layers[name] = slots
    return layers, encoder_steps


def target_layer_names(model: CausalLM, target_modules: tuple[str, ...]) -> frozenset[str]:
    """The layer names (a module path's last part) `--lora-target-modules` gives slots: each one named, and the fused
    layer of a checkpoint projection named (q_proj: qkv_proj); empty: every adaptable layer. A name that is no
    linear layer of the model is refused in one line."""
    if not target_modules:
        return frozenset()
    packed = model.packed_modules_mapping
    names = frozenset(t for name in target_modules for t in (name, *([packed[name][0]] if name in packed else [])))
    present = {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, Linear)}
    unknown = sorted(t for t in target_modules if not ({t, *([packed[t][0]] if t in packed else [])} & present))
    if unknown:
        raise ConfigError(
            f"--lora-target-modules {', '.join(unknown)}: no linear layer of this model is called that "
            f"(its layers: {', '.join(sorted(present | set(packed)))})",
            "lora_target_modules",
        )
    return names


class LoRAManager:
    def __init__(self, model: CausalLM, engine: EngineConfig, dtype: torch.dtype, device: torch.device):
        assert engine.lora is not None
        config = engine.lora
        self.model, self.config, self.device = model, config, device
        # The most tokens one step carries: the budget, and speculative proposals beyond it.
        spec = engine.scheduler.speculative
        max_tokens = engine.scheduler.max_num_batched_tokens + engine.scheduler.max_num_seqs * (
            1 + (spec.num_speculative_tokens if spec else 0)
        )
        self.dtype = dtype if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)
        offload = engine.device.cpu_offload_gb > 0
        self.layers, self.encoder_steps = attach_lora(model, config, self.dtype, device, max_tokens, not offload)
        decoder = [slots.step for slots in self.layers.values() if isinstance(slots.step, LoRAStep)]
        self.step = decoder[0] if decoder else LoRAStep(config.max_loras, max_tokens)
        # Adapters with weights on the encoder: a version per read, which keys their encoder outputs apart
        # from the base model's and from an earlier read of the same id (a folder loaded again in place).
        self._encoder_versions: dict[int, int] = {}
        self._versions = itertools.count(1)
        self._host: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()  # LRU last
        self._requests: dict[int, LoRARequest] = {}
        self._slots: list[int | None] = [None] * config.max_loras  # adapter id in each slot
        self._slot_used: list[int] = [0] * config.max_loras  # step count of each slot's last use
        self._steps = 0

    # ---- adapters on the host --------------------------------------------------------------------
    def add(self, request: LoRARequest) -> None:
        """Read (and check) the adapter now; raises InvalidRequest naming what is wrong with it."""
        known = self._requests.get(request.lora_int_id)
        if known is not None and known != request:
            # A new folder under a known id: the old one's slot and host copy must not be used for it.
            self.remove(request.lora_int_id)
        adapter = self._host_copy(request)
        self._requests[request.lora_int_id] = request
        self._encoder_versions.pop(request.lora_int_id, None)
        if any(layer.startswith(self.model.encoder_lora_groups) for layer, _ in adapter.weights):
            self._encoder_versions[request.lora_int_id] = next(self._versions)
        if None in self._slots:
            # A free device slot takes it now, so the first step asking for it copies nothing: the adapters
            # named at startup are on the device before the server reports ready (their first requests'
            # steps used to wait while every layer's A and B were copied from host memory).
            self._place(self._slots.index(None), request.lora_int_id, adapter)

    def remove(self, adapter_id: int) -> bool:
        self._host.pop(adapter_id, None)
        self._encoder_versions.pop(adapter_id, None)
        for i, held in enumerate(self._slots):
            if held == adapter_id:
                self._slots[i] = None
        return self._requests.pop(adapter_id, None) is not None

    def _host_copy(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._host.get(request.lora_int_id)
        if adapter is None:
            adapter = load_peft_adapter(request, self.model, self.layers, self.config.max_lora_rank, self.dtype)
            self._host[request.lora_int_id] = adapter
            while len(self._host) > self.config.host_capacity:
                self._host.popitem(last=False)
        self._host.move_to_end(request.lora_int_id)
        return adapter

    # ---- the step -------------------------------------------------------------------------------
    def prepare(self, requests: list[LoRARequest | None], query_lens: np.ndarray) -> None:
        """The step's mapping: row i's adapter (None: the base model) for its query_lens[i] tokens; at most max_loras
        adapters. An adapter this rank has not read yet is read now (the other tensor-parallel ranks read an
        adapter when its first request reaches them; the driver's engine read it at `add`)."""
        self._steps += 1
        for request in {r.lora_int_id: r for r in requests if r is not None}.values():
            if self._requests.get(request.lora_int_id) != request:
                self.add(request)
        ids_per_row = [0 if r is None else r.lora_int_id for r in requests] or [0] * len(query_lens)
        token_adapter_ids = np.repeat(np.asarray(ids_per_row, dtype=np.int64), query_lens)
        ids = [int(i) for i in np.unique(token_adapter_ids) if i]
        if len(ids) > self.config.max_loras:
            raise RuntimeError(f"{len(ids)} adapters in one step, more than max_loras {self.config.max_loras}")
        token_slots = np.full(len(token_adapter_ids), -1, dtype=np.int64)
        for adapter_id in ids:
            token_slots[token_adapter_ids == adapter_id] = self._slot_for(adapter_id, ids)
        self.step.write(token_slots)

    # ---- the encoder's part of the step ---------------------------------------------------------------
    def encoder_key(self, request: LoRARequest | None) -> bytes:
        """What the cache key of an item's encoder output adds for the item's request: nothing unless its adapter
        has weights on the encoder (then the output is that adapter's, not the base model's)."""
        version = None if request is None else self._encoder_versions.get(request.lora_int_id)
        return b"" if version is None else b"\x00lora" + version.to_bytes(8, "little")

    def prepare_encoder(self, grids: list[tuple[int, int, int]], requests: list[LoRARequest | None]) -> bool:
        """Map the rows of one encoder call over items with these grids, the i-th item the i-th request's (its
        adapter in the slot this step's `prepare` gave it); True when any item's adapter adapts the encoder (the
        call must then run eagerly: captured encoder graphs hold the base model only)."""
        if not self.encoder_steps:
            return False
        slots = [
            self._slots.index(r.lora_int_id) if r is not None and r.lora_int_id in self._encoder_versions else -1
            for r in requests
        ]
        rows = self.model.encoder_lora_rows(grids, slots)
        for group, step in self.encoder_steps.items():
            step.write(rows[group])
        return max(slots) >= 0

    def clear_encoder(self) -> None:
        for step in self.encoder_steps.values():
            step.clear()

    def _slot_for(self, adapter_id: int, needed: list[int]) -> int:
        if adapter_id in self._slots:
            slot = self._slots.index(adapter_id)
        else:
            free = [i for i, held in enumerate(self._slots) if held is None or held not in needed]
            slot = min(free, key=lambda i: (self._slots[i] is not None, self._slot_used[i]))
            self._place(slot, adapter_id, self._host_copy(self._requests[adapter_id]))
        self._slot_used[slot] = self._steps
        return slot

    def _place(self, slot: int, adapter_id: int, adapter: LoRAAdapter) -> None:
        """Device slot `slot` <- the adapter's A and B in every layer (zeros where it adds nothing)."""
        for name, weights in adapter.by_layer().items():
            self.layers[name].set(slot, weights)
        for name in self.layers.keys() - adapter.by_layer().keys():
            self.layers[name].set(slot, {})
        self._slots[slot] = adapter_id
