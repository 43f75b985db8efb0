"""A request's life inside the engine, and the glossary of its token counters.

Counters (defined here and nowhere else):
- prompt_token_ids   the prompt, as tokenized.
- output_token_ids   tokens sampled so far (already appended when sampled).
- num_tokens         len(prompt) + len(output): every token the request has.
- num_pending        tokens sampled by launched steps that the host has not seen yet (0 without
                     async scheduling once a step is processed; with it, the last step's token).
- num_computed_tokens tokens whose K/V are in the cache or written by a step already scheduled: the
                     scheduler advances it when it schedules a step. It chases num_tokens +
                     num_pending: prefill, chunked prefill, a prefix-cache hit and decode are all
                     "compute the next (num_tokens + num_pending - num_computed_tokens) tokens, as
                     many as the step's budget allows". A sampled token is known before its K/V
                     exist, so a decoding request always has exactly one uncomputed token.
- num_cached_tokens  tokens found in the prefix cache when the request was first admitted.
Preemption frees the blocks and resets num_computed_tokens to 0; the output is kept and the
request recomputes prompt + output later (often hitting its own cached blocks).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pagoda.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    # An exception in this request's own processing (sampling setup, stop checks, detokenization,
    # output building): the request ends, the engine and every other request carry on. Its
    # `stop_reason` holds the error message.
    FINISHED_ERROR = "error"

    # Set on each member below: plain attributes, since these are read for every request every
    # step (an enum property costs ~15x an attribute read).
    is_finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error", None while not finished


for _status in RequestStatus:
    _status.is_finished = _status in (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    )
    _status.finish_reason = _status.value if _status.is_finished else None
del _status


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None here
    arrival_time: float = field(default_factory=time.monotonic)  # time.monotonic(), any process
    first_scheduled_time: float | None = None  # when first admitted (queue time = this - arrival)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens sampled by launched steps but not yet appended (async scheduling: at most 2, briefly).
    # The scheduler counts them as known tokens; num_computed_tokens advances when a step is scheduled.
    num_pending: int = 0
    num_cached_tokens: int = -1  # -1 until first admitted
    block_ids: list[int] = field(default_factory=list)  # owned by BlockManager
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of this request's full blocks, in order
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    # (cached block, this request's block) pairs to copy before its first step (`BlockManager.match_prefix`)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    mm_inputs: Any = None  # multimodal.inputs.MultiModalInputs for image/video prompts
    # Enters the hash of the first block (and so of every block after it): requests with different salts
    # share no prefix-cache blocks.
    cache_salt: str | None = None
    lora_request: Any = None  # lora.request.LoRARequest: the adapter this request runs with (None: the base model)
    priority: int = 0  # lower runs first under the priority scheduling policy
    # Speculative decoding: tokens proposed to follow the known ones, verified by the next step (none: the
    # step decodes one token). Set after each step's update (`engine/speculation.py`).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_window: int = 0  # how many to propose next (0: the configured number); `engine/speculation.py`
    # Tokens the last update appended (1, or up to 1 + the proposals a step verified): the output path
    # reads them.
    num_new_tokens: int = 1
    # n > 1: the first sample, whose prompt this one shares. The scheduler admits this one once that prompt's
    # full blocks are in the prefix cache (`Scheduler._waits_for_leader`), so the prompt is computed once.
    prefill_after: Request | None = None

    @property
    def lora_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def prefix_salt(self) -> str | None:
        """What the first block's hash takes besides its tokens: the cache salt and the adapter, in its epoch (KV
        computed under one adapter, or under an id's weights before they were read again, is not another's)."""
        if self.lora_request is None:
            return self.cache_salt
        lora = self.lora_request
        return f"{self.cache_salt or ''}\x00lora:{self.lora_id}:{lora.lora_path}:{lora.epoch}"

    @property
    def priority_key(self) -> tuple[int, float]:
        """The priority policy's order: priority, then arrival (FCFS among equals)."""
        return self.priority, self.arrival_time

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
