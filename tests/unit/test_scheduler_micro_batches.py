"""The scheduler with pipeline micro-batches (`SchedulerConfig.micro_batches` = P > 1), driven the way the
engine drives it: up to P steps launched before the oldest is read (`Scheduler.update`), the fake runner of
test_scheduler.py executing each step as it is launched (its shadow KV cache checks every read).

What must hold: no step holds a request that an unread step still owes a sampled token; each step holds at
most ceil((running + waiting) / P) requests; a steady set of decodes splits into P disjoint micro-batches
that alternate; preemption of a request whose token is in flight, prefill chunks in consecutive
micro-batches and arrivals mid-run all end with every request's tokens, as one micro-batch would give.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from pagoda.config import SchedulerConfig
from pagoda.engine.block_manager import BlockManager
from pagoda.engine.scheduler import Scheduler
from pagoda.outputs import SchedulerOutput, StepOutput
from tests.unit.test_scheduler import EOS, FakeRunner, cdiv, make_request


def config(micro_batches: int, **kw) -> SchedulerConfig:
    values = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256)
    values.update(kw)
    return SchedulerConfig(async_scheduling=False, scheduling_policy="fcfs", micro_batches=micro_batches, **values)


class MicroBatchDriver:
    def __init__(self, micro_batches: int, num_blocks: int = 64, block_size: int = 4, caching: bool = False, **kw):
        self.p = micro_batches
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.sched = Scheduler(config(micro_batches, **kw), self.bm, {EOS})
        self.runner = FakeRunner(block_size)
        self.unread: deque[tuple[SchedulerOutput, StepOutput]] = deque()
        self.steps: list[SchedulerOutput] = []

    def step(self) -> SchedulerOutput:
        sched = self.sched
        live = len(sched.running) + len(sched.waiting)
        owed = {rid for so, _ in self.unread for rid in so.sampling_request_ids}
        so = sched.schedule()
        scheduled = set(so.num_scheduled_tokens)
        assert not scheduled & owed, f"scheduled {scheduled & owed} while an unread step owes their tokens"
        assert len(scheduled) <= cdiv(live, self.p), "more than this micro-batch's share of the requests"
        out = self.runner.execute(so, sched)  # every stage runs the steps in launch order
        if not so.is_empty:
            self.unread.append((so, out))
            self.steps.append(so)
        if self.unread and (len(self.unread) >= self.p or so.is_empty):
            sched.update(*self.unread.popleft())
        return so

    def run(self, arrivals: dict[int, list], max_steps: int = 5000) -> None:
        n = 0
        while self.sched.has_unfinished() or arrivals or self.unread:
            for request in arrivals.pop(n, []):
                self.sched.add_request(request)
            self.step()
            n += 1
            assert n < max_steps, "no progress"


def test_steady_decodes_split_into_alternating_disjoint_micro_batches():
    driver = MicroBatchDriver(2)
    requests = [make_request(f"r{i}", [5 + i] * 6, max_tokens=12) for i in range(8)]
    for r in requests:
        driver.sched.add_request(r)
    driver.run({})
    decode_steps = [set(so.num_scheduled_tokens) for so in driver.steps if so.total_num_scheduled_tokens == 4]
    assert len(decode_steps) >= 10
    halves = {frozenset(s) for s in decode_steps}
    assert len(halves) == 2 and all(len(h) == 4 for h in halves), halves  # two fixed, even micro-batches
    assert all(a != b for a, b in zip(decode_steps, decode_steps[1:])), "the micro-batches alternate"
    assert all(r.num_output_tokens == 12 for r in requests)


@pytest.mark.parametrize("micro_batches", [2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_finish_every_request(micro_batches: int, seed: int):
    """Mixed prompt lengths (chunked across micro-batches), arrivals mid-run, a pool small enough to preempt
    requests whose tokens are in flight, with and without prefix caching; the fake runner's KV checks hold and
    every request ends with its max_tokens outputs, as the runner sampled them."""
    rng = random.Random(seed)
    driver = MicroBatchDriver(micro_batches, num_blocks=rng.choice([24, 40, 200]), caching=bool(seed % 2))
    arrivals: dict[int, list] = {}
    requests = []
    for i in range(rng.randrange(6, 14)):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 60))]
        request = make_request(f"q{i}", prompt, max_tokens=rng.randrange(1, 20))
        requests.append(request)
        arrivals.setdefault(rng.randrange(0, 30), []).append(request)
    driver.run(arrivals)
    for r in requests:
        assert r.status.is_finished and r.num_output_tokens == r.max_tokens
    assert driver.bm.num_free_blocks == driver.bm.num_usable_blocks
