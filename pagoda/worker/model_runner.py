"""The only part of the engine that touches the model and its tensors.

`launch(SchedulerOutput) -> PendingStep`, one step in three parts, as the code reads:
1. prepare: apply the scheduler's diff to the request states (`RequestStates`), then build the step's
   `StepInputs` once (`StepInputsBuilder`: ids, positions, cache slots, block tables, the rows that
   sample as the scheduler decided them);
2. run the model: replay a CUDA graph when one fits (`GraphRunner.can_run`), else eagerly over the same
   inputs (the multimodal encoder's rows, if any, from `EncoderRunner`); logits for the rows that sample;
3. sample on the device (the driver rank only, under tensor parallelism) and queue the tokens' copy to
   the host. Nothing on this path waits for the GPU; `PendingStep.result()` does. `execute` = both.

Async scheduling launches step N+1 before step N's result is read: a row whose input token is step
N's sample takes it from step N's device tensor (`_last_sampled`, see `worker/step_inputs.py`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np
import torch

from pagoda.config import EngineConfig
from pagoda.device_copy import to_device
from pagoda.distributed.parallel_state import all_reduce_max, is_driver
from pagoda.kernels import dispatch
from pagoda.layers.attention import FP8_KV, AttentionBackend, StepAttention
from pagoda.layers.sampler import Sampler, SamplingState
from pagoda.layers.sequence_state import SequenceStateBatch
from pagoda.layers.torch_attention import TorchAttentionBackend
from pagoda.layers.triton_attention import TritonAttentionBackend
from pagoda.lora.manager import LoRAManager
from pagoda.models.loader import load_model
from pagoda.models.source import ModelSource
from pagoda.outputs import SchedulerOutput, StepOutput
from pagoda.worker import spec_rows
from pagoda.worker.encoder_runner import EncoderRunner
from pagoda.worker.graph_runner import GraphRunner, GraphSpec
from pagoda.worker.kv_cache import allocate_kv_caches, copy_blocks, log_fp8_scales, zero_blocks
from pagoda.worker.memory import KVCacheLayout, KVCacheSpec, kv_cache_spec
from pagoda.worker.pending_step import NO_TOKENS, LaunchedStep, PendingStep
from pagoda.worker.pipeline_link import PipelineLink
from pagoda.worker.request_states import RequestStates, RunnerRequestState
from pagoda.worker.state_slots import StateSlotPool
from pagoda.worker.step_inputs import StepInputs, StepInputsBuilder, one_prompt_inputs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        eos_token_ids: set[int],
        backend: AttentionBackend | None = None,
    ):
        self.config = config
        self.device = torch.device(config.device.device)
        self.dtype = _DTYPES[config.model.dtype]
        self.cache_dtype = {"fp8": FP8_KV, "bfloat16": torch.bfloat16}.get(config.cache.kv_cache_dtype, self.dtype)
        self.block_size = config.cache.block_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.model = load_model(
            source,
            config.model.max_model_len,
            self.dtype,
            config.device.device,
            config.model.load_format,
            config.model.quantization,
            config.device.cpu_offload_gb,
        )
        self.capabilities = caps = self.model.capabilities  # what the model is, read once
        # This rank's links to the others: pipeline stages' activations and logits, the sampled tokens.
        self.link = PipelineLink(self.model.stage, config, self.dtype, self.device)
        self.vocab_size = config.model.vocab_size
        unique = {p.data_ptr(): p for p in self.model.parameters()}  # tied (and offload-slot) storage once
        self.weight_bytes = sum(p.numel() * p.element_size() for p in unique.values())  # this rank's share
        triton = config.device.attention_backend == "triton"
        self.backend = backend or (TritonAttentionBackend() if triton else TorchAttentionBackend())
        if self.cache_dtype == FP8_KV:
            log_fp8_scales(self.model.attention_layers())
        self.sampler = Sampler()
        max_seqs = config.scheduler.max_num_seqs
        # Per-request sampling rows kept across steps: a step's batch is a gather; penalty histories on the device.
        self.sampling = SamplingState(max_seqs, self.vocab_size, self.device, self.eos_token_ids, config.model.seed)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        stateful = self.model.sequence_state_layers() if caps.stateful else []
        spec = config.scheduler.speculative
        self.spec_positions = n = 1 + spec.num_speculative_tokens if spec else 0  # states a verified row keeps
        self.state_pool = StateSlotPool(stateful, max_seqs, self.dtype, self.device, n) if stateful else None
        self.state_snapshots = self.state_pool is not None and config.cache.enable_prefix_caching  # exact hits
        self.requests = RequestStates(self.block_size, self.device, self.sampling, self.state_pool)
        self.inputs = StepInputsBuilder(
            self.block_size, self.device, stateful=bool(stateful), uses_mrope=caps.mrope, has_encoder=caps.encoder
        )
        self.accepts_multimodal = caps.encoder
        self.lora = LoRAManager(self.model, config, self.dtype, self.device) if config.lora else None
        cache_tokens, first = max(32768, 4 * config.scheduler.max_num_batched_tokens), self.link.stage.first
        self.encoder = EncoderRunner(self.model, self.device, cache_tokens, caps.encoder and first, self.lora)
        self.encoder_cache = self.encoder.cache
        self.graphs: GraphRunner | None = None  # set by `enable_cuda_graphs`
        self._last_sampled: torch.Tensor | None = None  # its token ids, on the device
        self._last_step: PendingStep | None = None  # the last launched step's samples
        self.token_masks: Any = None  # structured output's `GrammarManager`, set by the engine on first use

    # ---- KV cache -----------------------------------------------------------------------------
    def kv_cache_spec(self) -> KVCacheSpec:
        return kv_cache_spec(
            self.model,
            torch.tensor([], dtype=self.dtype).element_size(),
            self.config.cache.enable_prefix_caching,
            torch.tensor([], dtype=self.cache_dtype).element_size(),
            self.spec_positions,
        )

    def initialize_kv_cache(self, layout: KVCacheLayout) -> None:
        """Allocate the KV cache (`worker/kv_cache.py`) and the state snapshots (prefix caching, speculation)."""
        self.kv_caches = allocate_kv_caches(
            self.model.attention_layers(), layout.num_blocks, layout.block_size, self.cache_dtype, self.device
        )
        if self.state_pool is not None:
            self.state_pool.allocate_snapshots(layout.num_blocks if self.state_snapshots else 0)

    def warm_up_attention(self) -> None:
        """Let the attention backend compile its kernels for this model's attention shapes now, before
        the first request (see `AttentionBackend.warm_up`)."""
        shapes = {(layer.num_heads, layer.num_kv_heads, layer.head_dim) for layer in self.model.attention_layers()}
        self.backend.warm_up(shapes, self.block_size, self.dtype, self.device, self.cache_dtype)

    def enable_cuda_graphs(
        self, capture: bool = True, decode_buckets: list[int] | None = None, token_buckets: list[int] | None = None
    ) -> None:
        """Run pure decode steps (rows up to max_num_seqs) and mixed steps (up to 2047 tokens), each
        up to --max-cudagraph-capture-size, from static buffers, replaying CUDA graphs captured now
        (capture=False: the same buffers, run eagerly — for tests on the CPU). Call after
        `initialize_kv_cache` with the real cache: graphs hold the cache's addresses."""
        if self.backend.name != "triton":
            raise ValueError("CUDA graphs need the Triton attention backend")
        if not self.capabilities.cuda_graphs:
            logger.info("%s cannot be captured in CUDA graphs: steps run eagerly", type(self.model).__name__)
            return
        scratch = self.state_pool.scratch_slot if self.state_pool is not None else None
        mm = (self.link.hidden_size, self.dtype) if self.capabilities.encoder else None  # every stage buckets alike
        spec = GraphSpec.create(
            self.config, scratch, self.state_snapshots, self.capabilities.mrope, decode_buckets, token_buckets, mm
        )
        self.graphs = GraphRunner(spec, self.model, self.backend, self.device, capture, self.link)
        self.graphs.capture_all()
        if capture:
            self.encoder.enable_graphs()

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int) -> int:
        """One worst-case step (num_tokens prompt tokens, a throwaway cache): PyTorch's peak GPU bytes, weights in."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        spec = self.kv_cache_spec()
        num_blocks = -(-num_tokens // self.block_size) + 1
        self.initialize_kv_cache(KVCacheLayout(num_blocks, self.block_size, 0))
        # Positions wrap at max_model_len: the step budget may exceed the model's context (RoPE table).
        inputs = one_prompt_inputs(num_tokens, self.block_size, self.config.model.max_model_len)
        if self.state_pool is not None:
            inputs.state_slots = np.zeros(1, dtype=np.int64)
        with dispatch.pdl_for_rows(num_tokens):  # as an eager step of this size runs (and so compiles) them
            hidden = self.link.hand_on(self._forward_eager(inputs))  # None before the last pipeline stage
            if hidden is not None:
                self.model.compute_logits(hidden[-1:])
            if self.encoder.active:
                self.encoder.profile(num_tokens, self.dtype)
        torch.cuda.synchronize()
        # Under tensor parallelism every rank sizes the same pool: the largest rank's peak decides.
        peak = int(all_reduce_max(torch.cuda.max_memory_allocated(self.device)))
        del hidden
        self.kv_caches = []
        for layer in self.model.attention_layers():
            layer.bind_kv_cache(torch.empty(0), torch.empty(0))
        if self.state_pool is not None:
            self.state_pool.drop_snapshots()
            self.state_pool.state.zero_()
        torch.cuda.empty_cache()
        logger.debug("profiled %d tokens: peak %.2f GiB (kv spec %s)", num_tokens, peak / 2**30, spec)
        return peak

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits [n, V] (float32, CPU) of one text-only sequence in one prefill over KV blocks 1..."""
        inputs = one_prompt_inputs(len(token_ids), self.block_size)
        inputs.token_ids = np.asarray(token_ids, dtype=np.int64)
        zero_blocks(self.kv_caches, inputs.block_tables[0].tolist(), self.device)  # as for every block handed out
        hidden = self._forward_eager(inputs)
        assert isinstance(hidden, torch.Tensor), "prompt_logits needs the whole model in one pipeline stage"
        return self.model.compute_logits(hidden).float().cpu()

    def set_token_masks(self, masks: Any) -> None:
        self.token_masks = masks

    def remove_lora(self, lora_id: int) -> None:  # its host copy and device slot, on this rank
        if self.lora is not None:
            self.lora.remove(lora_id)

    def shutdown(self) -> None:  # nothing to stop on one rank (`TensorParallelRunner.shutdown` stops the others)
        pass

    def finish_step(self) -> None:  # a rank's oldest deferred step takes the driver's tokens (micro-batches)
        self.link.finish_oldest()

    def take_failures(self) -> list[tuple[str, str, Exception]]:
        return self.requests.take_failures()

    @property
    def failures(self) -> list[tuple[str, str, Exception]]:
        return self.requests.failures

    @property
    def states(self) -> dict[str, RunnerRequestState]:
        return self.requests.states

    def execute(self, so: SchedulerOutput) -> StepOutput:
        """Run one step to the end: launch it and wait for its tokens."""
        return self.launch(so).result()

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> LaunchedStep:
        """Queue one step on the device. At most one earlier step may still be unread (its tokens feed this one's
        pending rows on the device). Eager kernels use PDL as a graph of the same size would (`pdl_for_rows`)."""
        with dispatch.pdl_for_rows(so.total_num_scheduled_tokens):
            step = self._prepare(so)
            if step is None:
                return PendingStep([], [], done=NO_TOKENS)
            request_ids, states, inputs = step
            logits = self._run_model(inputs, states)
            for s, n in zip(states, inputs.seq_lens.tolist()):
                s.num_computed_tokens = n
            if not len(inputs.sample_rows):  # no row reached the end of its known tokens
                return PendingStep([], [], done=NO_TOKENS)
            if len(inputs.sample_rows) < len(request_ids):
                rows = inputs.sample_rows.tolist()
                request_ids, states = [request_ids[i] for i in rows], [states[i] for i in rows]
            if self.link.deferred:  # micro-batches: sample when the step is read (`worker/pipeline_link.py`)
                return self.link.defer(functools.partial(self._sample, request_ids, states), logits, len(request_ids))
            return self._sample(request_ids, states, logits, inputs.spec)

    def _prepare(self, so: SchedulerOutput) -> tuple[list[str], list[RunnerRequestState], StepInputs] | None:
        """Apply the scheduler's diff; the step's rows, their states and its inputs (None: no rows)."""
        fresh = self.requests.apply(so)
        if self.token_masks is not None:
            for request_id in so.finished_request_ids:
                self.token_masks.remove(request_id)
        if so.block_copies:  # prefix hits given as copies; first: a source may be handed out again as a fresh block
            copy_blocks(self.kv_caches, so.block_copies, self.device)
        if fresh and self.backend.needs_zeroed_blocks:  # (never a copy's destination: that holds prefix hits)
            zero_blocks(self.kv_caches, fresh, self.device)
        scheduled = self.requests.scheduled(so)
        if not scheduled:
            return None
        request_ids = list(scheduled)
        states = [self.states[rid] for rid in request_ids]
        inputs = spec_rows.build_inputs(self.inputs, scheduled, states, so, self._last_sampled, self.state_pool)
        return request_ids, states, inputs

    def _run_model(self, inputs: StepInputs, states: list[RunnerRequestState]) -> torch.Tensor | None:
        """Logits [S (+ proposals), V] of the rows that sample (None: no row, or a stage that does not sample)."""
        positions = spec_rows.logits_positions(inputs)
        if self.lora is not None:  # each row's adapter (`lora/manager.py`), for the eager path and the graphs alike
            self.lora.prepare([s.lora_request for s in states], inputs.query_lens)
        graphed = self.graphs is not None and self.graphs.can_run(inputs)
        mm = self.encoder.embeds(states, inputs)  # the vision tower's rows for placeholder tokens, eagerly
        # A graph gives the logits at `positions`; an eager step the hidden states; before the last
        # pipeline stage either sends its activations on (None here).
        out = self.graphs.run(inputs, positions, mm) if graphed else self._forward_eager(inputs, mm)
        out = self.link.hand_on(out)
        if not len(inputs.sample_rows):
            return None
        if out is None:  # a stage before the last: the driver takes the last stage's logits (now, or when read)
            return None if self.link.deferred else self.link.driver_logits(len(inputs.sample_rows))
        logits = out if graphed else self.model.compute_logits(out[to_device(positions, self.device)])
        self.link.logits_for_driver(logits)
        return logits

    def _forward_eager(self, inputs: StepInputs, mm: tuple[np.ndarray, torch.Tensor] | None = None):
        """The model over the step, launched from Python (the PyTorch backend, or no graph fits); `mm`: the
        encoder's (flat token indices, rows) for the step's placeholder tokens."""
        dev = self.device
        batch = spec_rows.attention_batch(inputs, self.block_size, dev)
        state = None
        if inputs.state_slots is not None:
            state = SequenceStateBatch.build(
                inputs.state_slots.tolist(),
                inputs.query_start_loc,
                inputs.positions,
                inputs.slots,
                self.block_size,
                self.state_snapshots,
                dev,
                inputs.state_writes,
            )
        attn = StepAttention(self.backend, self.backend.prepare(batch), state)
        if inputs.mrope_positions is not None:
            attn.mrope_positions = to_device(inputs.mrope_positions, dev)
        if mm is not None:
            attn.mm_embeds = to_device(mm[0], dev), mm[1]
        attn.stage_input = self.link.stage_input(len(inputs.token_ids))
        ids = to_device(inputs.token_ids, dev)
        if inputs.late_tokens is not None:
            ids.index_copy_(0, *inputs.late_tokens)
        return self.model(ids, to_device(inputs.positions, dev), attn)

    def _sample(
        self, request_ids: list[str], states: list[RunnerRequestState], logits: torch.Tensor | None, spec=None
    ) -> PendingStep:
        """Sample the rows that sample (logits [S, V]; more with proposals); queue their tokens' copy to the host.
        The batch counts tokens in flight too (min_tokens, penalties), so sampling never waits for the last step."""
        if not is_driver():  # only the driver samples; the others take its tokens (their next inputs)
            out, verified = spec_rows.driver_tokens(self.link, len(request_ids), spec)
        else:
            assert logits is not None
            masks = self._token_bitmask(request_ids, states, spec)
            if spec is None:
                out, verified = self.sampler(logits, self.sampling.batch(request_ids), masks), None
            else:  # proposal rows are verified (`worker/spec_rows.py`)
                out, verified = spec_rows.sample(self.sampler, self.sampling, logits, request_ids, spec, masks)
            self.sampling.update(out.sampled_token_ids, verified.earlier if verified is not None else None)
            self.link.share_tokens(spec_rows.shared_tokens(out, verified))
        if verified is not None and self.state_pool is not None:  # each row's state after its last kept token
            spec_rows.roll_back_states(self.state_pool, states, spec, verified)
        for row, s in enumerate(states):
            s.num_pending += 1
            s.pending_row = row
        self._last_sampled = out.sampled_token_ids
        self._last_step = PendingStep(request_ids, states, out, verified=verified)
        return self._last_step

    def _token_bitmask(self, request_ids: list[str], states: list[RunnerRequestState], spec=None) -> Any:
        """Constrained rows' allowed tokens (with proposals: at each proposal's position), or None. Runs after the
        step's forward pass is queued, so the grammar work overlaps it on a GPU; a row still waiting for the last
        step's token (async scheduling) makes this wait for that step's samples, which the grammar must see
        first."""
        masks = self.token_masks
        if masks is None or not masks.any_constrained(request_ids):
            return None
        if self._last_step is not None and any(s.num_pending for s in states):
            self._last_step.result()
        return masks.fill(request_ids, [s.output_token_ids for s in states], spec and spec.proposals)
