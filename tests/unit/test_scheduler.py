"""Tests for pagoda.engine.scheduler.Scheduler, driven by a fake runner (no model).

The fake runner mirrors the real one: it keeps its own per-request state built only from the
SchedulerOutput diffs (new requests, cached diffs, finished ids), and samples a token for a request
exactly when the step computes its last uncomputed token. It also keeps a shadow KV cache (each slot
holds the whole token prefix that produced it), so reading a slot that holds other content — a
wrong prefix hit, a block reused while still needed, a stale block table — fails the test.

Every step is checked against the scheduling rules (see the scheduler's module docstring and the
counter glossary in pagoda/request.py), computed here from a snapshot taken before `schedule()`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest

from pagoda.config import SchedulerConfig
from pagoda.engine.block_manager import BlockManager
from pagoda.engine.scheduler import Scheduler
from pagoda.inputs import MultiModalInputs, MultiModalItem
from pagoda.outputs import SchedulerOutput, StepOutput
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams

EOS = 0
TOKEN = 7


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_request(rid: str, prompt: list[int], max_tokens: int = 4, **params) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), max_tokens)


class FakeRunner:
    """Runner-side mirror of every request, built only from what the scheduler sends."""

    def __init__(self, block_size: int, token_fn: Callable[[dict], int] | None = None):
        self.block_size = block_size
        self.token_fn = token_fn or (lambda state: TOKEN)
        self.states: dict[str, dict] = {}
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.num_sent: dict[str, int] = {}  # request id -> times sent as new (ids may be reused)
        self.num_finished: dict[str, int] = {}  # request id -> times reported finished

    def execute(self, so: SchedulerOutput, sched: Scheduler) -> StepOutput:
        bs = self.block_size
        # Copied prefix hits, before the step writes anything; every source is read before any destination is
        # written (as `kv_cache.copy_blocks` does), and before the step's fresh blocks are wiped: a source may be
        # handed out again in this very step (the real runner zeroes fresh blocks after the copies too).
        moved = [{o: self.kv.get((src, o)) for o in range(bs)} for src, _ in so.block_copies]
        for (_, dst), slots in zip(so.block_copies, moved):
            for o, content in slots.items():
                self.kv[(dst, o)] = content
        fresh = [b for new in so.new_requests for b in new.block_ids[new.num_computed_tokens // bs :]]
        for cached in so.cached_requests:
            skip = cached.num_computed_tokens // bs if cached.resumed else 0
            fresh += cached.new_block_ids[skip:]
        for block in fresh:
            for o in range(bs):
                self.kv.pop((block, o), None)
        for rid in so.finished_request_ids:
            assert rid not in sched.requests, f"{rid} reported finished while still live"
            # Reported once per life: a second report would find no state here.
            assert rid in self.states, f"{rid} reported finished twice, or never known to the runner"
            self.num_finished[rid] = self.num_finished.get(rid, 0) + 1
            del self.states[rid]
        for new in so.new_requests:
            assert new.request_id not in self.states, f"{new.request_id} sent as new while already known"
            self.num_sent[new.request_id] = self.num_sent.get(new.request_id, 0) + 1
            self.states[new.request_id] = dict(
                tokens=list(new.prompt_token_ids),
                params=new.sampling_params,
                outputs=[],
                blocks=list(new.block_ids),
                computed=new.num_computed_tokens,
            )
        for cached in so.cached_requests:
            state = self.states[cached.request_id]
            if cached.resumed:
                state["blocks"] = list(cached.new_block_ids)
            else:
                assert cached.num_computed_tokens == state["computed"], "runner and scheduler disagree"
                state["blocks"].extend(cached.new_block_ids)
            state["computed"] = cached.num_computed_tokens
        sampled = {}
        for rid, n in so.num_scheduled_tokens.items():
            state = self.states[rid]
            request = sched.requests.get(rid)
            if request is not None:  # None: aborted while this step was in flight
                assert state["blocks"] == request.block_ids, f"{rid}: runner block table is stale"
                assert state["tokens"] == request.prompt_token_ids + request.output_token_ids
            start, end = state["computed"], state["computed"] + n
            assert end <= len(state["tokens"]), f"{rid}: scheduled past its last token"
            assert len(state["blocks"]) * bs >= end, f"{rid}: not enough blocks for its tokens"
            toks = state["tokens"]
            for p in range(start):  # attention reads the whole prefix
                assert self.kv.get((state["blocks"][p // bs], p % bs)) == tuple(toks[: p + 1]), (
                    f"{rid}: KV slot for position {p} holds other content"
                )
            for p in range(start, end):
                self.kv[(state["blocks"][p // bs], p % bs)] = tuple(toks[: p + 1])
            state["computed"] = end
            # The scheduler names the rows that sample; the runner samples exactly those.
            assert (end == len(toks)) == (rid in so.sampling_request_ids), f"{rid}: sampling decided wrongly"
            if end == len(toks):
                token = self.token_fn(state)
                toks.append(token)
                state["outputs"].append(token)
                sampled[rid] = token
        return StepOutput(sampled)


def naive_encoder_chunk(
    request: Request, start: int, n_max: int, left: int, limit: int, fresh: bool
) -> tuple[int, int]:
    """The longest chunk [start, start + n) with n <= n_max whose newly started items fit `left`
    placeholder tokens (or that starts a single item, when nothing was encoded yet this step), and
    what is left after it. "Newly started": overlapping the chunk and beginning inside it, or any
    overlapping item when the request is `fresh` (admitted now). Brute force over every n."""

    def new_items(n: int) -> list:
        return [
            it
            for it in request.mm_inputs.items
            if it.offset < start + n and it.end > start and (fresh or it.offset >= start)
        ]

    for n in range(n_max, 0, -1):
        items = new_items(n)
        cost = sum(it.length for it in items)
        if not items or cost <= left or (left == limit and len(items) == 1):
            return n, left - cost
    return 0, left


class Harness:
    def __init__(
        self,
        *,
        num_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=1024,
        prefix_caching=True,
        eos=(EOS,),
        token_fn=None,
        scheduling_policy="fcfs",
        max_encoder_tokens_per_step=None,
        block_manager=None,
    ):
        self.config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            async_scheduling=False,
            scheduling_policy=scheduling_policy,
            max_encoder_tokens_per_step=max_encoder_tokens_per_step,
        )
        self.bm = BlockManager(num_blocks, block_size, prefix_caching, **(block_manager or {}))
        self.sched = Scheduler(self.config, self.bm, set(eos))
        self.runner = FakeRunner(block_size, token_fn)
        self.bs = block_size
        self.admission = {}  # request id -> admission counter (latest admission)
        self.counter = 0
        self.outputs: list[SchedulerOutput] = []
        self.all_requests: dict[str, Request] = {}
        self.num_steps = 0

    def add(self, request: Request) -> Request:
        self.sched.add_request(request)
        self.all_requests[request.request_id] = request
        return request

    # ---- one checked step -------------------------------------------------------------------
    def step(self, abort_during_step: list[str] = ()) -> SchedulerOutput:
        sched, cfg, bs = self.sched, self.config, self.bs
        R = list(sched.running)
        W = list(sched.waiting)
        before = {r.request_id: (r.num_computed_tokens, r.num_tokens, list(r.block_ids)) for r in R + W}
        chunks_before = sched.stats.num_chunked_prefills
        preempt_before = sched.stats.num_preemptions
        assert [self.admission[r.request_id] for r in R] == sorted(self.admission[r.request_id] for r in R)

        so = sched.schedule()
        self.outputs.append(so)
        S = list(so.num_scheduled_tokens)
        # Limits.
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(S) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
        assert all(n >= 1 for n in so.num_scheduled_tokens.values())
        # Running first (in admission order), then waiting FCFS.
        k = 0
        while k < len(S) and sched.requests[S[k]] in R:
            k += 1
        P = [r for r in R if r.status is RequestStatus.PREEMPTED]
        kept = [r for r in R if r not in P]
        # Chunk sizes of the running requests, replayed with the naive encoder-budget rule (0: skipped).
        expected, budget, enc_left = {}, cfg.max_num_batched_tokens, cfg.max_encoder_tokens_per_step
        for r in kept:
            if budget <= 0:
                break
            computed_before, num_tokens, _ = before[r.request_id]
            n = min(num_tokens - computed_before, budget)
            if enc_left is not None and r.mm_inputs is not None:
                n, enc_left = naive_encoder_chunk(
                    r, computed_before, n, enc_left, cfg.max_encoder_tokens_per_step, False
                )
            expected[r.request_id] = n
            budget -= n
        scheduled_running = [r for r in kept if expected.get(r.request_id, 0) > 0]
        assert [sched.requests[rid] for rid in S[:k]] == scheduled_running
        admitted = [sched.requests[rid] for rid in S[k:]]
        # A later sample still holding `prefill_after` was passed over for its first sample's prompt blocks.
        order = [r for r in W if r.prefill_after is None]
        assert admitted == order[: len(admitted)], "waiting requests must be admitted FCFS, after running ones"
        # Preemption: the most recently admitted running requests, then to the front of waiting.
        assert P == R[len(R) - len(P) :], "preempted a request that was not the most recently admitted"
        assert sched.stats.num_preemptions - preempt_before == len(P)
        if P:
            assert not admitted, "no admission in a step that preempted"
            assert list(sched.waiting)[: len(P)] == P
            for r in P:
                assert r.block_ids == [] and r.num_computed_tokens == 0
        assert list(sched.running) == kept + admitted
        if k < len(scheduled_running):
            assert so.total_num_scheduled_tokens == cfg.max_num_batched_tokens, "running request skipped"
        # Chunk sizes: all remaining tokens, cut to what is left of the budget.
        budget = cfg.max_num_batched_tokens
        expect_chunks = 0
        data = {d.request_id: d for d in so.new_requests}
        cached = {d.request_id: d for d in so.cached_requests}
        assert len(data) == len(so.new_requests) and len(cached) == len(so.cached_requests)
        assert set(data) | set(cached) == set(S) and not set(data) & set(cached)
        starts = {}
        for rid in S:
            request = sched.requests[rid]
            computed_before, num_tokens, blocks_before = before[rid]
            if request in R:
                start = computed_before
                d = cached[rid]
                assert not d.resumed and d.num_computed_tokens == computed_before
                assert d.new_block_ids == request.block_ids[len(blocks_before) :]
                assert request.block_ids[: len(blocks_before)] == blocks_before
            else:
                # The prefix hit found at admission (num_computed_tokens has moved past this step already).
                start = (data[rid] if rid in data else cached[rid]).num_computed_tokens
                assert request.num_computed_tokens == start + so.num_scheduled_tokens[rid]
                assert computed_before == 0 and blocks_before == []
                assert start % bs == 0 and start <= num_tokens - 1
                if not self.bm.enable_prefix_caching:
                    assert start == 0
                if rid in self.runner.states and rid not in so.finished_request_ids:  # preempted earlier
                    d = cached[rid]
                    assert d.resumed and d.new_block_ids == request.block_ids and d.num_computed_tokens == start
                else:
                    d = data[rid]
                    assert d.block_ids == request.block_ids and d.num_computed_tokens == start
                    assert d.prompt_token_ids == request.prompt_token_ids
                    assert request.num_cached_tokens == start, "num_cached_tokens = hits at first admission"
                self.counter += 1
                self.admission[rid] = self.counter
            starts[rid] = start
            n = so.num_scheduled_tokens[rid]
            want = min(num_tokens - start, budget)
            if request in R:
                want = expected[rid]
            elif enc_left is not None and request.mm_inputs is not None:
                want, enc_left = naive_encoder_chunk(
                    request, start, want, enc_left, cfg.max_encoder_tokens_per_step, True
                )
            assert n == want, f"{rid}: chunk {n} is not min(remaining, budget) cut by the encoder budget ({want})"
            budget -= n
            if start + n < request.num_prompt_tokens:
                expect_chunks += 1
            assert request.status is RequestStatus.RUNNING
            assert len(request.block_ids) == max(len(blocks_before), cdiv(start + n, bs)), "exactly enough blocks"
        assert sched.stats.num_chunked_prefills - chunks_before == expect_chunks
        # Whatever still waits (including a head that could not be admitted) holds nothing.
        for r in sched.waiting:
            assert r.block_ids == [] and r.num_computed_tokens == 0 and r.status is not RequestStatus.RUNNING

        for rid in abort_during_step:
            sched.abort_requests([rid])
        step_out = self.runner.execute(so, sched)
        updated = sched.update(so, step_out)
        self.num_steps += 1
        # After the step.
        assert {r.request_id for r in updated} == set(step_out.sampled_token_ids) - set(abort_during_step)
        for rid, n in so.num_scheduled_tokens.items():
            if rid in abort_during_step:
                continue
            request = self.all_requests[rid]
            assert request.num_computed_tokens == starts[rid] + n
            if rid in step_out.sampled_token_ids:
                assert request.output_token_ids[-1] == step_out.sampled_token_ids[rid]
                assert request.num_computed_tokens == request.num_tokens - 1
        self.check_pool()
        return so

    def check_pool(self) -> None:
        live = list(self.sched.requests.values())
        self.bm.check_integrity(live)
        held = {b for r in live for b in r.block_ids}
        assert self.bm.num_free_blocks == self.bm.num_usable_blocks - len(held)
        for r in self.all_requests.values():
            if r.status.is_finished:
                assert r.block_ids == [] and r.request_id not in self.sched.requests
                assert r not in self.sched.running and r not in self.sched.waiting
        for r in live:
            assert r.num_tokens <= self.config.max_model_len
            assert r.num_output_tokens <= r.max_tokens

    def run(self, arrivals: dict[int, list[Request]] | None = None, max_steps: int = 10_000) -> None:
        arrivals = dict(arrivals or {})
        while self.sched.has_unfinished() or arrivals:
            for r in arrivals.pop(self.num_steps, []):
                self.add(r)
            self.step()
            assert self.num_steps < max_steps, "no progress"
        self.drain()

    def drain(self) -> None:
        so = self.sched.schedule()  # delivers the last finished ids
        self.outputs.append(so)
        assert so.is_empty and not so.new_requests and not so.cached_requests
        self.runner.execute(so, self.sched)
        assert self.bm.num_free_blocks == self.bm.num_blocks - 1
        assert not any(self.bm.ref_count)
        self.bm.check_integrity([])
        assert not self.runner.states, "every request the runner knew must be reported finished"
        assert self.runner.num_finished == self.runner.num_sent


def finish_reason(r: Request) -> str | None:
    return r.status.finish_reason


# ------------------------------------------------------------------------------------------------
# Randomized workloads
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    prefix_caching = rng.random() < 0.7
    max_prompt, max_out = rng.randint(2, 40), rng.randint(1, 24)
    longest = max_prompt + max_out
    num_blocks = cdiv(longest, bs) + 1 + rng.randint(0, 4)  # one longest request always fits
    h = Harness(
        num_blocks=num_blocks,
        block_size=bs,
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.choice([1, 3, 8, 16, 64]),
        prefix_caching=prefix_caching,
        token_fn=lambda s: 7 if rng.random() < 0.7 else 3,
        # Half the seeds run the CPU's pool: runs preferred, prefix hits copied into them where that pays.
        block_manager=(
            dict(prefer_runs=True, copy_hits_max_tokens=rng.choice([bs, 64]), copy_hits_below=rng.choice([1, 3]))
            if seed % 2
            else None
        ),
    )
    bases = [[rng.randint(1, 3) for _ in range(max_prompt)] for _ in range(2)]
    arrivals: dict[int, list[Request]] = {}
    requests = []
    for i in range(rng.randint(1, 12)):
        base = rng.choice(bases)
        prompt = base[: rng.randint(0, max_prompt)] or [1]
        prompt = (prompt + [rng.randint(1, 3) for _ in range(rng.randint(0, 3))])[:max_prompt]
        r = make_request(f"r{i}", prompt, max_tokens=rng.randint(1, max_out))
        requests.append(r)
        arrivals.setdefault(rng.randint(0, 10), []).append(r)
    h.run(arrivals)
    for r in requests:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == r.max_tokens
        assert r.num_cached_tokens >= 0


def test_random_workloads_with_aborts():
    for seed in range(15):
        rng = random.Random(1000 + seed)
        bs = rng.choice([1, 2, 4])
        h = Harness(
            num_blocks=cdiv(30, bs) + 1 + rng.randint(0, 6),
            block_size=bs,
            max_num_seqs=rng.randint(1, 4),
            max_num_batched_tokens=rng.randint(2, 16),
        )
        reqs = [
            h.add(
                make_request(
                    f"r{i}", [rng.randint(1, 3) for _ in range(rng.randint(1, 20))], max_tokens=rng.randint(1, 10)
                )
            )
            for i in range(8)
        ]
        aborted = set()
        while h.sched.has_unfinished():
            live = list(h.sched.requests)
            during = []
            if live and rng.random() < 0.15:
                rid = rng.choice(live)
                h.sched.abort_requests([rid])
                aborted.add(rid)
                h.check_pool()
            elif live and rng.random() < 0.1:
                during = [rng.choice(live)]
                aborted.update(during)
            if h.sched.has_unfinished():
                h.step(abort_during_step=during)
        h.drain()
        for r in reqs:
            if r.request_id in aborted:
                assert r.status is RequestStatus.FINISHED_ABORTED and finish_reason(r) == "abort"
            else:
                assert r.num_output_tokens == r.max_tokens and r.status is RequestStatus.FINISHED_LENGTH


# ------------------------------------------------------------------------------------------------
# Deterministic scenarios
# ------------------------------------------------------------------------------------------------


def test_token_budget_and_chunked_prefill():
    h = Harness(block_size=4, max_num_batched_tokens=16)
    a = h.add(make_request("a", [1, 2, 3], max_tokens=10))
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 3}
    b = h.add(make_request("b", list(range(1, 51)), max_tokens=2))  # 50-token prompt
    sizes = []
    while b.num_output_tokens == 0:
        so = h.step()
        assert so.num_scheduled_tokens["a"] == 1  # a keeps decoding, first
        assert list(so.num_scheduled_tokens)[0] == "a"
        sizes.append(so.num_scheduled_tokens["b"])
    assert sizes == [15, 15, 15, 5]
    assert h.sched.stats.num_chunked_prefills == 3
    h.run()
    assert a.num_output_tokens == 10 and b.num_output_tokens == 2


def test_max_num_seqs_and_fcfs():
    h = Harness(max_num_seqs=2, max_num_batched_tokens=100)
    reqs = [h.add(make_request(f"r{i}", [i + 1] * 3, max_tokens=2 + i)) for i in range(5)]
    order = []
    while h.sched.has_unfinished():
        so = h.step()
        assert len(so.num_scheduled_tokens) <= 2
        order += [d.request_id for d in so.new_requests]
    h.drain()
    assert order == ["r0", "r1", "r2", "r3", "r4"]
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)


def test_waiting_head_blocks_admission_fcfs():
    # r1 does not fit while r0 runs; r2 would fit but must not jump ahead of r1.
    h = Harness(num_blocks=1 + 4, block_size=4, max_num_batched_tokens=64)
    h.add(make_request("r0", [1] * 8, max_tokens=4))  # 2 blocks, 3 by the end
    h.add(make_request("r1", [2] * 9, max_tokens=1))  # 3 blocks
    h.add(make_request("r2", [3] * 2, max_tokens=1))  # 1 block
    so = h.step()
    assert list(so.num_scheduled_tokens) == ["r0"]
    order = [d.request_id for d in so.new_requests]
    while h.sched.has_unfinished():
        order += [d.request_id for d in h.step().new_requests]
    h.drain()
    assert order == ["r0", "r1", "r2"]


def test_preemption_recompute_and_resume():
    bs = 2
    h = Harness(num_blocks=1 + 6, block_size=bs, max_num_batched_tokens=64)
    reqs = [h.add(make_request(f"r{i}", [i + 1] * 3, max_tokens=8)) for i in range(3)]  # 3 + 8 = 11 tokens
    resumed = []
    preempted_ids = []
    while h.sched.has_unfinished():
        running_before = list(h.sched.running)
        so = h.step()
        for r in running_before:
            if r.status is RequestStatus.PREEMPTED:
                preempted_ids.append(r.request_id)
        resumed += [d for d in so.cached_requests if d.resumed]
    h.drain()
    assert h.sched.stats.num_preemptions > 0
    assert preempted_ids[0] == "r2"  # the most recently admitted goes first
    assert resumed, "a preempted request must come back as resumed CachedRequestData"
    assert {d.request_id for d in resumed} <= set(preempted_ids)
    for r in reqs:
        assert r.num_output_tokens == 8 and r.output_token_ids == [TOKEN] * 8
        assert r.status is RequestStatus.FINISHED_LENGTH
    assert sum(r.num_preemptions for r in reqs) == h.sched.stats.num_preemptions


def test_preempted_request_recomputes_its_outputs():
    # Without prefix caching a resumed request recomputes prompt + output from scratch.
    bs = 2
    h = Harness(
        num_blocks=1 + 5,
        block_size=bs,
        max_num_batched_tokens=64,
        prefix_caching=False,
        token_fn=lambda s: 10 + len(s["outputs"]),
    )
    a = h.add(make_request("a", [1, 1, 1], max_tokens=6))
    b = h.add(make_request("b", [2, 2, 2], max_tokens=6))
    seen = False
    while h.sched.has_unfinished():
        so = h.step()
        for d in so.cached_requests:
            if d.resumed:
                seen = True
                r = h.all_requests[d.request_id]
                assert d.num_computed_tokens == 0 and r.num_output_tokens > 0
                # The whole prompt + the kept outputs are recomputed in one go (the budget allows it),
                # so it samples its next token in this very step.
                assert so.num_scheduled_tokens[d.request_id] == 3 + r.num_output_tokens - 1
    h.drain()
    assert seen and h.sched.stats.num_preemptions > 0
    assert a.output_token_ids == [10, 11, 12, 13, 14, 15] == b.output_token_ids


def test_self_preemption():
    # b, the most recently admitted, is the one that needs a new block: it preempts itself, a keeps
    # running, and b comes back once a has finished.
    h = Harness(num_blocks=1 + 4, block_size=2, max_num_batched_tokens=64)
    a = h.add(make_request("a", [1, 1, 1], max_tokens=3))  # computes at most 5 tokens: 3 blocks
    b = h.add(make_request("b", [2, 2, 2, 2], max_tokens=2))  # its 5th token needs a 3rd block
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 3, "b": 4} and h.bm.num_free_blocks == 0
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 1}
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1 and list(h.sched.waiting) == [b]
    assert b.output_token_ids == [TOKEN] and b.block_ids == []
    h.run()
    assert a.num_output_tokens == 3 and b.output_token_ids == [TOKEN, TOKEN]
    assert h.sched.stats.num_preemptions == 1


def test_eos_stops_unless_ignore_eos():
    h = Harness(token_fn=lambda s: EOS)
    a = h.add(make_request("a", [1, 2], max_tokens=5))
    b = h.add(make_request("b", [1, 2], max_tokens=5, ignore_eos=True))
    h.run()
    assert a.output_token_ids == [EOS] and a.status is RequestStatus.FINISHED_STOPPED
    assert a.stop_reason is None and finish_reason(a) == "stop"
    assert b.output_token_ids == [EOS] * 5 and b.status is RequestStatus.FINISHED_LENGTH
    assert finish_reason(b) == "length"


def test_multiple_eos_ids():
    h = Harness(eos=(0, 5), token_fn=lambda s: 5)
    a = h.add(make_request("a", [1], max_tokens=5))
    h.run()
    assert a.output_token_ids == [5] and a.status is RequestStatus.FINISHED_STOPPED


def test_min_tokens_delays_stop():
    # Like the real runner, suppress EOS / stop ids while fewer than min_tokens were sampled.
    def token_fn(state):
        return 3 if len(state["outputs"]) < state["params"].min_tokens else EOS

    h = Harness(token_fn=token_fn)
    a = h.add(make_request("a", [1, 2], max_tokens=10, min_tokens=4))
    h.run()
    assert a.output_token_ids == [3, 3, 3, 3, EOS] and a.status is RequestStatus.FINISHED_STOPPED

    # Even if the runner produced EOS / a stop id early, the scheduler must not stop before
    # min_tokens outputs exist.
    h = Harness(token_fn=lambda s: EOS)
    b = h.add(make_request("b", [1, 2], max_tokens=10, min_tokens=3))
    c = h.add(make_request("c", [1, 2], max_tokens=10, min_tokens=3, stop_token_ids=[EOS], ignore_eos=True))
    h.run()
    assert b.num_output_tokens == 3 and b.status is RequestStatus.FINISHED_STOPPED
    assert c.num_output_tokens == 3 and c.stop_reason == EOS
    # min_tokens does not hold back max_tokens.
    h = Harness(token_fn=lambda s: 3)
    d = h.add(make_request("d", [1], max_tokens=2, min_tokens=2))
    h.run()
    assert d.num_output_tokens == 2 and d.status is RequestStatus.FINISHED_LENGTH


def test_stop_token_ids_set_stop_reason():
    seq = [4, 5, 9, 6]
    h = Harness(token_fn=lambda s: seq[len(s["outputs"])])
    a = h.add(make_request("a", [1, 2, 3], max_tokens=10, stop_token_ids=[9]))
    b = h.add(make_request("b", [1, 2, 3], max_tokens=10, stop_token_ids=[9], ignore_eos=True))
    h.run()
    for r in (a, b):
        assert r.output_token_ids == [4, 5, 9]
        assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == 9


def test_max_model_len_caps_request():
    h = Harness(max_model_len=10)
    a = h.add(make_request("a", [1] * 6, max_tokens=100))
    b = h.add(make_request("b", [2] * 9, max_tokens=100))
    h.run()
    assert a.num_output_tokens == 4 and a.num_tokens == 10 and a.status is RequestStatus.FINISHED_LENGTH
    assert b.num_output_tokens == 1 and finish_reason(b) == "length"


def test_abort_frees_blocks_and_reports_once():
    h = Harness(num_blocks=1 + 8, block_size=2, max_num_seqs=2, max_num_batched_tokens=64)
    a = h.add(make_request("a", [1] * 5, max_tokens=10))
    b = h.add(make_request("b", [2] * 5, max_tokens=10))
    c = h.add(make_request("c", [3] * 3, max_tokens=2))  # waits: max_num_seqs=2
    h.step()
    h.step()
    assert a.block_ids and c.status is RequestStatus.WAITING
    free_before = h.bm.num_free_blocks
    n_a = len(a.block_ids)
    h.sched.abort_requests(["a", "c", "nope"])
    assert a.block_ids == [] and h.bm.num_free_blocks == free_before + n_a
    assert a.status is RequestStatus.FINISHED_ABORTED and c.status is RequestStatus.FINISHED_ABORTED
    h.check_pool()
    so = h.step()
    assert so.finished_request_ids == {"a"}  # c never reached the runner
    assert "a" not in so.num_scheduled_tokens
    # Aborted while the step ran: the update skips it and the next step reports it.
    so = h.step(abort_during_step=["b"])
    assert "b" in so.num_scheduled_tokens
    assert b.block_ids == [] and b.status is RequestStatus.FINISHED_ABORTED
    so = h.sched.schedule()
    assert so.finished_request_ids == {"b"} and so.is_empty
    h.runner.execute(so, h.sched)
    assert h.sched.schedule().finished_request_ids == set()
    assert h.bm.num_free_blocks == h.bm.num_blocks - 1


def test_finished_ids_reported_once_and_new_requests_sent_once():
    h = Harness(num_blocks=1 + 6, block_size=2, max_num_batched_tokens=8)
    for i in range(6):
        h.add(make_request(f"r{i}", [i + 1] * (2 + i), max_tokens=3 + i % 3))
    h.run()
    finished = [rid for so in h.outputs for rid in so.finished_request_ids]
    assert sorted(finished) == [f"r{i}" for i in range(6)]
    news = [d.request_id for so in h.outputs for d in so.new_requests]
    assert sorted(news) == [f"r{i}" for i in range(6)]


def test_request_id_reused_after_finish_is_new_again():
    h = Harness()
    a1 = h.add(make_request("a", [1, 2, 3], max_tokens=2))
    h.run()
    a2 = h.add(make_request("a", [4, 5], max_tokens=3))
    so = h.step()
    assert [d.request_id for d in so.new_requests] == ["a"] and not so.cached_requests
    h.run()
    assert a1.num_output_tokens == 2 and a2.num_output_tokens == 3
    assert h.runner.num_sent == {"a": 2} and h.runner.num_finished == {"a": 2}


def test_prefix_hits_reported_at_admission():
    bs = 4
    h = Harness(block_size=bs, max_num_batched_tokens=64)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    a = h.add(make_request("a", prompt, max_tokens=2))
    h.run()
    assert a.num_cached_tokens == 0
    b = h.add(make_request("b", prompt, max_tokens=2))
    so = h.step()
    assert so.new_requests[0].num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert so.num_scheduled_tokens == {"b": 1}
    h.run()
    h.add(make_request("c", prompt[:12], max_tokens=1))  # fully cached prompt: last token recomputed
    so = h.step()
    assert so.new_requests[0].num_computed_tokens == 8 and so.num_scheduled_tokens == {"c": 4}
    h.run()


def test_num_cached_tokens_counts_the_admission_that_succeeded():
    # b's first admission attempt finds a's cached prefix but cannot get the rest of its blocks;
    # by the time it is admitted that prefix was evicted, so nothing was served from the cache.
    bs = 2
    h = Harness(num_blocks=1 + 8, block_size=bs, max_num_seqs=4, max_num_batched_tokens=64)
    a = h.add(make_request("a", [5, 5, 5, 5, 5], max_tokens=1))  # 3 blocks, 2 full cached
    h.run()
    c = h.add(make_request("c", [1] * 3, max_tokens=12))  # grows to 15 tokens: 8 blocks
    h.step()
    b = h.add(make_request("b", [5, 5, 5, 5] + [6] * 9, max_tokens=1))  # 13 tokens: 7 blocks
    so = h.step()
    assert "b" not in so.num_scheduled_tokens  # 2 prefix blocks hit, 5 more don't fit
    h.run()
    assert a.num_output_tokens == 1 and c.num_output_tokens == 12
    hits = [d.num_computed_tokens for so in h.outputs for d in so.new_requests if d.request_id == "b"]
    assert hits == [2]  # c's growth evicted the second block
    assert b.num_cached_tokens == hits[0]


# ------------------------------------------------------------------------------------------------
# --scheduling-policy priority
# ------------------------------------------------------------------------------------------------


def _plain_step(h: Harness) -> SchedulerOutput:
    """One step without the FCFS checks of `Harness.step` (the runner's KV and block checks still run)."""
    so = h.sched.schedule()
    h.outputs.append(so)
    h.sched.update(so, h.runner.execute(so, h.sched))
    h.num_steps += 1
    h.check_pool()
    return so


def _prioritised(rid: str, priority: int, arrival: float, prompt: list[int], max_tokens: int) -> Request:
    request = make_request(rid, prompt, max_tokens=max_tokens)
    request.priority, request.arrival_time = priority, arrival
    return request


def test_priority_admits_lower_values_first_and_equals_in_arrival_order():
    h = Harness(max_num_seqs=1, max_num_batched_tokens=100, scheduling_policy="priority")
    for rid, priority, arrival in [("a", 5, 1.0), ("b", 0, 2.0), ("c", -3, 3.0), ("d", 0, 0.5), ("e", 5, 0.1)]:
        h.add(_prioritised(rid, priority, arrival, [1, 2, 3], max_tokens=2))
    order = []
    while h.sched.has_unfinished():
        order += [d.request_id for d in _plain_step(h).new_requests]
    h.drain()
    assert order == ["c", "d", "b", "e", "a"]


def test_fcfs_ignores_priority():
    h = Harness(max_num_seqs=1, max_num_batched_tokens=100)
    for rid, priority in [("a", 5), ("b", -5)]:
        h.add(_prioritised(rid, priority, 0.0, [1, 2, 3], max_tokens=2))
    order = []
    while h.sched.has_unfinished():
        order += [d.request_id for d in h.step().new_requests]
    assert order == ["a", "b"]


def test_priority_preempts_the_least_urgent_running_request():
    # Three requests that all need a new block at once; the pool has room for two. Under FCFS the most
    # recently admitted (low) would go; by priority it is the one with the highest value (late), although it
    # was admitted first.
    h = Harness(num_blocks=1 + 6, block_size=2, max_num_batched_tokens=64, scheduling_policy="priority")
    late = h.add(_prioritised("late", 9, 0.0, [1, 1, 1], max_tokens=6))
    urgent = h.add(_prioritised("urgent", -1, 1.0, [2, 2, 2], max_tokens=6))
    mid = h.add(_prioritised("mid", 0, 2.0, [3, 3, 3], max_tokens=6))
    so = _plain_step(h)
    assert set(so.num_scheduled_tokens) == {"late", "urgent", "mid"}
    assert [r.request_id for r in h.sched.running] == ["urgent", "mid", "late"]
    first_preempted = None
    while h.sched.has_unfinished():
        running = list(h.sched.running)
        _plain_step(h)
        gone = [r for r in running if r.status is RequestStatus.PREEMPTED]
        if gone and first_preempted is None:
            first_preempted = gone[0]
    h.drain()
    assert first_preempted is late and urgent.num_preemptions == 0
    for r in (late, urgent, mid):
        assert r.output_token_ids == [TOKEN] * 6


# ---- the encoder budget (multimodal prompts) ------------------------------------------------------


def mm_request(rid: str, prompt_len: int, items: list[tuple[int, int, bytes]], max_tokens: int = 3) -> Request:
    """A prompt with multimodal items (offset, length, content) over placeholder-free token ids."""
    request = make_request(rid, [(i * 7 + len(rid)) % 50 + 1 for i in range(prompt_len)], max_tokens)
    request.mm_inputs = MultiModalInputs(
        [
            MultiModalItem("image", np.zeros(1, np.uint8), (1, 2, 2 * length), offset, length, content.ljust(16, b"."))
            for offset, length, content in items
        ],
        np.zeros((3, prompt_len), np.int64),
        0,
    )
    return request


def started_items(h: Harness, so: SchedulerOutput, starts: dict[str, int]) -> list[int]:
    """Lengths of the items whose first placeholder token is computed in this step."""
    lengths = []
    for rid, n in so.num_scheduled_tokens.items():
        request = h.all_requests[rid]
        if request.mm_inputs is not None:
            lengths += [it.length for it in request.mm_inputs.items if starts[rid] <= it.offset < starts[rid] + n]
    return lengths


def run_recording_starts(h: Harness, requests: list[Request]) -> list[list[int]]:
    for r in requests:
        h.add(r)
    per_step = []
    while h.sched.has_unfinished():
        starts = {rid: r.num_computed_tokens for rid, r in h.sched.requests.items()}
        so = h.step()
        # Admitted now (new, or resumed after preemption): the step starts at its prefix hit.
        for d in [*so.new_requests, *(c for c in so.cached_requests if c.resumed)]:
            starts[d.request_id] = d.num_computed_tokens
        per_step.append(started_items(h, so, starts))
    h.drain()
    return per_step


def test_encoder_budget_bounds_the_images_a_step_starts():
    requests = [mm_request(f"r{i}", 40, [(4, 12, b"a%d" % i), (20, 12, b"b%d" % i)]) for i in range(4)]
    h = Harness(num_blocks=128, max_num_batched_tokens=128, max_encoder_tokens_per_step=24)
    per_step = run_recording_starts(h, requests)
    assert all(sum(step) <= 24 for step in per_step)
    assert sorted(length for step in per_step for length in step) == [12] * 8  # every image once
    # Without the limit the first step starts all eight (the token budget holds 3 of 4 prompts).
    h = Harness(num_blocks=128, max_num_batched_tokens=128)
    requests = [mm_request(f"r{i}", 40, [(4, 12, b"a%d" % i), (20, 12, b"b%d" % i)]) for i in range(4)]
    assert sum(run_recording_starts(h, requests)[0]) > 24


def test_an_item_larger_than_the_budget_runs_alone():
    requests = [mm_request("big", 50, [(2, 30, b"big")]), mm_request("small", 20, [(2, 6, b"small")])]
    h = Harness(num_blocks=128, max_num_batched_tokens=128, max_encoder_tokens_per_step=8)
    per_step = run_recording_starts(h, requests)
    assert [30] in per_step and [6] in per_step and all(len(step) <= 1 for step in per_step)


def test_decodes_keep_going_while_images_wait_for_encoder_budget():
    h = Harness(num_blocks=256, max_num_batched_tokens=256, max_encoder_tokens_per_step=16)
    text = make_request("text", list(range(1, 9)), max_tokens=12)
    h.add(text)
    h.step()
    for i in range(6):
        h.add(mm_request(f"img{i}", 30, [(2, 16, b"i%d" % i)]))
    while not text.status.is_finished:
        so = h.step()
        assert "text" in so.num_scheduled_tokens, "the running text request waited for the images"
    h.run()


@pytest.mark.parametrize("seed", range(12))
def test_encoder_budget_random_workloads(seed):
    """Random prompts with images (some repeated, so prefix hits may end inside one), random limits and
    budgets, preemption from a small pool: every step matches the naive rule (Harness.step) and every
    request finishes with its tokens."""
    rng = random.Random(seed)
    limit = rng.choice([4, 10, 24, 64])
    h = Harness(
        num_blocks=rng.choice([24, 48, 96]),
        block_size=4,
        max_num_batched_tokens=rng.choice([16, 40, 96]),
        max_num_seqs=rng.choice([2, 4, 8]),
        max_encoder_tokens_per_step=limit,
    )
    arrivals: dict[int, list[Request]] = {}
    for i in range(10):
        prompt_len = rng.randint(12, 60)
        items, pos = [], rng.randint(0, 6)
        while pos < prompt_len - 4 and len(items) < 3:
            length = min(rng.randint(2, 20), prompt_len - pos - 1)
            items.append((pos, length, b"img%d" % rng.randint(0, 3)))
            pos += length + rng.randint(0, 8)
        request = mm_request(f"q{i}", prompt_len, items, max_tokens=rng.randint(1, 6))
        if i % 3 == 0:  # the same prompt again: its image blocks hit the prefix cache
            request.prompt_token_ids = list(arrivals.get(0, [request])[0].prompt_token_ids[:prompt_len])
            request.prompt_token_ids += [1] * (prompt_len - len(request.prompt_token_ids))
        arrivals.setdefault(rng.randint(0, 8), []).append(request)
    h.run(arrivals)
    for r in h.all_requests.values():
        assert r.num_output_tokens == r.max_tokens or finish_reason(r) == "stop"


def test_later_samples_of_one_request_wait_for_the_first_samples_prompt_blocks():
    # n = 2 as the engine queues it: the second sample starts from the first's cached prompt blocks, so the
    # 10-token prompt (two full blocks of 4) is computed once, not in one step of twice its rows.
    h = Harness(block_size=4, max_num_batched_tokens=64)
    prompt = list(range(1, 11))
    first = h.add(make_request("r-0", prompt, max_tokens=3))
    second = make_request("r-1", prompt, max_tokens=3)
    second.prefill_after = first
    h.add(second)
    later = h.add(make_request("other", [7, 7, 7, 7, 7], max_tokens=3))  # not held behind the waiting sample
    so = h.step()
    assert so.num_scheduled_tokens == {"r-0": 10, "other": 5}
    so = h.step()
    assert so.num_scheduled_tokens == {"r-0": 1, "other": 1, "r-1": 2}  # prompt tokens 8 and 9 only
    assert second.num_cached_tokens == 8 and second.prefill_after is None
    h.run()
    assert first.output_token_ids == second.output_token_ids and later.num_output_tokens == 3


def test_a_later_sample_is_released_when_its_first_sample_is_gone_or_the_prompt_has_no_full_block():
    h = Harness(block_size=4, max_num_batched_tokens=64)
    first = h.add(make_request("r-0", list(range(1, 11)), max_tokens=3))
    second = make_request("r-1", list(range(1, 11)), max_tokens=3)
    second.prefill_after = first
    h.add(second)
    h.sched.abort_requests(["r-0"])
    assert h.step().num_scheduled_tokens == {"r-1": 10}
    short = h.add(make_request("s-0", [1, 2, 3], max_tokens=2))
    sibling = make_request("s-1", [1, 2, 3], max_tokens=2)
    sibling.prefill_after = short
    h.add(sibling)
    assert set(h.step().num_scheduled_tokens) >= {"s-0", "s-1"}  # nothing to share: no wait


def test_a_request_that_preempts_itself_takes_its_proposals_with_it():
    # Its proposals were counted before the allocation failed: a step must not carry proposals for a request it
    # does not schedule (the runner builds rows only for scheduled ones).
    bm = BlockManager(3, 4, True)  # one block held back: the prompt's two fill the rest
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=32,
            max_model_len=64,
            async_scheduling=False,
            scheduling_policy="fcfs",
        ),
        bm,
        {EOS},
    )
    a = make_request("a", list(range(1, 9)), max_tokens=8)  # fills both blocks
    sched.add_request(a)
    so = sched.schedule()
    sched.update(so, StepOutput({"a": 5}))
    a.spec_token_ids = [6, 7]
    so = sched.schedule()
    assert a.status is RequestStatus.PREEMPTED and "a" not in so.num_scheduled_tokens
    assert so.spec_token_ids == {}
