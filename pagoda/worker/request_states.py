"""The runner's per-request state, kept in step with the scheduler's diffs (`SchedulerOutput`).

New requests arrive whole (`NewRequestData`), known ones as a diff (`CachedRequestData`); finished
and preempted ones give back their per-sequence state slot. A request whose setup raises (its
sampling parameters on this device) is left out and reported through `take_failures`; the engine
ends it with an error and the step runs without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagoda.inputs import MultiModalInputs
from pagoda.layers.sampler import SamplingState
from pagoda.outputs import SchedulerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.worker.state_slots import StateSlotPool


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
    lora_request: Any = None  # lora.request.LoRARequest: its adapter (None: the base model)


class RequestStates:
    def __init__(
        self, block_size: int, device: torch.device, sampling: SamplingState, state_pool: StateSlotPool | None
    ):
        self.block_size = block_size
        self.device = device
        self.sampling = sampling
        self.state_pool = state_pool
        self.states: dict[str, RunnerRequestState] = {}
        # (request id, stage, exception) of new requests whose per-request setup raised.
        self.failures: list[tuple[str, str, Exception]] = []

    def apply(self, so: SchedulerOutput) -> list[int]:
        """Apply one step's diff; returns the blocks handed out for new content this step (not
        prefix-cache hits), which a backend reading past a request's length must zero."""
        fresh: list[int] = []
        for request_id in so.finished_request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                self._release_slot(state)
            self.sampling.remove(request_id)
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
                lora_request=new.lora_request,
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
        return fresh

    def scheduled(self, so: SchedulerOutput) -> dict[str, int]:
        """The step's rows (request id → tokens), less the requests whose setup failed."""
        if not self.failures:
            return so.num_scheduled_tokens
        return {rid: n for rid, n in so.num_scheduled_tokens.items() if rid in self.states}

    def take_failures(self) -> list[tuple[str, str, Exception]]:
        failures, self.failures = self.failures, []
        return failures

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
