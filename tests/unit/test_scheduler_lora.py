"""The scheduler keeps a step within max_loras adapters: a waiting request whose adapter does not fit is passed
over (it keeps its place at the front), later requests of running adapters or of the base model go ahead."""

from __future__ import annotations

from pagoda.config import SchedulerConfig
from pagoda.engine.block_manager import BlockManager
from pagoda.engine.scheduler import Scheduler
from pagoda.lora.request import LoRARequest
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams


def _request(rid: str, adapter: int | None) -> Request:
    lora = LoRARequest(f"a{adapter}", adapter, f"/adapters/{adapter}") if adapter else None
    return Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=4), 4, lora_request=lora)


def test_a_request_over_max_loras_is_passed_over_and_keeps_its_place():
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=64,
        async_scheduling=False,
        scheduling_policy="fcfs",
        max_loras_per_step=1,
    )
    sched = Scheduler(config, BlockManager(64, 4, True), {0})
    for rid, adapter in (("a", 1), ("b", 2), ("c", None), ("d", 1), ("e", 2)):
        sched.add_request(_request(rid, adapter))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["a", "c", "d"]
    assert [r.request_id for r in sched.waiting] == ["b", "e"]  # in their order, at the front
    assert [new.lora_request and new.lora_request.lora_int_id for new in out.new_requests] == [1, None, 1]
    for rid in ("a", "d"):
        sched.finish_request(rid, RequestStatus.FINISHED_ABORTED, "test")
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"c", "b", "e"}  # adapter 1 gone: adapter 2 fits now
