"""The synchronous engine core: add requests, step, abort.

`step()` = schedule → run the model → update request state → turn tokens into outputs. With async
scheduling (the default on CUDA) `step()` schedules and launches step N+1 first and only then reads
step N's tokens: the host work of each step (update, detokenize, send, schedule, input prep) runs
while the GPU computes the next one. With pipeline micro-batches (`SchedulerConfig.micro_batches` = P)
up to P steps of disjoint requests are launched before the oldest is read, so every stage has work.
Startup sizes the KV pool (from a GPU profile or the CPU budget), logs it, and refuses to start
when one max_model_len request could not fit.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from pagoda import envs
from pagoda.config import EngineConfig
from pagoda.config.engine import derived_max_model_len
from pagoda.engine.block_manager import BlockManager
from pagoda.engine.output_processor import OutputProcessor, child_request_id
from pagoda.engine.scheduler import Scheduler
from pagoda.engine.speculation import Speculator, draft_engine_args
from pagoda.engine.validation import check_priority, validate_request
from pagoda.errors import ConfigError, InvalidRequest
from pagoda.frontend.structured_output.grammars import check_structured_outputs
from pagoda.frontend.structured_output.manager import GrammarManager
from pagoda.frontend.tokenizer import load_tokenizer, tokenizer_info
from pagoda.kernels import policy
from pagoda.lora.manager import LoRAManager
from pagoda.lora.request import LoRARequest
from pagoda.models.source import resolve_model_source
from pagoda.outputs import EngineStats, RequestOutput, SchedulerOutput
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.worker import memory
from pagoda.worker.pending_step import LaunchedStep
from pagoda.worker.tensor_parallel import make_runner

logger = logging.getLogger("pagoda")


class LLMEngine:
    def __init__(self, config: EngineConfig, on_fatal: Callable[[str], None] | None = None):
        """on_fatal(line): told when a tensor-parallel rank is gone or hung, just before this process exits
        (the engine core tells the launcher and the API processes)."""
        self.config = config
        torch.manual_seed(config.model.seed)
        self.source = resolve_model_source(config.model.model)
        self.tokenizer: Any | None = None
        if not config.model.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(self.source, config.model.tokenizer, config.model.trust_remote_code)
        self.token_info = tokenizer_info(self.tokenizer, self.source)
        # Structured output: the grammar engine's vocabulary table (seconds of Python at a 150k vocabulary,
        # holding the GIL) is built now, on the manager's thread while the weights load, and the engine
        # serves only once it is done: built by the first constrained request, it would hold up the loop's
        # every step meanwhile. A constrained request then waits outside the scheduler until its grammar
        # is compiled (`_admit_compiled`).
        self._grammars: GrammarManager | None = None
        if self.tokenizer is not None:
            self._grammars = GrammarManager(
                self.tokenizer,
                config.model.vocab_size,
                sorted(self.token_info.eos_token_ids),
                pin_memory=config.device.device == "cuda",
            )
        speculative = config.scheduler.speculative
        # The draft model first: on a GPU its weights, KV cache and graphs are then memory the target's profiling
        # finds in use, so the target's KV cache is sized from what the draft leaves.
        self.draft = self._draft_engine(speculative.draft_model) if speculative and speculative.draft_model else None
        self.runner = make_runner(config, self.source, set(self.token_info.eos_token_ids), on_fatal)
        self.kv_layout = self._size_kv_cache()
        self.runner.initialize_kv_cache(self.kv_layout)
        self.runner.warm_up_attention()
        if config.device.cuda_graphs:
            self.runner.enable_cuda_graphs()
        cache = config.cache
        # Copied hits need no per-sequence state (a stateful model's snapshots are kept per block) and pay only
        # while decode rows are attended in place (a step of at most CPU_KV_VIEW_MAX_ROWS of them).
        copy_hits = 0 if self.runner.kv_cache_spec().state_bytes_per_seq else cache.copied_prefix_hit_tokens
        self.block_manager = BlockManager(
            self.kv_layout.num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            keep_free_tokens=cache.freed_block_reserve_tokens,
            prefer_runs=config.device.device == "cpu",
            copy_hits_max_tokens=copy_hits,
            copy_hits_below=policy.CPU_KV_VIEW_MAX_ROWS,
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, set(self.token_info.eos_token_ids))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.speculator = Speculator(speculative, config.device.device, self.draft) if speculative else None
        # Launched, not yet read, oldest first; a step is read once this many are unread after a launch.
        self._inflight: collections.deque[tuple[SchedulerOutput, LaunchedStep]] = collections.deque()
        scheduler = config.scheduler
        self._max_unread = scheduler.micro_batches if scheduler.micro_batches > 1 else 1 + scheduler.async_scheduling
        self._device_wait_s = 0.0  # total seconds `step()` waited for sampled tokens (EngineStats)
        # A step read at once for its proposals leaves its outputs to be made while the next step runs
        # (`_process(defer=True)`): (the requests it updated, their logprobs, their accepted proposals' logprobs).
        self._defer_outputs = envs.SPEC_DEFERRED_OUTPUTS.value and self._max_unread > 1
        self._deferred: tuple[list[Request], Any, Any] | None = None
        # Tokens of each step since the last `stats()` (EngineStats); bounded, as offline nobody asks.
        self._step_tokens: collections.deque[int] = collections.deque(maxlen=1024)
        self._awaiting_grammar: dict[str, tuple[cf.Future, list[Request], float]] = {}
        self._rejected: list[tuple[str, str]] = []  # (request id, why): refused after add_request returned
        self._loras: dict[int, LoRARequest] = {}  # adapters read by the runner, by id
        self._lora_epochs: dict[int, int] = {}  # an id's epoch: its reads in place and removals so far
        self._releasing: set[int] = set()  # unloaded adapters whose last requests have not finished yet
        self.vocab_size = self.runner.vocab_size
        if self._grammars is not None:
            self.runner.set_token_masks(self._grammars)
            self._grammars.wait_ready()
        self._log_startup()

    # ---- startup ------------------------------------------------------------------------------
    def _size_kv_cache(self) -> memory.KVCacheLayout:
        cache, sched = self.config.cache, self.config.scheduler
        spec = self.runner.kv_cache_spec()
        block_size = cache.block_size
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
            source = "num_gpu_blocks_override"
        elif self.config.device.device == "cuda":
            peak = self.runner.profile_peak_memory(sched.max_num_batched_tokens)
            free, total = torch.cuda.mem_get_info()
            non_torch = (total - free) - torch.cuda.memory_reserved()
            num_blocks = memory.gpu_num_blocks(
                total, cache.gpu_memory_utilization, peak, max(non_torch, 0), spec, block_size
            )
            source = "gpu_memory_utilization"
        else:
            num_blocks = memory.cpu_num_blocks(
                cache.cpu_kv_cache_space_gib, spec, block_size, sched.max_num_seqs, sched.max_model_len
            )
            source = "cpu_kv_cache_space"
        needed = memory.blocks_for_request(sched.max_model_len, block_size)
        if num_blocks < needed:
            raise ConfigError(
                f"The KV cache holds {max(num_blocks - 1, 0) * block_size} tokens ({num_blocks} blocks from "
                f"{source}) but one max_model_len={sched.max_model_len} request needs {needed} blocks; raise "
                f"{source.replace('_', '-')} or lower --max-model-len.",
                source,
            )
        return memory.KVCacheLayout(num_blocks, block_size, memory.bytes_per_block(spec, block_size))

    def _log_startup(self) -> None:
        layout, cfg = self.kv_layout, self.config
        logger.info(
            "model=%s arch=%s dtype=%s device=%s",
            cfg.model.model,
            cfg.model.architecture,
            cfg.model.dtype,
            cfg.device.device,
        )
        logger.info(
            "KV cache (%s): %d blocks x %d tokens, %.1f KiB per block, %.2f GiB total",
            cfg.kv_cache_dtype_name,
            layout.num_blocks - 1,
            layout.block_size,
            layout.bytes_per_block / 1024,
            layout.total_bytes / memory.GiB,
        )
        logger.info(
            "Maximum concurrency for %d-token requests: %.2fx",
            cfg.model.max_model_len,
            layout.max_concurrency(cfg.model.max_model_len),
        )
        tp = cfg.parallel.tensor_parallel_size
        if tp > 1:
            logger.info(
                "Tensor parallel size %d: per rank %.2f GiB of weights and %.2f GiB of KV cache (%d blocks of %d "
                "KV heads per layer); --gpu-memory-utilization applies to each GPU",
                tp,
                self.runner.weight_bytes / memory.GiB,
                layout.total_bytes / memory.GiB,
                layout.num_blocks - 1,
                self.runner.kv_cache_spec().num_kv_heads,
            )
        if cfg.device.device == "cpu" and cfg.cache.gpu_memory_utilization_given:
            logger.warning(
                "--gpu-memory-utilization %g does not apply on the CPU: --cpu-kv-cache-space-gib "
                "sets the CPU KV cache budget (%g GiB now)",
                cfg.cache.gpu_memory_utilization,
                cfg.cache.cpu_kv_cache_space_gib,
            )
        spec = self.runner.kv_cache_spec()
        if spec.state_bytes_per_seq:
            logger.info(
                "Per-sequence state (LF): %.1f KiB x %d slots = %.2f MiB, counted in the KV budget; prefix caching %s",
                spec.state_bytes_per_seq / 1024,
                cfg.scheduler.max_num_seqs,
                spec.state_pool_bytes(cfg.scheduler.max_num_seqs) / 2**20,
                f"stores a {spec.snapshot_bytes_per_block / 1024:.1f} KiB state snapshot per block"
                if spec.snapshot_bytes_per_block
                else "is off",
            )

    # ---- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequest(
                "Text prompts need a tokenizer, but skip_tokenizer_init=True; send "
                "{'prompt_token_ids': [...]} instead.",
                "prompt",
            )
        return self.tokenizer.encode(prompt)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        delta: bool = False,
        arrival_time: float | None = None,
        mm_inputs: Any = None,
        detokenize: bool = True,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (n > 1 becomes n engine requests; with prefix caching the first computes the prompt and
        the others start from its cached blocks).
        delta=False: one final output when done; delta=True: every step's new text and tokens.
        mm_inputs: the prompt's images/videos (`multimodal.inputs.MultiModalInputs`), if any.
        detokenize=False: outputs carry token ids and empty text (the caller decodes them), unless the
        request has stop strings, which need the text here. cache_salt: prefix-cache blocks are shared only
        with requests of the same salt. priority: lower runs first under the priority scheduling policy
        (under fcfs only 0 is accepted, as in vLLM). lora_request: the adapter it runs with (read and checked
        now if new: `add_lora`; its load_inplace is add_lora's to honour, not each request's)."""
        if self.output_processor.has_request(request_id) or self._in_flight(request_id, params.n):
            raise InvalidRequest(f"Request id {request_id!r} is already in use.", "request_id")
        if lora_request is not None:
            lora_request = self._held_lora(lora_request)
        max_tokens = validate_request(
            prompt_token_ids, params, self.config.model.max_model_len, self.vocab_size, self.tokenizer is not None
        )
        check_priority(priority, self.config.scheduler.scheduling_policy)
        structured = params.structured_outputs
        if structured is not None:
            if self.tokenizer is None:
                raise InvalidRequest(
                    f"{structured.param} needs a tokenizer (skip_tokenizer_init=True).", structured.param
                )
            check_structured_outputs(structured)
        if mm_inputs is not None and mm_inputs.items and not self.runner.accepts_multimodal:
            raise InvalidRequest(
                f"Model {self.config.model.model} ({self.config.model.architecture}) does not accept images or video.",
                "messages",
            )
        children: list[Request] = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                # Each sample needs its own random stream; a seeded request stays reproducible.
                child_params = replace(params, n=1, seed=None if params.seed is None else params.seed + index)
            child = Request(
                child_request_id(request_id, index, params.n),
                list(prompt_token_ids),
                child_params,
                max_tokens,
                mm_inputs=mm_inputs,
                cache_salt=cache_salt,
                priority=priority,
                lora_request=lora_request,
            )
            if arrival_time is not None:
                child.arrival_time = arrival_time
            if children and self.block_manager.enable_prefix_caching:
                child.prefill_after = children[0]  # the prompt computed once, by the first sample
            children.append(child)
        self.output_processor.add_request(request_id, prompt, children, delta, detokenize)
        if structured is not None:
            future = self.grammars.compile(structured)
            self._awaiting_grammar[request_id] = (
                future,
                children,
                time.monotonic() + envs.GRAMMAR_COMPILE_TIMEOUT_S.value,
            )
            return
        for child in children:
            self.scheduler.add_request(child)

    @property
    def grammars(self) -> GrammarManager:
        assert self._grammars is not None  # there is one whenever there is a tokenizer (add_request checks)
        return self._grammars

    def _admit_compiled(self) -> list[RequestOutput]:
        """Move constrained requests whose grammar is ready into the scheduler; refuse those whose grammar
        failed or ran out of time. With nothing else to run, wait a little for a compile rather than spin."""
        if not self.scheduler.has_unfinished() and not self._inflight:
            cf.wait([f for f, _, _ in self._awaiting_grammar.values()], timeout=0.005, return_when=cf.FIRST_COMPLETED)
        outputs = []
        now = time.monotonic()
        for request_id, (future, children, deadline) in list(self._awaiting_grammar.items()):
            structured = children[0].sampling_params.structured_outputs
            assert structured is not None
            param = structured.param
            if future.done():
                del self._awaiting_grammar[request_id]
                error = future.exception()
                if error is None:
                    for child in children:
                        self.grammars.start(child.request_id, future.result(), structured.kind)
                        self.scheduler.add_request(child)
                    continue
                message = f"{param}: the grammar cannot be compiled: {error}"
            elif now > deadline:
                del self._awaiting_grammar[request_id]
                message = (
                    f"{param}: the grammar did not compile within {envs.GRAMMAR_COMPILE_TIMEOUT_S.value:g} s "
                    "(PAGODA_GRAMMAR_COMPILE_TIMEOUT_S); simplify the schema."
                )
            else:
                continue
            self._rejected.append((request_id, message))
            outputs.append(self.output_processor.fail(request_id, message, {c.request_id: c for c in children}))
        return outputs

    def take_rejected(self) -> list[tuple[str, str]]:
        """Requests refused after `add_request` accepted them (their grammar failed to compile): the
        engine core answers them as invalid (400) instead of sending their error output."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def _in_flight(self, request_id: str, n: int) -> bool:
        """Whether a finished request of this id is still in the launched, unread step (its token
        would land on the new request)."""
        if not self._inflight:
            return False
        children = [child_request_id(request_id, i, n) for i in range(n)]
        return any(c in so.num_scheduled_tokens for so, _ in self._inflight for c in children)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        # The output processor knows each user request's samples: no scan over every live request.
        children = [cid for rid in request_ids for cid in self.output_processor.child_ids(rid)]
        aborted = self.scheduler.abort_requests(children)
        for request_id in request_ids:
            if (waiting := self._awaiting_grammar.pop(request_id, None)) is not None:
                for child in waiting[1]:
                    child.status = RequestStatus.FINISHED_ABORTED
                aborted += waiting[1]
        if self._grammars is not None:
            for child_id in children:
                self._grammars.remove(child_id)
        outputs = self.output_processor.finish_aborted(aborted)
        self._settle_if_idle()
        return outputs

    def stats(self) -> EngineStats:
        """The engine's snapshot; its `step_tokens` are those of the steps since the previous call."""
        bm, sched = self.block_manager, self.scheduler
        deferred = sum(len(children) for _, children, _ in self._awaiting_grammar.values())
        encoder_cache = self.runner.encoder_cache
        step_tokens = tuple(self._step_tokens)
        self._step_tokens.clear()
        return EngineStats(
            sched.num_running,
            sched.num_waiting + deferred,
            bm.usage,
            sched.stats.num_preemptions,
            bm.prefix_queries,
            bm.prefix_hits,
            sched.stats.num_steps,
            self._device_wait_s,
            num_waiting_deferred=deferred,
            mm_cache_queries=encoder_cache.hits + encoder_cache.misses,
            mm_cache_hits=encoder_cache.hits,
            step_tokens=step_tokens,
            **(self.speculator.stats_fields() if self.speculator is not None else {}),
            **(self._lora_stats() if self.config.lora is not None else {}),
        )

    def _lora_stats(self) -> dict[str, Any]:
        assert self.config.lora is not None

        def names(requests) -> tuple[str, ...]:
            return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))

        return dict(
            max_lora=self.config.lora.max_loras,
            running_lora_adapters=names(self.scheduler.running),
            waiting_lora_adapters=names(self.scheduler.waiting),
        )

    def _draft_engine(self, model: str) -> LLMEngine:
        """The draft model of speculative decoding, as an engine of its own (its KV cache, prefix caching,
        chunked prefill) on the target's device, lengths (at most its own context) and step sizes; it reads
        token ids only."""
        # A draft with a shorter context proposes for the requests that fit in it (`DraftModelProposer`).
        context = derived_max_model_len(resolve_model_source(model).hf_config)
        logger.info("Speculative decoding: loading the draft model %s", model)
        return LLMEngine(EngineConfig.create(draft_engine_args(self.config, model, context)))

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter (once per id and folder; again with load_inplace, when no request of that id
        is unfinished: new weights midway would change a running request's output); raises InvalidRequest naming
        what is wrong."""
        if self.config.lora is None:
            raise InvalidRequest(
                f"LoRA adapter {lora_request.lora_name!r} asked for, but adapters are off: start with "
                "enable_lora=True.",
                "lora_request",
            )
        lora_id = lora_request.lora_int_id
        known = self._loras.get(lora_id)
        if lora_request.load_inplace and known is not None:
            if lora_id in self._lora_ids_in_use():
                raise InvalidRequest(
                    f"LoRA adapter {lora_request.lora_name!r} (id {lora_id}) still has requests; load it in place "
                    "when they finish.",
                    "lora_request",
                )
            self._lora_epochs[lora_id] = self._lora_epochs.get(lora_id, 0) + 1
        elif lora_request.names_same_adapter(known):
            return True
        elif known is not None and lora_id in self._lora_ids_in_use():
            # Requests of two adapters under one id would share whichever was read last.
            raise InvalidRequest(
                f"LoRA id {lora_id} is adapter {known.lora_name!r} ({known.lora_path}) for requests still queued or "
                f"running; adapter {lora_request.lora_name!r} ({lora_request.lora_path}) needs an id of its own.",
                "lora_request",
            )
        lora_request = lora_request.in_epoch(self._lora_epochs.get(lora_id, 0))
        self._lora_manager().add(lora_request)
        self._loras[lora_id] = lora_request
        return True

    def _held_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """The engine's copy of a request's adapter (read now if new; a load_inplace read is add_lora's)."""
        if not lora_request.names_same_adapter(self._loras.get(lora_request.lora_int_id)):
            self.add_lora(replace(lora_request, load_inplace=False))
        return self._loras[lora_request.lora_int_id]

    def _lora_ids_in_use(self) -> set[int]:
        used = {r.lora_id for r in self.scheduler.requests.values()}
        used.update(r.lora_id for _, children, _ in self._awaiting_grammar.values() for r in children)
        return used

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (requests already queued with it finish with it)."""
        if any(r.lora_id == lora_id for r in self.scheduler.requests.values()):
            raise InvalidRequest(f"LoRA adapter {lora_id} still has requests; remove it when they finish.", "lora_id")
        self.runner.remove_lora(lora_id)  # on every tensor-parallel and pipeline rank
        if lora_id in self._loras:  # the id read again later is a new epoch: no block of this one is hit then
            self._lora_epochs[lora_id] = self._lora_epochs.get(lora_id, 0) + 1
        return self._loras.pop(lora_id, None) is not None

    def release_lora(self, lora_id: int) -> None:
        """A served adapter's unload (/v1/unload_lora_adapter): its host copy and device slot are freed now if no
        request uses it, else as soon as its last request finishes (they finish with it, as in vLLM)."""
        if lora_id in self._loras:
            self._releasing.add(lora_id)
            self._release_unused_loras()

    def _release_unused_loras(self) -> None:
        used = self._lora_ids_in_use()
        for lora_id in self._releasing - used:
            self.remove_lora(lora_id)
            logger.info("LoRA adapter %d unloaded: its host copy and device slot are free", lora_id)
        self._releasing &= used

    def list_loras(self) -> set[int]:
        return set(self._loras)

    def _lora_manager(self) -> LoRAManager:
        manager = self.runner.lora  # the runner's adapters (`lora/manager.py`)
        assert manager is not None, "enable_lora builds it"
        return manager

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any, the grammar compiler's threads and the draft engine."""
        self.runner.shutdown()
        if self._grammars is not None:
            self._grammars.shutdown()
        if self.draft is not None:
            self.draft.shutdown()

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or bool(self._inflight)
            or bool(self._awaiting_grammar)
            or self._deferred is not None
        )

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        if self._releasing:  # unloaded adapters whose last request may have finished in this step
            self._release_unused_loras()
        return outputs

    def _step(self) -> list[RequestOutput]:
        refused = self._admit_compiled() if self._awaiting_grammar else []
        read = self._read_for_proposals() if self._inflight and self.speculator is not None else []
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.is_empty:
            self._step_tokens.append(scheduler_output.total_num_scheduled_tokens)
        launched = self.runner.launch(scheduler_output)
        earlier = self._fail_all(self.runner.take_failures()) if self.runner.failures else []  # not launched
        # Outputs returned before this step's own: refusals, steps read for proposals, requests not launched.
        if refused or read:
            earlier = refused + read + earlier
        if self._deferred is not None:  # the last step's outputs (older than any above), made while this one runs
            earlier = self._deferred_outputs() + earlier
        if self._max_unread == 1 or scheduler_output.spec_token_ids:
            # A step with proposals gives a row any number of tokens: it is read before the next is scheduled.
            return earlier + self._process(scheduler_output, launched, defer=self._defer_outputs)
        # Step N+1 is on the device before step N's tokens are read. Requests that stop on step N's
        # token (EOS, a stop string) were already scheduled in N+1: their N+1 token is dropped by
        # `Scheduler.update` (the request is gone); max_tokens stops are not scheduled at all.
        # (Micro-batches never schedule a request an unread step owes a token.)
        if not scheduler_output.is_empty:
            self._inflight.append((scheduler_output, launched))
        outputs = []
        if self._inflight and (len(self._inflight) >= self._max_unread or scheduler_output.is_empty):
            outputs = self._process(*self._inflight.popleft())
        self._settle_if_idle()
        return earlier + outputs if earlier else outputs

    def _read_for_proposals(self) -> list[RequestOutput]:
        """Async scheduling with speculation: proposals need every token, so when the last read step left some
        (made from the tokens known then: one step behind), the steps in flight are read first and the
        proposals made again from them; when it left none, the next step goes out without reading (and without
        proposals) — so a batch past `disable_by_batch_size`, or text with nothing to copy, keeps the
        overlap of async scheduling."""
        assert self.speculator is not None
        if not self.speculator.proposed:
            return []
        outputs = []
        while self._inflight:
            outputs += self._process(*self._inflight.popleft())
        return outputs

    def _settle_if_idle(self) -> None:
        """With no request left, a launched step only holds tokens of finished ones (an EOS
        overshoot, an abort): read and drop it now, so an idle engine has nothing in flight."""
        while self._inflight and not self.scheduler.has_unfinished():
            self._process(*self._inflight.popleft())

    def _process(
        self, scheduler_output: SchedulerOutput, launched: LaunchedStep, defer: bool = False
    ) -> list[RequestOutput]:
        """Read a launched step: its tokens into the scheduler, then its outputs, and the next proposals. `defer`:
        its outputs are made by the next `step()` once that has launched its step (a request that a stop string
        ends is then in that step too, whose token for it is dropped, as with async scheduling)."""
        started = time.perf_counter()
        step_output = launched.result()  # waits for the device (the step's sampled tokens)
        self._device_wait_s += time.perf_counter() - started
        updated = self.scheduler.update(scheduler_output, step_output)
        if defer:
            self._deferred, outputs = (updated, step_output.logprobs, step_output.accepted_logprobs), []
        else:
            outputs = self.output_processor.process(
                updated, step_output.logprobs, self._finish, step_output.accepted_logprobs
            )
        if self.speculator is not None:  # the next step's proposals, from the tokens known now
            self.speculator.record(scheduler_output, step_output, self.scheduler.requests)
            self.speculator.propose(self.scheduler.running, self.scheduler.requests)
        if self.scheduler.failures:
            outputs += self._fail_all(self.scheduler.take_failures())
        return outputs + self._output_failures()

    def _deferred_outputs(self) -> list[RequestOutput]:
        assert self._deferred is not None
        (updated, logprobs, accepted_logprobs), self._deferred = self._deferred, None
        # (a request aborted or failed since it was read gave its final output then, and left the output
        # processor: it is passed over there)
        outputs = self.output_processor.process(updated, logprobs, self._finish, accepted_logprobs)
        return outputs + self._output_failures()

    def _output_failures(self) -> list[RequestOutput]:
        outputs = []
        if self.output_processor.failures:
            for parent_id, request, exc in self.output_processor.take_failures():
                outputs += self._fail(
                    request.request_id, "processing its output (text, stop strings, logprobs)", exc, parent_id, request
                )
        return outputs

    def _finish(self, request_id: str, status: RequestStatus, stop_reason: str) -> None:
        self.scheduler.finish_request(request_id, status, stop_reason)

    # ---- one request's failure ----------------------------------------------------------------
    def _fail_all(self, failures: list[tuple[str, str, Exception]]) -> list[RequestOutput]:
        return [out for request_id, stage, exc in failures for out in self._fail(request_id, stage, exc)]

    def _fail(
        self, request_id: str, stage: str, exc: Exception, parent_id: str | None = None, request: Request | None = None
    ) -> list[RequestOutput]:
        """End the user request that engine request `request_id` belongs to (all its samples) with
        finish_reason "error": its blocks are freed, its final output says why, it is logged once
        with its id. Nothing else changes: the engine and every other request carry on."""
        parent_id = parent_id or self.output_processor.parent_of(request_id) or request_id
        logger.error(
            "Request %s failed while %s; it ends with an error, the engine carries on.", parent_id, stage, exc_info=exc
        )
        message = (
            f"Internal error while {stage}: {type(exc).__name__}. The server log has the details (request {parent_id})."
        )
        requests = {request.request_id: request} if request is not None else {}
        for child_id in [*self.output_processor.child_ids(parent_id), request_id]:
            if child_id in self.scheduler.requests:
                requests[child_id] = self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ERROR, message)
            if self._grammars is not None:
                self._grammars.remove(child_id)
        return [self.output_processor.fail(parent_id, message, requests)]
