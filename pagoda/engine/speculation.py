"""Speculative proposals for the next step, made on the host after each step's update, and their counts.

A decoding request gets up to k proposals (`Request.spec_token_ids`) from the n-gram or suffix proposer; the
scheduler schedules them after its last known token and the runner verifies them (`pagoda/spec_decode/`;
penalties apply at each verified position with the proposals before it in the history). Requests whose
sampling needs more than the model's distribution at one position — a seed (a seed promises the same output
whatever else runs, and proposals depend on the batch), logprob_token_ids, min_tokens not yet reached — get
none and decode one token a step (logprobs are given for every kept token; a grammar masks every position). So
do all requests in a step of at least `disable_by_batch_size` running ones: verifying proposals costs compute
that a large batch already uses. Its default is 32 on a GPU, where a decode step of a few rows reads every
weight from memory and the extra positions are nearly free, and 2 on the CPU, where a step's cost grows with
its tokens: one request alone gained (1.43x on copying), eight at once lost (0.79x)
(`benchmarks/spec_decode_cpu.py`).

Under async scheduling a step with proposals is read before the next is scheduled, and proposals made while
a step was in flight only tell the engine to read it and propose again (`LLMEngine._read_for_proposals`).

With n-gram proposals, each request's proposal length adapts to what its last verification kept: one more
than the proposals that held, up to k (so text that copies its context climbs to k proposals, open text stays
near one). Suffix proposals size themselves (the match length and the draft's estimated probability,
`spec_decode/suffix.py`), and finished requests' outputs join the cache that later requests search.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from pagoda.config import EngineArgs, EngineConfig
from pagoda.outputs import SchedulerOutput, StepOutput
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode.config import SpeculativeConfig
from pagoda.spec_decode.history import TokenHistories
from pagoda.spec_decode.ngram import NgramProposer
from pagoda.spec_decode.suffix import SuffixProposer

DEFAULT_DISABLE_BY_BATCH_SIZE = {"cuda": 32, "cpu": 2}
_DEVICE_NAMES = {"cuda": "GPU", "cpu": "CPU"}  # as the startup line names the device whose default applies
logger = logging.getLogger("pagoda")


@dataclass
class SpecDecodeCounts:
    """Totals since startup, as vLLM's spec_decode metrics count them."""

    num_drafts: int = 0  # rows that carried proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: proposals accepted at each position


def may_speculate(request: Request) -> bool:
    params = request.sampling_params
    return (
        # decoding: its prompt is computed (under async scheduling its next token may be in flight: such
        # proposals only tell the engine to read that step first and propose again, `LLMEngine.step`)
        request.num_computed_tokens >= request.num_tokens - 1
        and not params.logprob_token_ids
        and params.seed is None
        and request.num_output_tokens >= params.min_tokens
    )


class DraftModelProposer:
    """Greedy proposals from a smaller model of the same vocabulary, run as an engine of its own (`draft`:
    an `LLMEngine`). Each step every proposing request is asked of it anew as a prompt of its known tokens:
    its prefix cache holds what it computed before (the known tokens up to the last full block), so a step
    costs it a short prefill and one decode step per proposal, batched over the requests. A greedy draft is
    a one-hot proposal distribution, so rejection sampling keeps sampled requests exact too."""

    def __init__(self, draft: Any, max_model_len: int):
        self.draft, self.max_model_len = draft, max_model_len
        self._ids = itertools.count()

    def propose(self, wanted: list[tuple[Request, int]]) -> None:
        """Set each request's proposals: up to its count of the draft's greedy tokens after its known ones."""
        asked: dict[str, Request] = {}
        for request, k in wanted:
            tokens = request.prompt_token_ids + request.output_token_ids
            k = min(k, self.max_model_len - len(tokens) - 1)
            request.spec_token_ids = []
            if k > 0:
                draft_id = f"draft-{next(self._ids)}"
                self.draft.add_request(draft_id, tokens, SamplingParams(temperature=0, max_tokens=k), detokenize=False)
                asked[draft_id] = request
        try:
            while asked and self.draft.has_unfinished_requests():
                for output in self.draft.step():
                    if output.finished and output.request_id in asked:
                        asked.pop(output.request_id).spec_token_ids = list(output.outputs[0].token_ids)
        except Exception:  # noqa: BLE001 - proposals are optional: the target decodes on without them
            logger.exception("The draft model failed; these requests decode this step without proposals.")
            self.draft.abort_request(list(asked))
            for request in asked.values():
                request.spec_token_ids = []


