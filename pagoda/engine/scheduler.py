"""Continuous batching: which requests run in the next step, and how many tokens each computes.

There are no prefill and decode phases (see the counter glossary in `pagoda/request.py`): every
step hands each chosen request `num_tokens - num_computed_tokens` tokens, cut to what is left of
the step's token budget. Order, rebuilt every step:
1. running requests, oldest admission first (decodes and unfinished prefill chunks);
   when blocks run out, the most recently admitted running request is preempted (blocks freed,
   recomputed later) — possibly the very request being scheduled;
2. then waiting requests FCFS (preempted ones sit at the front), while the budget, `max_num_seqs`
   and free blocks allow, and only if nothing was preempted this step.
Under `--scheduling-policy priority` both queues are kept in (priority, arrival) order instead: the
lowest `priority` value is served first, equals in arrival order, and the running request preempted
when blocks run out is the one with the highest value (latest among equals), as in vLLM.
A prompt longer than the remaining budget is prefilled in chunks over several steps, alongside
the decodes of other requests (chunked prefill).

Pipeline micro-batches (`micro_batches` = P > 1): up to P steps are in flight through the stages at once,
and a step may not hold a request whose sampled token an unread step still owes (`num_pending`): it could
not know its input. So each step takes only requests with nothing pending, and at most
ceil((running + waiting) / P) of them, which splits a steady set of decodes into P even micro-batches. A
prefill chunk owes no token, so the next chunk may follow in the next micro-batch: every stage runs the
steps in launch order, so its KV cache holds the chunk before. A preempted request still owed a token is
not admitted again until that token is read.

Speculative decoding: a decoding request with proposals (`Request.spec_token_ids`) computes its last known
token and up to k proposals after it in one step (each verified by the model's output at the position
before it), as far as the budget, max_tokens and max_model_len leave room. `update` takes the proposals
that held and the sampled token, and moves `num_computed_tokens` back over the ones that did not (their
KV slots are written over later).

Multimodal prompts: a step that schedules any of an image's placeholder tokens runs the vision encoder
on the whole image (its output is cached for the chunks after). With `max_encoder_tokens_per_step`
set, the images a step starts are bounded too: a chunk stops before the first image whose placeholder
tokens would overflow what is left of that budget (an image larger than the whole budget runs alone
in a step). A running request cut to nothing waits for the next step; a waiting one stops admission
(FCFS), as a failed block allocation does.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass
from typing import cast

from pagoda.config import SchedulerConfig
from pagoda.engine.block_manager import BlockManager
from pagoda.outputs import CachedRequestData, NewRequestData, SchedulerOutput, StepOutput
from pagoda.request import Request, RequestStatus


@dataclass
class SchedulerStats:
    num_preemptions: int = 0  # total requests preempted so far
    num_chunked_prefills: int = 0  # prefill chunks that did not finish their prompt
    num_steps: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: set[int]):
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._runner_known: set[str] = set()  # requests the runner holds state for
        self._finished_for_runner: set[str] = set()
        self._preempted_for_runner: set[str] = set()  # filled while building one step's output
        self.failures: list[tuple[str, str, Exception]] = []  # see take_failures
        # Priority policy: `waiting` and `running` are both kept in (priority, arrival) order, so the
        # scheduler serves the most urgent first and `running[-1]`, the preemption victim, is the least.
        self._by_priority = config.scheduling_policy == "priority"

    # ---- intake -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        """Into the waiting queue: FCFS at the back (a preempted request at the front); under the priority
        policy in (priority, arrival) order, after the requests of equal key."""
        if self._by_priority:
            bisect.insort_right(self.waiting, request, key=_priority_key)
        elif request.status is RequestStatus.PREEMPTED:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return [self.finish_request(rid, RequestStatus.FINISHED_ABORTED) for rid in request_ids if rid in self.requests]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step -----------------------------------------------------------------------------
    def _waits_for_leader(self, request: Request) -> bool:
        """Whether a later sample of an n > 1 request stays waiting: its first sample (`prefill_after`) is still to
        register the shared prompt's full blocks in the prefix cache. Admitted together, every sample would compute
        the whole prompt (a step's blocks are cached only after it), and a step of n times its rows may take other
        kernels (the CPU's 4-bit layers change kernel above 64 rows), so the samples' first tokens could differ
        from the same request's with n = 1. Once the leader is done with those blocks, or gone, it is released."""
        leader = request.prefill_after
        assert leader is not None
        full_blocks = len(leader.prompt_token_ids) // self.block_manager.block_size
        if self.requests.get(leader.request_id) is leader and leader.num_registered_blocks < full_blocks:
            return True
        request.prefill_after = None
        return False

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        encoder = _EncoderBudget(self.config.max_encoder_tokens_per_step)
        num_scheduled: dict[str, int] = {}
        spec: dict[str, list[int]] = {}  # proposals scheduled this step
        new_requests: list[NewRequestData] = []
        cached_requests: list[CachedRequestData] = []
        sampling: set[str] = set()  # requests that sample this step
        copies: list[tuple[int, int]] = []  # prefix hits copied into admitted requests' own blocks
        preempted = False
        self._preempted_for_runner = set()
        exclusive = self.config.micro_batches > 1  # see the module docstring
        rows_left = -(-(len(self.running) + len(self.waiting)) // self.config.micro_batches)

        # Runs for every running request every step: attribute reads are hoisted and the common
        # decode (one token that fits in the last block) skips the allocator altogether.
        block_size = self.block_manager.block_size
        max_model_len = self.config.max_model_len
        running = self.running
        index = 0
        while index < len(running) and budget > 0 and rows_left > 0:
            request = running[index]
            if exclusive and request.num_pending:
                index += 1  # an unread step owes its token
                continue
            computed = request.num_computed_tokens
            num_prompt = len(request.prompt_token_ids)
            num_output = len(request.output_token_ids) + request.num_pending
            total = num_prompt + num_output
            num_new = total - computed
            if num_new <= 0 or (request.num_pending and (num_output >= request.max_tokens or total >= max_model_len)):
                index += 1  # its last token is still in flight: nothing more to compute
                continue
            if num_new > budget:
                num_new = budget
            proposals = request.spec_token_ids
            if proposals and num_new == 1:
                room = min(len(proposals), budget - 1, request.max_tokens - num_output - 1, max_model_len - total - 1)
                if room > 0:
                    spec[request.request_id] = proposals[:room]
                    num_new += room
            if request.mm_inputs is not None and encoder.limited and computed < num_prompt:
                num_new = encoder.fit(request, computed, num_new, fresh=False)
                if num_new == 0:
                    index += 1  # its next image waits for a step with encoder budget left
                    continue
            num_blocks_before = len(request.block_ids)
            if computed + num_new > num_blocks_before * block_size:
                while not self.block_manager.allocate(request, num_new):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is request:
                        break
                if request.status is not RequestStatus.RUNNING:
                    spec.pop(request.request_id, None)  # not scheduled: neither are its proposals
                    break  # it preempted itself: nothing after it remains
                new_block_ids = request.block_ids[num_blocks_before:]
            else:
                new_block_ids = []
            if computed + num_new < num_prompt:
                self.stats.num_chunked_prefills += 1
            num_scheduled[request.request_id] = num_new
            cached_requests.append(CachedRequestData(request.request_id, new_block_ids, False, computed))
            request.num_computed_tokens = computed + num_new
            if computed + num_new >= total:  # (past it by the proposals, if any)
                request.num_pending += 1  # this step samples its next token
                sampling.add(request.request_id)
            budget -= num_new
            rows_left -= 1
            index += 1

        skipped: list[Request] = []  # waiting for a LoRA slot or a leader: passed over this step, in their order
        adapters = {r.lora_id for r in self.running} - {0} if self.config.max_loras_per_step else set()
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if rows_left <= 0 or (exclusive and request.num_pending):
                break
            # Preempted with a token in flight? Only in the step that preempted it, which admits nobody.
            assert not request.num_pending, "a waiting request still has a token in flight"
            if request.prefill_after is not None and self._waits_for_leader(request):
                skipped.append(self.waiting.popleft())  # admitted once its prompt is cached: later ones may go
                continue
            lora = request.lora_id
            if lora and lora not in adapters and len(adapters) >= self.config.max_loras_per_step:
                skipped.append(self.waiting.popleft())  # max_loras adapters run: later requests may still fit
                continue
            hits = self.block_manager.match_prefix(request, running=len(self.running))
            request.num_computed_tokens = hits
            num_new = min(request.num_tokens - hits, budget)
            if request.mm_inputs is not None and encoder.limited:
                num_new = encoder.fit(request, hits, num_new, fresh=True)
            if num_new == 0 or not self.block_manager.allocate(request, num_new):
                self.block_manager.free(request)  # give back the prefix hits too
                request.num_computed_tokens = 0
                break
            if request.num_cached_tokens < 0:  # only once actually admitted, not on a failed try
                request.num_cached_tokens = hits
                request.first_scheduled_time = time.monotonic()
            self.waiting.popleft()
            copies.extend(request.block_copies)
            request.block_copies = []
            if lora:
                adapters.add(lora)
            if self._by_priority:
                bisect.insort_right(self.running, request, key=_priority_key)
            else:
                self.running.append(request)
            request.status = RequestStatus.RUNNING
            self._note_chunk(request, num_new)
            num_scheduled[request.request_id] = num_new
            if request.request_id in self._runner_known:
                cached_requests.append(
                    CachedRequestData(request.request_id, list(request.block_ids), True, request.num_computed_tokens)
                )
            else:
                self._runner_known.add(request.request_id)
                new_requests.append(
                    NewRequestData(
                        request.request_id,
                        request.prompt_token_ids,
                        request.sampling_params,
                        list(request.block_ids),
                        request.num_computed_tokens,
                        request.mm_inputs,
                        request.lora_request,
                    )
                )
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens:
                request.num_pending += 1
                sampling.add(request.request_id)
            budget -= num_new
            rows_left -= 1

        self.waiting.extendleft(reversed(skipped))  # back at the front, as they were
        finished, self._finished_for_runner = self._finished_for_runner, set()
        self.stats.num_steps += 1
        return SchedulerOutput(
            new_requests, cached_requests, num_scheduled, finished, self._preempted_for_runner, sampling, spec, copies
        )

    def _note_chunk(self, request: Request, num_new: int) -> None:
        if request.num_computed_tokens + num_new < request.num_prompt_tokens:
            self.stats.num_chunked_prefills += 1

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._enqueue(request)
        if request.request_id in self._runner_known:
            self._preempted_for_runner.add(request.request_id)

    # ---- after the step -----------------------------------------------------------------------
    def update(self, scheduler_output: SchedulerOutput, step_output: StepOutput) -> list[Request]:
        """Append the step's sampled tokens, offer newly full blocks to the prefix cache, apply
        token-level stops. Returns the requests that received a token this step (some may now be
        finished). num_computed_tokens already moved when the step was scheduled; with async
        scheduling the next step may be scheduled (and a request preempted) before this runs."""
        updated = []
        requests, sampled = self.requests, step_output.sampled_token_ids
        proposed, held = scheduler_output.spec_token_ids, step_output.accepted_token_ids
        block_manager = self.block_manager
        caching, block_size = block_manager.enable_prefix_caching, block_manager.block_size
        eos, max_model_len = self.eos_token_ids, self.config.max_model_len
        for request_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(request_id)
            if request is None:  # finished or aborted while the step ran
                continue
            token = sampled.get(request_id)
            if token is not None:
                request.num_pending -= 1
                if request_id in proposed:
                    accepted = held.get(request_id, [])
                    request.num_computed_tokens -= len(proposed[request_id]) - len(accepted)
                    if accepted:
                        try:
                            token = self._append_accepted(request, accepted, token)
                        except Exception as exc:  # noqa: BLE001 - this request fails, the step goes on
                            self.failures.append((request_id, "checking its stop conditions", exc))
                            continue
                        if token is None:  # it stopped on one of them
                            updated.append(request)
                            continue
                request.output_token_ids.append(token)
            # A block is full once its tokens are computed and known (a pending token is not).
            if (
                caching
                and min(request.num_computed_tokens, request.num_tokens) // block_size > request.num_registered_blocks
                and request.status is RequestStatus.RUNNING
            ):
                block_manager.cache_full_blocks(request)
            if token is None:
                continue
            output = request.output_token_ids
            updated.append(request)
            # Cheap screen: _check_stop can only end the request on one of these conditions.
            num_output = len(output)
            if (
                token in eos
                or num_output >= request.max_tokens
                or num_output + len(request.prompt_token_ids) >= max_model_len
                or token in request.sampling_params.stop_token_ids  # type: ignore[operator]  # a list once set
            ):
                try:
                    status = self._check_stop(request, token)
                except Exception as exc:  # noqa: BLE001 - this request fails, the step goes on
                    updated.pop()
                    self.failures.append((request_id, "checking its stop conditions", exc))
                    continue
                if status is not None:
                    self.finish_request(request_id, status)
        return updated

    def _append_accepted(self, request: Request, accepted: list[int], token: int) -> int | None:
        """Append the proposals that held, stopping at the first one that ends the request (the rest are
        dropped). Returns the sampled token still to append, or None when the request stopped. Sets
        `num_new_tokens`, which the output path reads and sets back to 1."""
        request.num_new_tokens = len(accepted) + 1
        for i, t in enumerate(accepted):
            request.output_token_ids.append(t)
            status = self._check_stop(request, t)
            if status is not None:
                request.num_new_tokens = i + 1
                self.finish_request(request.request_id, status)
                return None
        return token

    def take_failures(self) -> list[tuple[str, str, Exception]]:
        """(request id, stage, exception) of the requests whose stop check raised since the last
        call; the engine ends each with an error (they are still running here)."""
        failures, self.failures = self.failures, []
        return failures

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in cast(list[int], params.stop_token_ids):  # a list after SamplingParams.__post_init__
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> Request:
        request = self.requests.pop(request_id)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        if stop_reason is not None:
            request.stop_reason = stop_reason
        self.block_manager.free(request)
        if request_id in self._runner_known:
            self._runner_known.discard(request_id)
            self._finished_for_runner.add(request_id)
        return request


class _EncoderBudget:
    """Placeholder tokens of the multimodal items one step still may start encoding."""

    def __init__(self, limit: int | None):
        self.limited = limit is not None
        self.limit = limit or 0
        self.left = self.limit

    def fit(self, request: Request, start: int, num_new: int, fresh: bool) -> int:
        """How many of the `num_new` tokens from `start` fit, charging the items whose encoding they start.

        An item that begins before `start` was encoded by an earlier chunk and is in the runner's encoder
        cache, unless the request is `fresh` (admitted now: a prefix-cache hit may end inside an item,
        whose encoder output is then computed in this step). Items are in prompt order."""
        end = start + num_new
        for item in request.mm_inputs.items:
            if item.offset >= end:
                break
            if item.end <= start or (item.offset < start and not fresh):
                continue
            if item.length > self.left and self.left < self.limit:
                return max(item.offset - start, 0)  # stop before it; a later step encodes it
            self.left -= item.length  # (an item larger than the whole budget runs alone)
        return num_new


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority_key
