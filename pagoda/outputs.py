"""The contracts between stages: scheduler → runner (`SchedulerOutput`), runner → scheduler
(`StepOutput`), engine → caller (`RequestOutput`). Every field says why it exists.

The runner keeps its own per-request state (token ids, sampling state, seeded generator), so a
scheduled request that the runner already knows is sent as a small diff (`CachedRequestData`)
rather than in full; this is what will cross a process boundary to tensor-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has never seen: everything it needs to keep state for it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table so far
    num_computed_tokens: int  # > 0 when the prefix cache already holds the start of the prompt
    mm_inputs: Any = None  # multimodal.inputs.MultiModalInputs: images/videos, M-RoPE positions
    lora_request: Any = None  # lora.request.LoRARequest: the adapter it runs with (None: the base model)


@dataclass
class CachedRequestData:
    """A request the runner knows: only what changed since it last ran."""

    request_id: str
    new_block_ids: list[int]  # blocks appended to its table since last step
    resumed: bool  # re-admitted after preemption: new_block_ids is the whole table
    num_computed_tokens: int  # tokens already in the cache before this step


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    # request id → tokens to compute this step; dict order is the order of rows in the batch.
    num_scheduled_tokens: dict[str, int]
    # Requests that ended (finished or aborted) since the last step: the runner drops their state.
    finished_request_ids: set[str] = field(default_factory=set)
    # Requests preempted while building this step (none of them is scheduled in it): the runner
    # frees their per-sequence state slots; they come back later as `resumed` and recompute.
    preempted_request_ids: set[str] = field(default_factory=set)
    # Scheduled requests whose step reaches the end of their known tokens (computed + scheduled ==
    # prompt + outputs, pending ones included): they sample a token this step; the others are in the
    # middle of a chunked prefill. Decided by the scheduler only; the runner samples exactly these.
    sampling_request_ids: set[str] = field(default_factory=set)
    # Speculative decoding: request id → the proposals scheduled after its last known token (the row's
    # last len(proposals) tokens); the runner verifies them and returns how many held.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # (source, destination) KV blocks to copy before this step's forward pass writes anything: prefix hits
    # given to a request as a run of its own (`BlockManager.match_prefix`, CPU).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class TokenLogprobs:
    """Logprobs for one sampled token: its own, and the top-k alternatives (raw distribution)."""

    sampled_logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first; empty when logprobs=0


@dataclass
class StepOutput:
    # Requests that produced a token this step (their last uncomputed token was in the batch);
    # a request in the middle of a chunked prefill samples nothing.
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # only for requests that asked
    # Speculative rows: the proposals that held, in order; the sampled token follows them.
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # theirs, where asked


@dataclass
class Logprob:
    """vLLM-shaped logprob entry: outputs[i].logprobs[t] is {token_id: Logprob}."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int  # which of the n samples
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    # The stop token id / stop string that matched; with finish_reason "error", the error message.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    queue_time: float | None = None  # seconds between arrival and first admission (set when finished)


@dataclass
class EngineStats:
    """A snapshot of the engine core's state, sent with every batch of outputs (for /metrics)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable KV blocks in use, 0..1
    num_preemptions: int  # totals since start
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    num_steps: int
    # Where the core's time goes (totals, seconds): `busy_seconds` = its loop passes from the moment a
    # pass's messages are in to when its outputs are sent (so not the blocking wait while idle), set by
    # the core process; `device_wait_seconds` = the part spent waiting for a step's sampled tokens.
    # busy − wait is host work; wait ≈ 0 at a level means the host, not the GPU, sets the step rate.
    # `cpu_seconds` = the core loop thread's CPU time over the same passes: well under busy − wait
    # means the core was runnable but off a CPU (other processes took the cores), not short of speed.
    device_wait_seconds: float = 0.0
    busy_seconds: float = 0.0
    cpu_seconds: float = 0.0
    num_waiting_deferred: int = 0  # of num_waiting: requests whose grammar is still being compiled
    mm_cache_queries: int = 0  # totals: images/videos looked up in the encoder cache (per step needing one)
    mm_cache_hits: int = 0  # found there
    # Tokens scheduled in each step since the previous snapshot (the core takes one per loop pass, and a
    # pass that steps changes `num_steps`, so every API process receives each step's count once).
    step_tokens: tuple[int, ...] = ()
    # Speculative decoding totals (vLLM's spec_decode metrics): rows that carried proposals, proposals,
    # the ones accepted, and accepted ones by position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # LoRA (vLLM's lora_requests_info): adapters in one step at most, and the names of the running and the
    # waiting requests' adapters (sorted; max_lora 0: adapters off).
    max_lora: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