def draft_engine_args(target: EngineConfig, model: str, context: int) -> EngineArgs:
    """The draft engine's arguments: the target's device, dtype, step sizes and lengths (at most the draft's own
    `context`), no tokenizer. It proposes only while fewer than `disable_by_batch_size` requests run, so on a GPU
    its KV cache holds that many requests of its longest length (a fixed pool: sized from free memory it would
    take the target's share); on the CPU it has the target's budget."""
    spec = target.scheduler.speculative
    assert spec is not None
    device = target.device.device
    max_len = min(target.model.max_model_len, context)
    seqs = min(target.scheduler.max_num_seqs, spec.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE[device])
    block = target.cache.block_size
    return EngineArgs(
        model=model,
        skip_tokenizer_init=True,
        dtype=target.model.dtype,
        device=device,
        max_model_len=max_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=target.scheduler.max_num_batched_tokens,
        block_size=block,
        cpu_kv_cache_space_gib=target.cache.cpu_kv_cache_space_gib,
        num_gpu_blocks_override=seqs * -(-max_len // block) + 1 if device == "cuda" else None,
        seed=target.model.seed,
    )


class Speculator:
    def __init__(self, config: SpeculativeConfig, device: str, draft: Any = None):
        self.config = config
        self.k = k = config.num_speculative_tokens
        self.ngram = self.suffix = self.draft = None
        if config.suffix is not None:
            self.suffix = SuffixProposer(k, config.suffix)
        elif draft is not None:
            self.draft = DraftModelProposer(draft, draft.config.model.max_model_len)
        else:
            self.ngram = NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
        self.limit = config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE[device]
        # Said once, at startup: with the CPU's default of 2, speculation stops as soon as a second request runs.
        where = "" if config.disable_by_batch_size else f"; the {_DEVICE_NAMES.get(device, device)}'s default"
        logger.info(
            "Speculative decoding: %s, k=%d: proposals while fewer than %d requests run (disable_by_batch_size%s)",
            config.method,
            k,
            self.limit,
            where,
        )
        self.counts = SpecDecodeCounts(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._seen: dict[str, Request] = {}  # suffix: requests that ran, until their output is cached
        self._histories = TokenHistories()  # n-gram and suffix: each proposing request's tokens as one array
        self.proposed = False  # the last `propose` left some request proposals

    def propose(self, running: list[Request], unfinished: dict[str, Request]) -> None:
        """Set every running request's proposals for the next step (none where it may not speculate);
        `unfinished`: the scheduler's requests (the ones seen before and gone from it have finished)."""
        off = len(running) >= self.limit
        drafting: list[tuple[Request, int]] = []
        for request in running:
            if off or not may_speculate(request):
                request.spec_token_ids = []
            elif self.draft is not None:
                drafting.append((request, request.spec_window or self.k))
            elif self.suffix is not None:
                shared = request.cache_salt is None
                request.spec_token_ids = self.suffix.propose(self._histories.tokens(request), shared=shared)
            else:
                assert self.ngram is not None
                k = request.spec_window or self.k
                request.spec_token_ids = self.ngram.propose(self._histories.tokens(request), k)
        if len(self._histories) > len(running):
            self._histories.keep_only(request.request_id for request in running)
        if drafting:
            assert self.draft is not None
            self.draft.propose(drafting)
        # Read by the engine before every step under async scheduling (`LLMEngine._read_for_proposals`).
        self.proposed = not off and any(request.spec_token_ids for request in running)
        if self.suffix is not None:
            self._cache_finished(running, unfinished)

    def _cache_finished(self, running: list[Request], unfinished: dict[str, Request]) -> None:
        assert self.suffix is not None
        for request in running:
            self._seen[request.request_id] = request
        for request_id in [rid for rid in self._seen if rid not in unfinished]:
            request = self._seen.pop(request_id)
            if request.cache_salt is None:
                self.suffix.finish(request_id, request.output_token_ids)

    def stats_fields(self) -> dict:
        """`EngineStats`' speculative-decoding totals."""
        c = self.counts
        return dict(
            spec_num_drafts=c.num_drafts,
            spec_num_draft_tokens=c.num_draft_tokens,
            spec_num_accepted_tokens=c.num_accepted_tokens,
            spec_accepted_per_pos=tuple(c.accepted_per_pos),
        )

    def record(self, scheduler_output: SchedulerOutput, step_output: StepOutput, requests: dict[str, Request]) -> None:
        """Count the step's verifications and set each request's next proposal length."""
        counts, held, k = self.counts, step_output.accepted_token_ids, self.k
        for request_id, proposals in scheduler_output.spec_token_ids.items():
            if request_id not in step_output.sampled_token_ids:
                continue  # aborted while the step ran
            accepted = len(held.get(request_id, ()))
            if (request := requests.get(request_id)) is not None:
                request.spec_window = min(k, accepted + 1)
            counts.num_drafts += 1
            counts.num_draft_tokens += len(proposals)
            counts.num_accepted_tokens += accepted
            for pos in range(accepted):
                counts.accepted_per_pos[pos] += 1
