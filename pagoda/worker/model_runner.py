"""The only part of the engine that touches the model and its tensors.

`launch(SchedulerOutput) -> PendingStep`: update per-request state from the scheduler's diff,
build the flattened inputs (token ids, positions, slot mapping, block tables — no padding), queue
the model, logits only for rows that sample, and the batched sampling on the device; nothing on
this path waits for the GPU. `PendingStep.result() -> StepOutput` waits for that step's tokens.
`execute` = both at once.

Async scheduling launches step N+1 before step N's result is read: a row whose input token is
step N's sample (`num_pending`) gets a placeholder on the host and the real id from step N's
device tensor (`_last_sampled`) by one gather on the GPU, so the host never waits for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagoda import envs
from pagoda.config import EngineConfig
from pagoda.device_copy import to_device
from pagoda.distributed.parallel_state import all_reduce_max, broadcast_tensor, is_driver, tp_world_size
from pagoda.inputs import MultiModalInputs
from pagoda.kernels import dispatch
from pagoda.layers.attention import FP8_KV, AttentionBackend, AttentionBatch, StepAttention
from pagoda.layers.sampler import Sampler, SamplerOutput, SamplingState
from pagoda.layers.sequence_state import SequenceStateBatch
from pagoda.layers.torch_attention import TorchAttentionBackend
from pagoda.layers.triton_attention import TritonAttentionBackend
from pagoda.models.loader import load_model
from pagoda.models.source import ModelSource
from pagoda.outputs import SchedulerOutput, StepOutput, TokenLogprobs
from pagoda.sampling_params import SamplingParams
from pagoda.worker.cuda_graphs import DecodeGraphs, DecodeInputs, StepGraphs, StepInputs
from pagoda.worker.encoder_cache import EncoderCache
from pagoda.worker.memory import KVCacheLayout, KVCacheSpec, kv_cache_spec
from pagoda.worker.state_slots import StateSlotPool

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class RunnerRequestState:
    token_ids: list[int]  # prompt + outputs sampled so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    generator: torch.Generator | None  # per-request RNG when the request has a seed
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None  # per-sequence state slot while running (stateful models)
    mm_inputs: MultiModalInputs | None = None  # images/videos and M-RoPE positions (multimodal models)
    num_pending: int = 0  # tokens sampled by launched steps, not yet in token_ids
    pending_row: int = -1  # the newest one's row in the last launched step's samples


class PendingStep:
    """A launched step's sampled tokens (and logprobs): device → pinned host copies queued right
    after sampling, an event after them. `result()` waits for that event only — not for a later
    step queued behind it — then appends the tokens to the request states, once."""

    def __init__(
        self, request_ids: list[str], states: list[RunnerRequestState], out=None, done: StepOutput | None = None
    ):
        self.request_ids, self.states = request_ids, states
        self._output = done
        self._event = None
        if out is None:
            return
        cuda = out.sampled_token_ids.is_cuda
        tensors = (
            out.sampled_token_ids,
            out.sampled_logprobs,
            out.top_logprobs,
            out.top_token_ids,
            out.chosen_logprobs,
        )
        # non_blocking device→host copies land in pinned memory; plain CPU tensors pass through.
        self._host = [t.to("cpu", non_blocking=True) if t is not None and cuda else t for t in tensors]
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    @property
    def done(self) -> bool:
        return self._output is not None

    def result(self) -> StepOutput:
        if self._output is not None:
            return self._output
        if self._event is not None:
            self._event.synchronize()
        tokens, sampled_lp, top_lp, top_ids, chosen_lp = self._host
        sampled = tokens.tolist()
        result = StepOutput(dict(zip(self.request_ids, sampled)))
        if sampled_lp is not None:
            sampled_lp = sampled_lp.tolist()
            top_lp = top_lp.tolist() if top_lp is not None else None
            top_ids = top_ids.tolist() if top_ids is not None else None
            chosen_lp = chosen_lp.tolist() if chosen_lp is not None else None
            for row, (rid, s) in enumerate(zip(self.request_ids, self.states)):
                k = s.sampling_params.logprobs
                if k is None:
                    continue
                chosen = s.sampling_params.logprob_token_ids
                if chosen and chosen_lp is not None:  # the request's own tokens instead of the top k
                    top = list(zip(chosen, chosen_lp[row][: len(chosen)]))
                else:
                    top = list(zip(top_ids[row][:k], top_lp[row][:k])) if top_ids is not None and k else []
                result.logprobs[rid] = TokenLogprobs(sampled_lp[row], top)
        for s, token in zip(self.states, sampled):
            s.token_ids.append(token)
            s.output_token_ids.append(token)
            s.num_pending -= 1
        self._output = result
        return result


_NO_TOKENS = StepOutput({})


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
        self.cache_dtype = FP8_KV if config.cache.kv_cache_dtype == "fp8" else self.dtype  # "auto": the model's
        self.block_size = config.cache.block_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.model = load_model(
            source,
            config.model.max_model_len,
            self.dtype,
            config.device.device,
            config.model.load_format,
            config.model.quantization,
        )
        self.vocab_size = config.model.vocab_size
        unique = {id(p): p for p in self.model.parameters()}  # tied weights once
        self.weight_bytes = sum(p.numel() * p.element_size() for p in unique.values())  # this rank's share
        self.backend = backend or self._make_backend(config.device.attention_backend)
        if self.cache_dtype == FP8_KV:
            self._log_kv_scales()
        self.sampler = Sampler()
        # Per-request sampling rows kept across steps: a step's batch is a gather, and the penalties'
        # token history lives on the device (updated with each step's samples, no host round trip).
        self.sampling = SamplingState(config.scheduler.max_num_seqs, self.vocab_size, self.device, self.eos_token_ids)
        self.states: dict[str, RunnerRequestState] = {}
        # (request id, stage, exception) of new requests whose per-request setup raised: left out of
        # the step; the engine ends them with an error (`take_failures`).
        self.failures: list[tuple[str, str, Exception]] = []
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        stateful = getattr(self.model, "sequence_state_layers", list)()
        self.state_pool = (
            StateSlotPool(stateful, config.scheduler.max_num_seqs, self.dtype, self.device) if stateful else None
        )
        # Snapshots per block make prefix-cache hits exact for stateful models.
        self.state_snapshots = self.state_pool is not None and config.cache.enable_prefix_caching
        self.accepts_multimodal = hasattr(self.model, "encode")
        self.uses_mrope = bool(getattr(self.model, "uses_mrope", False))
        self.encoder_cache = EncoderCache(max(32768, 4 * config.scheduler.max_num_batched_tokens))
        self.decode_graphs: DecodeGraphs | None = None  # set by `enable_decode_graphs`
        self.step_graphs: StepGraphs | None = None  # mixed steps, likewise
        self._last_sampled: torch.Tensor | None = None  # its token ids, on the device
        self._last_step: PendingStep | None = None  # the last launched step's samples
        # Structured output (`frontend.structured_output.manager.GrammarManager`, set by the engine on
        # the first constrained request): fills the allowed-token bitmask of constrained rows.
        self.token_masks: Any = None
        self._arange: torch.Tensor | None = None  # 0, 1, 2, ... on the device (`_late_tokens`)

    @staticmethod
    def _make_backend(name: str) -> AttentionBackend:
        if name == "triton":
            return TritonAttentionBackend()
        return TorchAttentionBackend()

    # ---- KV cache -----------------------------------------------------------------------------
    def kv_cache_spec(self) -> KVCacheSpec:
        return kv_cache_spec(
            self.model,
            torch.tensor([], dtype=self.dtype).element_size(),
            self.config.cache.enable_prefix_caching,
            torch.tensor([], dtype=self.cache_dtype).element_size(),
        )

    def _log_kv_scales(self) -> None:
        layers = self.model.attention_layers()
        scaled = [layer for layer in layers if (layer.k_scale, layer.v_scale) != (1.0, 1.0)]
        if scaled:
            k = [layer.k_scale for layer in scaled]
            v = [layer.v_scale for layer in scaled]
            logger.info(
                "FP8 KV cache: the checkpoint's scales in %d of %d layers (k %.4g..%.4g, v %.4g..%.4g)",
                len(scaled),
                len(layers),
                min(k),
                max(k),
                min(v),
                max(v),
            )
        else:
            logger.info(
                "FP8 KV cache: the checkpoint has no k_scale/v_scale: every scale is 1.0 (values beyond ±448 saturate)"
            )

    def initialize_kv_cache(self, layout: KVCacheLayout) -> None:
        """Allocate K and V [num_blocks, block_size, Hkv, D] per layer, in the cache dtype, and bind
        them to the layers.

        Uninitialised (zeroing gigabytes costs seconds at startup): the null block 0 is zeroed
        here, every other block when it is handed out (`_zero_blocks`) if the attention backend
        reads past a request's length (`needs_zeroed_blocks`; the Triton kernels never do)."""
        self.kv_caches = []
        for layer in self.model.attention_layers():
            shape = (layout.num_blocks, layout.block_size, layer.num_kv_heads, layer.head_dim)
            k = torch.empty(shape, dtype=self.cache_dtype, device=self.device)
            v = torch.empty(shape, dtype=self.cache_dtype, device=self.device)
            k[0].zero_()
            v[0].zero_()
            layer.bind_kv_cache(k, v)
            self.kv_caches.append((k, v))
        if self.state_snapshots:
            self.state_pool.allocate_snapshots(layout.num_blocks)

    def warm_up_attention(self) -> None:
        """Let the attention backend compile its kernels for this model's attention shapes now, before
        the first request (see `AttentionBackend.warm_up`)."""
        shapes = {(layer.num_heads, layer.num_kv_heads, layer.head_dim) for layer in self.model.attention_layers()}
        self.backend.warm_up(shapes, self.block_size, self.dtype, self.device, self.cache_dtype)

    def enable_decode_graphs(
        self, capture: bool = True, buckets: list[int] | None = None, token_buckets: list[int] | None = None
    ) -> None:
        """Run pure decode steps of up to max_num_seqs rows, and mixed steps of up to 2047 tokens,
        from static buffers, replaying CUDA graphs captured now (capture=False: the same buffers, run
        eagerly — for tests on the CPU). Call after `initialize_kv_cache` with the real cache: graphs
        hold the cache's addresses."""
        if self.backend.name != "triton":
            raise ValueError("decode graphs need the Triton attention backend")
        if not getattr(self.model, "supports_cuda_graphs", True):
            logger.info("%s cannot be captured in CUDA graphs: decode steps run eagerly", type(self.model).__name__)
            return
        cfg = self.config
        self.decode_graphs = DecodeGraphs(
            self.model,
            self.backend,
            cfg.scheduler.max_num_seqs,
            -(-cfg.model.max_model_len // self.block_size),
            self.block_size,
            cfg.model.max_model_len,
            self.device,
            self.state_pool.scratch_slot if self.state_pool is not None else None,
            self.state_snapshots,
            self.uses_mrope,
            buckets,
            capture,
        )
        self.decode_graphs.capture_all()
        if not envs.MIXED_STEP_GRAPHS.value:  # A/B switch: mixed steps eager
            return
        from pagoda.kernels.attention.prefill import prefill_block_m  # lazy: triton (fixes TRITON_INTERPRET mode)

        self.step_graphs = StepGraphs(
            self.model,
            self.backend,
            cfg.scheduler.max_num_seqs,
            cfg.scheduler.max_num_batched_tokens,
            -(-cfg.model.max_model_len // self.block_size),
            self.block_size,
            prefill_block_m(),
            self.device,
            self.state_pool.scratch_slot if self.state_pool is not None else None,
            self.state_snapshots,
            self.uses_mrope,
            token_buckets,
            capture,
            cfg.model.max_model_len,
        )
        self.step_graphs.capture_all()

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int) -> int:
        """Run one worst-case step (num_tokens prompt tokens, a throwaway cache) and return the
        peak bytes PyTorch allocated on the GPU, weights included."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        spec = self.kv_cache_spec()
        num_blocks = -(-num_tokens // self.block_size) + 1
        self.initialize_kv_cache(KVCacheLayout(num_blocks, self.block_size, 0))
        block_table = torch.arange(1, num_blocks, device=self.device)[None, :]
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        # Positions wrap at max_model_len: the step budget may exceed the model's context (RoPE table).
        pos = torch.arange(num_tokens, device=self.device) % self.config.model.max_model_len
        batch = AttentionBatch(
            [num_tokens],
            [num_tokens],
            torch.tensor([0, num_tokens], device=self.device),
            torch.tensor([num_tokens], device=self.device),
            block_table,
            torch.arange(num_tokens, device=self.device) + self.block_size,
            self.block_size,
        )
        state = None
        if self.state_pool is not None:
            state = self._state_batch(
                [0], np.array([0, num_tokens]), pos.cpu().numpy(), batch.slot_mapping.cpu().numpy()
            )
        with dispatch.pdl_for_rows(num_tokens):  # as an eager step of this size runs (and so compiles) them
            hidden = self.model(ids, pos, StepAttention(self.backend, self.backend.prepare(batch), state))
            self.model.compute_logits(hidden[-1:])
            if self.accepts_multimodal:
                self._profile_encoder(num_tokens)
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

    def _profile_encoder(self, num_tokens: int) -> None:
        """The vision tower's peak for one image of up to `num_tokens` placeholder tokens (a square
        grid; capped at 16384, the largest image the checkpoint defaults allow)."""
        side = max(1, int(min(num_tokens, 16384) ** 0.5))
        merge = self.model.merge_size
        grid = (1, side * merge, side * merge)
        width = self.model.visual.patch_embed.proj.weight.shape[1]
        pixels = torch.zeros(grid[1] * grid[2], width, dtype=self.dtype, device=self.device)
        self.model.encode(pixels, [grid])

    # ---- one step -----------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        fresh: list[int] = []  # blocks handed out for new content this step (not prefix-cache hits)
        for request_id in so.finished_request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                self._release_slot(state)
            self.sampling.remove(request_id)
            if self.token_masks is not None:
                self.token_masks.remove(request_id)
        for request_id in so.preempted_request_ids:
            if request_id in self.states:
                self._release_slot(self.states[request_id])
        for new in so.new_requests:
            fresh += new.block_ids[new.num_computed_tokens // self.block_size :]
            params = new.sampling_params
            try:
                generator = None
                if params.seed is not None:
                    generator = torch.Generator(device=self.device).manual_seed(params.seed)
                self.sampling.add(new.request_id, params, new.prompt_token_ids, generator=generator)
            except Exception as exc:  # noqa: BLE001 - this request fails; the step runs without it
                self.failures.append((new.request_id, "setting up its sampling", exc))
                continue
            self.states[new.request_id] = state = RunnerRequestState(
                list(new.prompt_token_ids),
                len(new.prompt_token_ids),
                params,
                list(new.block_ids),
                generator,
                new.num_computed_tokens,
                mm_inputs=new.mm_inputs,
            )
            self._acquire_slot(state)
        for cached in so.cached_requests:
            state = self.states[cached.request_id]
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.resumed:
                state.block_ids = list(cached.new_block_ids)
                fresh += cached.new_block_ids[cached.num_computed_tokens // self.block_size :]
                self._acquire_slot(state)
            else:
                state.block_ids.extend(cached.new_block_ids)
                fresh += cached.new_block_ids
        if fresh and self.backend.needs_zeroed_blocks:
            self._zero_blocks(fresh)

    def _acquire_slot(self, state: RunnerRequestState) -> None:
        """A (re)admitted sequence's state: zero, or the snapshot at the end of its prefix-cache hit."""
        if self.state_pool is None:
            return
        state.state_slot = self.state_pool.acquire()
        if state.num_computed_tokens:
            last_cached_block = state.block_ids[state.num_computed_tokens // self.block_size - 1]
            self.state_pool.restore(state.state_slot, last_cached_block)

    def _release_slot(self, state: RunnerRequestState) -> None:
        if self.state_pool is not None and state.state_slot is not None:
            self.state_pool.release(state.state_slot)
            state.state_slot = None

    def _state_batch(
        self, slots: list[int], query_start_loc: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray
    ) -> SequenceStateBatch:
        return SequenceStateBatch.build(
            slots, query_start_loc, positions, slot_mapping, self.block_size, self.state_snapshots, self.device
        )

    def _zero_blocks(self, blocks: list[int]) -> None:
        """A block's unwritten tail is read (then masked) by block-granular attention; zero it on
        hand-out so stale or uninitialised memory can never inject NaN (0 * NaN = NaN)."""
        index = to_device(np.asarray(blocks, dtype=np.int64), self.device)
        for k, v in self.kv_caches:
            if k.element_size() == 1:  # fp8: index_fill_ has no fp8 kernel; all-zero bits are +0.0
                k, v = k.view(torch.uint8), v.view(torch.uint8)
            k.index_fill_(0, index, 0)
            v.index_fill_(0, index, 0)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits [n, V] (float32, CPU) of one text-only sequence, every position, in
        one prefill over KV blocks 1.. of the cache: for accuracy checks (tests, the quantization
        accuracy benchmark) on an idle engine. Needs ceil(n / block_size) free blocks past the null one."""
        n, bs = len(token_ids), self.block_size
        blocks = torch.arange(1, -(-n // bs) + 1, device=self.device)
        self._zero_blocks(blocks.tolist())  # as for every block handed out
        pos = torch.arange(n, device=self.device)
        batch = AttentionBatch(
            [n],
            [n],
            torch.tensor([0, n], device=self.device),
            torch.tensor([n], device=self.device),
            blocks[None, :],
            blocks[pos // bs] * bs + pos % bs,
            bs,
        )
        ids = torch.tensor(token_ids, device=self.device)
        hidden = self.model(ids, pos, StepAttention(self.backend, self.backend.prepare(batch)))
        return self.model.compute_logits(hidden).float().cpu()

    def set_token_masks(self, masks: Any) -> None:
        self.token_masks = masks

    def shutdown(self) -> None:
        """Nothing to stop on one rank (`TensorParallelRunner.shutdown` stops the others)."""

    def take_failures(self) -> list[tuple[str, str, Exception]]:
        failures, self.failures = self.failures, []
        return failures

    def execute(self, so: SchedulerOutput) -> StepOutput:
        """Run one step to the end: launch it and wait for its tokens."""
        return self.launch(so).result()

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> PendingStep:
        """Queue one step on the device. At most one earlier step may still be unread (its
        tokens feed this one's pending rows on the device). Eager kernels use PDL as a captured
        graph of the same size would (`dispatch.pdl_for_rows`); graphs have theirs baked in."""
        with dispatch.pdl_for_rows(so.total_num_scheduled_tokens):
            return self._launch(so)

    def _launch(self, so: SchedulerOutput) -> PendingStep:
        self._update_states(so)
        scheduled = so.num_scheduled_tokens
        if self.failures:  # requests whose setup failed are left out of the batch
            scheduled = {rid: n for rid, n in scheduled.items() if rid in self.states}
        if not scheduled:
            return PendingStep([], [], done=_NO_TOKENS)
        request_ids = list(scheduled)
        states = [self.states[rid] for rid in request_ids]
        if (
            self.decode_graphs is not None
            and sum(scheduled.values()) == len(states)
            and len(states) <= self.decode_graphs.max_rows
        ):
            return self._execute_decode_graph(request_ids, states)
        query_lens = [scheduled[rid] for rid in request_ids]
        starts = [s.num_computed_tokens for s in states]
        seq_lens = [a + n for a, n in zip(starts, query_lens)]

        # A row ending past its known tokens ends on its pending token: a placeholder here, the
        # real id gathered on the device (`_late_tokens`).
        late_rows = [i for i, (s, e) in enumerate(zip(states, seq_lens)) if e > len(s.token_ids)]
        token_ids = np.concatenate(
            [
                np.asarray(s.token_ids[a:e] + [0] * (e - max(a, len(s.token_ids))), dtype=np.int64)
                if e > len(s.token_ids)
                else np.asarray(s.token_ids[a:e], dtype=np.int64)
                for s, a, e in zip(states, starts, seq_lens)
            ]
        )
        positions = np.concatenate([np.arange(a, e, dtype=np.int64) for a, e in zip(starts, seq_lens)])
        max_blocks = max(len(s.block_ids) for s in states)
        tables = np.zeros((len(states), max_blocks), dtype=np.int64)  # padded with the null block
        for row, s in enumerate(states):
            tables[row, : len(s.block_ids)] = s.block_ids
        row_of_token = np.repeat(np.arange(len(states)), query_lens)
        slots = tables[row_of_token, positions // self.block_size] * self.block_size + positions % self.block_size
        query_start_loc = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])

        late = self._late_tokens(states, late_rows, query_start_loc[1:][late_rows] - 1 if late_rows else None)
        if (
            self.step_graphs is not None
            and self.step_graphs.bucket(len(token_ids)) is not None
            and not self._needs_encoder(states, starts, seq_lens)
        ):
            return self._execute_step_graph(
                request_ids,
                states,
                token_ids,
                positions,
                slots,
                tables,
                query_start_loc,
                query_lens,
                seq_lens,
                starts,
                late,
            )
        dev = self.device
        batch = AttentionBatch(
            query_lens=query_lens,
            seq_lens=seq_lens,
            query_start_loc=torch.from_numpy(query_start_loc).to(dev),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_size=self.block_size,
        )
        positions_t = torch.from_numpy(positions).to(dev)
        state = None
        if self.state_pool is not None:
            state = self._state_batch([s.state_slot for s in states], query_start_loc, positions, slots)
        attn = StepAttention(self.backend, self.backend.prepare(batch), state)
        if self.uses_mrope and any(s.mm_inputs is not None for s in states):
            attn.mrope_positions = torch.from_numpy(self._mrope_positions(states, starts, seq_lens)).to(dev)
            attn.mm_embeds = self._multimodal_embeds(states, starts, seq_lens, query_start_loc)
        ids_t = to_device(token_ids, dev)
        if late is not None:
            ids_t.index_copy_(0, *late)
        hidden = self.model(ids_t, positions_t, attn)

        # Only a request whose last uncomputed token is in this step samples.
        sample_rows = [i for i, s in enumerate(states) if seq_lens[i] == len(s.token_ids) + s.num_pending]
        for i in range(len(states)):
            states[i].num_computed_tokens = seq_lens[i]
        if not sample_rows:
            return PendingStep([], [], done=_NO_TOKENS)
        last_token = to_device(query_start_loc[1:][sample_rows] - 1, dev)
        logits = self.model.compute_logits(hidden[last_token])
        return self._sample([request_ids[i] for i in sample_rows], [states[i] for i in sample_rows], logits)

    def _late_tokens(
        self, states: list[RunnerRequestState], rows: list[int] | np.ndarray, flat_index: np.ndarray | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat token index, token id) on the device for rows whose input is the last launched
        step's sample, not yet on the host; None when every input token is known."""
        if not len(rows):
            return None
        src = []
        for i in rows:
            s = states[i]
            assert s.num_pending == 1 and self._last_sampled is not None, "a pending token from an older step"
            src.append(s.pending_row)
        # The steady state of a batch that keeps its rows (always at batch 1): row i takes sample i
        # into token i. Then a slice and a cached index stand in for the gather and the two
        # host-to-device copies (each a few µs of a GPU-bound batch-1 step).
        src_np = np.asarray(src, dtype=np.int64)
        flat_np = np.asarray(flat_index, dtype=np.int64)
        n = len(src_np)
        ascending = np.arange(n)
        values = (
            self._last_sampled[:n]
            if np.array_equal(src_np, ascending)
            else self._last_sampled.index_select(0, to_device(src_np, self.device))
        )
        index = self._device_arange(n) if np.array_equal(flat_np, ascending) else to_device(flat_np, self.device)
        return index, values

    def _device_arange(self, n: int) -> torch.Tensor:
        """torch.arange(n) on the device, sliced from one cached tensor."""
        if self._arange is None or self._arange.numel() < n:
            self._arange = torch.arange(max(n, 256), dtype=torch.int64, device=self.device)
        return self._arange[:n]

    def _execute_decode_graph(self, request_ids: list[str], states: list[RunnerRequestState]) -> StepOutput:
        """A step where every row has exactly one token: static buffers + a captured graph."""
        positions = np.fromiter((s.num_computed_tokens for s in states), np.int64, len(states))
        known = np.fromiter((len(s.token_ids) for s in states), np.int64, len(states))
        token_ids = np.fromiter(
            (s.token_ids[p] if p < k else 0 for s, p, k in zip(states, positions.tolist(), known.tolist())),
            np.int64,
            len(states),
        )
        late_rows = np.flatnonzero(positions >= known)
        bs = self.block_size
        block_of = np.fromiter(
            (s.block_ids[p // bs] for s, p in zip(states, positions.tolist())), np.int64, len(states)
        )
        inputs = DecodeInputs(
            token_ids,
            positions,
            block_of * bs + positions % bs,
            [s.block_ids for s in states],
            late_tokens=self._late_tokens(states, late_rows, late_rows),
        )
        if self.state_pool is not None:
            inputs.state_slots = np.fromiter((s.state_slot for s in states), np.int64, len(states))
        if self.uses_mrope and any(s.mm_inputs is not None for s in states):
            ends = (positions + 1).tolist()
            inputs.mrope_positions = self._mrope_positions(states, positions.tolist(), ends)
        logits = self.decode_graphs.run(inputs)
        # A one-token row samples unless it is a 1-token prefill chunk short of its prompt's end.
        return self._sample_rows_of(request_ids, states, (positions + 1).tolist(), logits)

    def _sample_rows_of(
        self, request_ids: list[str], states: list[RunnerRequestState], seq_lens: list[int], logits: torch.Tensor
    ) -> PendingStep:
        """After a graph step with logits [B, V] for every row's last token: advance each row to its
        new length and sample the rows that reached the end of their known tokens."""
        sample_rows = [i for i, s in enumerate(states) if seq_lens[i] == len(s.token_ids) + s.num_pending]
        for s, n in zip(states, seq_lens):
            s.num_computed_tokens = n
        if not sample_rows:
            return PendingStep([], [], done=_NO_TOKENS)
        if len(sample_rows) < len(states):
            logits = logits[to_device(np.asarray(sample_rows, dtype=np.int64), logits.device)]
        return self._sample([request_ids[i] for i in sample_rows], [states[i] for i in sample_rows], logits)

    @staticmethod
    def _needs_encoder(states: list[RunnerRequestState], starts: list[int], ends: list[int]) -> bool:
        return any(
            s.mm_inputs is not None and any(item.overlaps(a, e) for item in s.mm_inputs.items)
            for s, a, e in zip(states, starts, ends)
        )

    def _execute_step_graph(
        self,
        request_ids: list[str],
        states: list[RunnerRequestState],
        token_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        tables: np.ndarray,
        query_start_loc: np.ndarray,
        query_lens: list[int],
        seq_lens: list[int],
        starts: list[int],
        late: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> PendingStep:
        """A mixed step (no encoder work) through the token-bucket graphs; same inputs as eager."""
        from pagoda.kernels.attention.prefill import prefill_tile_arrays  # lazy: triton (fixes TRITON_INTERPRET mode)

        graphs = self.step_graphs
        # Tiles for the multi-token rows; one-token rows go through the decode kernel.
        req, m0 = prefill_tile_arrays(query_lens, [i for i, n in enumerate(query_lens) if n > 1], graphs.block_m)
        inputs = StepInputs(
            token_ids,
            positions,
            slots,
            query_start_loc,
            np.asarray(seq_lens, dtype=np.int64),
            tables,
            req,
            m0,
            late_tokens=late,
        )
        if self.state_pool is not None:
            inputs.state_slots = np.fromiter((s.state_slot for s in states), np.int64, len(states))
            if self.state_snapshots:
                ends = np.flatnonzero(positions % self.block_size == self.block_size - 1)
                inputs.snapshot_tokens, inputs.snapshot_blocks = ends, slots[ends] // self.block_size
        if self.uses_mrope and any(s.mm_inputs is not None for s in states):
            inputs.mrope_positions = self._mrope_positions(states, starts, seq_lens)
        return self._sample_rows_of(request_ids, states, seq_lens, graphs.run(inputs))

    @staticmethod
    def _mrope_positions(states: list[RunnerRequestState], starts: list[int], ends: list[int]) -> np.ndarray:
        """[3, T]: prompt tokens from each request's precomputed table, the rest (generated tokens,
        text-only requests) at index + rope delta on all three axes."""
        parts = []
        for s, a, e in zip(states, starts, ends):
            table = s.mm_inputs.mrope_positions if s.mm_inputs is not None else None
            known = min(e, table.shape[1]) if table is not None else a
            if known > a:
                parts.append(table[:, a:known])
            if e > known:
                delta = s.mm_inputs.mrope_delta if s.mm_inputs is not None else 0
                parts.append(np.broadcast_to(np.arange(max(a, known), e) + delta, (3, e - max(a, known))))
        return np.ascontiguousarray(np.concatenate(parts, axis=1))

    def _multimodal_embeds(
        self, states: list[RunnerRequestState], starts: list[int], ends: list[int], query_start_loc: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Encoder rows for the placeholder tokens in this step, and their flat token indices.

        Every item overlapping a row's scheduled range [start, end) needs its whole encoder output
        (the vision tower is never run on part of an item): taken from the encoder cache, or
        computed now for all missing items in one batched call. A chunk boundary may cut an item;
        each chunk takes its slice of the rows."""
        needed = [
            (row, item)
            for row, (s, a, e) in enumerate(zip(states, starts, ends))
            if s.mm_inputs is not None
            for item in s.mm_inputs.items
            if item.overlaps(a, e)
        ]
        if not needed:
            return None
        outputs: dict[bytes, torch.Tensor] = {}
        missing = []
        for _, item in needed:
            if item.content_hash in outputs:
                continue
            cached = self.encoder_cache.get(item.content_hash)
            if cached is not None:
                outputs[item.content_hash] = cached
            elif all(m.content_hash != item.content_hash for m in missing):
                missing.append(item)
        if missing:
            pixels = torch.cat([encoder_pixels(m.pixel_values, m.pixel_lut, self.device) for m in missing])
            encoded = self.model.encode(pixels, [m.grid_thw for m in missing])
            for item, rows in zip(missing, encoded.split([m.length for m in missing])):
                outputs[item.content_hash] = rows
                self.encoder_cache.put(item.content_hash, rows)
        index, embeds = [], []
        for row, item in needed:
            lo, hi = max(starts[row], item.offset), min(ends[row], item.end)
            first = int(query_start_loc[row]) + lo - starts[row]
            index.append(np.arange(first, first + hi - lo))
            embeds.append(outputs[item.content_hash][lo - item.offset : hi - item.offset])
        return to_device(np.concatenate(index), self.device), torch.cat(embeds)

    def _sample(self, request_ids: list[str], states: list[RunnerRequestState], logits: torch.Tensor) -> PendingStep:
        # The batch counts tokens still in flight too (min_tokens; the penalties' device history
        # already holds them), so sampling never waits for the step before.
        if tp_world_size() > 1 and not is_driver():
            # Only the driver samples; the other ranks take its tokens (they feed the next step's inputs).
            tokens = broadcast_tensor(torch.empty(len(request_ids), dtype=torch.int64, device=logits.device))
            out = SamplerOutput(tokens, None, None, None)
        else:
            batch = self.sampling.batch(request_ids)
            out = self.sampler(logits, batch, self._token_bitmask(request_ids, states))
            self.sampling.update(out.sampled_token_ids)
            if tp_world_size() > 1:
                broadcast_tensor(out.sampled_token_ids)
        for row, s in enumerate(states):
            s.num_pending += 1
            s.pending_row = row
        self._last_sampled = out.sampled_token_ids
        self._last_step = PendingStep(request_ids, states, out)
        return self._last_step

    def _token_bitmask(self, request_ids: list[str], states: list[RunnerRequestState]) -> Any:
        """Constrained rows' allowed tokens, or None. Runs after the step's forward pass is queued, so
        the grammar work overlaps it on a GPU; a row still waiting for the last step's token (async
        scheduling) makes this wait for that step's samples, which the grammar must see first."""
        masks = self.token_masks
        if masks is None or not masks.any_constrained(request_ids):
            return None
        if self._last_step is not None and any(s.num_pending for s in states):
            self._last_step.result()
        return masks.fill(request_ids, [s.output_token_ids for s in states])


def encoder_pixels(pixel_values: np.ndarray, pixel_lut: np.ndarray | None, device: torch.device) -> torch.Tensor:
    """One item's encoder input on `device`, float32 [P, C * T * p * p]: uint8 levels cross to the device
    as they are (a quarter of float32's bytes, no host-device sync) and are normalised there by a gather
    from the per-channel table, bit for bit what the host's `normalize_levels` gives; float32 patches
    (`pixel_lut` None) are copied as they are."""
    if pixel_lut is None:
        return to_device(pixel_values, device)
    levels = to_device(pixel_values, device)  # uint8 [P, D]
    table = to_device(pixel_lut.astype(np.float32, copy=False), device).reshape(-1)  # [C * 256]
    channels, width = pixel_lut.shape[0], pixel_values.shape[1]
    column_base = (torch.arange(width, device=levels.device) // (width // channels)) * 256  # [D]
    return table[levels.long() + column_base]
