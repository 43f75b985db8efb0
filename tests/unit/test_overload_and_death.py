"""The API side's own counts and the core's death, without a core process: `--max-waiting-requests`
against a burst the core has not reported yet (and its share with several API processes), the core's
`received` count, a send to a core that cannot take it ending when the core dies, and `end_streams` (the
`--shutdown-timeout` cut). The pidfd noticing a real process's exit at once: tests/e2e/test_core_exit_watch.py."""

from __future__ import annotations

import asyncio
import gc
import os
import time

import pytest

from pagoda.engine.async_engine import AsyncEngine, CoreClient
from pagoda.engine.core_process import AbortRequests, AddRequest, Outputs, Ready, Shutdown, _loop
from pagoda.errors import EngineDead, Overloaded, ShuttingDown
from pagoda.outputs import CompletionOutput, EngineStats, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.server.metrics import ServerMetrics
from pagoda.server.serving import OpenAIServing, ServingContext
from pagoda.server.sse import sse_response


class _Pipe:
    """Both pipes of an AsyncEngine in memory. `stuck`: sends never complete (a core that is gone)."""

    def __init__(self, stuck: bool = False) -> None:
        self.sent: list = []
        self.stuck = stuck
        self.inbound: asyncio.Queue = asyncio.Queue()

    def send_pyobj(self, message):  # noqa: ANN001, ANN201 - the zmq.asyncio shape: a Future
        future = asyncio.get_running_loop().create_future()
        if not self.stuck:
            self.sent.append(message)
            future.set_result(None)
        return future

    async def recv_pyobj(self):  # noqa: ANN201
        return await self.inbound.get()


def _engine(stuck: bool = False) -> tuple[AsyncEngine, _Pipe]:
    engine = AsyncEngine(None, CoreClient(0, "", "", os.getpid(), Ready(1, 16, 1.0)))  # type: ignore[arg-type]
    pipe = _Pipe(stuck)
    engine._outbox = engine._inbox = pipe  # type: ignore[attr-defined]
    engine._tasks = [asyncio.get_running_loop().create_task(engine._read_outputs())]
    return engine, pipe


def _serving(engine: AsyncEngine, limit: int, processes: int = 1, seats: int | None = None) -> OpenAIServing:
    return OpenAIServing(
        ServingContext(
            engine=engine,
            tokenizer=None,
            served_model_names=["m"],
            max_model_len=512,
            vocab_size=1000,
            architecture="Fake",
            chat_template=None,
            metrics=ServerMetrics("m"),
            max_waiting_requests=limit,
            api_server_count=processes,
            max_num_seqs=seats,
        )
    )


def _stats(running: int, waiting: int, kv_usage: float = 0.1) -> EngineStats:
    return EngineStats(running, waiting, kv_usage, 0, 0, 0, 1)


def _admitted(serving: OpenAIServing, tries: int) -> list:
    admitted = []
    for _ in range(tries):
        try:
            admitted.append(serving.check_capacity())
        except Overloaded:
            pass
    return admitted


def test_a_burst_cannot_pass_on_a_stale_waiting_count() -> None:
    async def main() -> None:
        engine, pipe = _engine()
        serving = _serving(engine, limit=8)
        # 20 requests pass the check before any is sent (a stream is sent once its response started).
        admitted = _admitted(serving, 20)
        assert len(admitted) == 8
        gens = [
            engine.generate_batches([1], SamplingParams(max_tokens=4), request_id=f"r{i}", admission=a)
            for i, a in enumerate(admitted)
        ]
        tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await asyncio.sleep(0)
        assert sum(isinstance(m, AddRequest) for m in pipe.sent) == 8
        assert engine.num_unreported == 8 and not _admitted(serving, 5)  # sent, not yet reported
        # The core took all 8: 3 run, 5 wait; room for 3 more.
        pipe.inbound.put_nowait(Outputs([], _stats(3, 5), {}, received=8))
        await asyncio.sleep(0)
        assert engine.num_unreported == 0
        unstarted = _admitted(serving, 10)
        assert len(unstarted) == 3 and engine.num_unreported == 3
        # Room taken for streams that never started (their clients left) comes back with them.
        del unstarted
        gc.collect()
        assert engine.num_unreported == 0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for gen in gens:
            await gen.aclose()
        engine._tasks[0].cancel()

    asyncio.run(main())


def test_several_api_processes_share_the_room() -> None:
    async def main() -> None:
        engine, _ = _engine()
        assert len(_admitted(_serving(engine, limit=8, processes=2), 20)) == 4
        engine2, _ = _engine()
        assert len(_admitted(_serving(engine2, limit=8, processes=3), 20)) == 3  # ceil(8 / 3)
        engine3, pipe3 = _engine()
        pipe3.inbound.put_nowait(Outputs([], _stats(0, 7), {}, received=0))
        await asyncio.sleep(0)
        assert len(_admitted(_serving(engine3, limit=8, processes=4), 20)) == 1  # room 1: one each at most
        for e in (engine, engine2, engine3):
            e._tasks[0].cancel()

    asyncio.run(main())


def test_requests_that_take_a_free_seat_are_not_waiting() -> None:
    """--max-waiting-requests 8 with 256 seats: a burst of 100 on an idle core is all admitted, one of 400
    gets 256 + 8; what the core then reports running or waiting takes its room (KV full: no free seats)."""

    async def main() -> None:
        engines = []

        async def serving(processes: int = 1, stats: EngineStats | None = None) -> OpenAIServing:
            engine, pipe = _engine()
            engines.append(engine)
            if stats is not None:
                pipe.inbound.put_nowait(Outputs([], stats, {}, received=0))
                await asyncio.sleep(0)
            return _serving(engine, limit=8, processes=processes, seats=256)

        assert len(_admitted(await serving(), 100)) == 100
        assert len(_admitted(await serving(), 400)) == 256 + 8
        assert len(_admitted(await serving(stats=_stats(250, 0)), 400)) == 6 + 8
        assert len(_admitted(await serving(stats=_stats(256, 5)), 400)) == 3
        # 50 left for the next step by the token budget take free seats first: 256 - 100 - 50 + 8 more.
        assert len(_admitted(await serving(stats=_stats(100, 50)), 400)) == 114
        assert len(_admitted(await serving(stats=_stats(100, 5, kv_usage=0.97)), 400)) == 3  # no seat is free
        assert len(_admitted(await serving(stats=_stats(256, 8)), 400)) == 0
        assert len(_admitted(await serving(processes=2), 400)) == 132  # each its half of 264
        for engine in engines:
            engine._tasks[0].cancel()

    asyncio.run(main())


def test_the_waiting_gauge_counts_sends_the_core_has_not_reported_once_stale() -> None:
    async def main() -> None:
        engine, pipe = _engine()
        pipe.inbound.put_nowait(Outputs([], _stats(1, 2), {}, received=0))
        await asyncio.sleep(0)
        gens = [engine.generate_batches([1], SamplingParams(max_tokens=4), request_id=f"r{i}") for i in range(3)]
        tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await asyncio.sleep(0)
        assert engine.waiting_estimate() is None  # just sent: the core's report is current
        assert engine.waiting_estimate(stale_after=0.0) == 2 + 3
        # With 5 seats and 1 running, the 2 waiting and the 3 sent take the 4 free seats: 1 waits.
        assert engine.waiting_estimate(stale_after=0.0, max_num_seqs=5) == 1
        pipe.inbound.put_nowait(Outputs([], _stats(1, 5), {}, received=3))
        await asyncio.sleep(0)
        assert engine.waiting_estimate(stale_after=0.0) is None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        engine._tasks[0].cancel()

    asyncio.run(main())


def test_a_send_the_dead_core_never_takes_ends_with_engine_dead() -> None:
    async def main() -> None:
        engine, _ = _engine(stuck=True)
        gen = engine.generate_batches([1], SamplingParams(max_tokens=4), request_id="r1")
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        assert not task.done()  # the send is waiting for the core
        engine._mark_dead("test")
        with pytest.raises(EngineDead):
            await asyncio.wait_for(task, 1.0)
        with pytest.raises(EngineDead):
            await engine.generate_batches([1], SamplingParams(max_tokens=4)).__anext__()
        engine._tasks[0].cancel()

    asyncio.run(main())


def test_end_streams_fails_open_requests_with_an_error_event_and_done() -> None:
    async def main() -> None:
        engine, pipe = _engine()
        serving = _serving(engine, limit=100)
        from pagoda.server import protocol as p

        body = p.CompletionRequest(model="m", prompt=[1, 2], max_tokens=50, stream=True)
        response = sse_response(await serving.completion_stream(body, time.monotonic()))
        writes: list = []

        async def read() -> None:
            async for chunk in response.body_iterator:
                writes.append(chunk.decode() if isinstance(chunk, bytes) else chunk)

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.01)
        assert engine.num_pending == 1
        engine.end_streams("The server is shutting down: --shutdown-timeout (1 s) ran out.")
        await asyncio.wait_for(reader, 1.0)
        text = "".join(writes)
        assert '"code": 503' in text and "shutting down" in text and text.endswith("data: [DONE]\n\n")
        assert isinstance(pipe.sent[-1], AbortRequests)  # the core frees the request's blocks
        with pytest.raises(ShuttingDown):
            await engine.generate_batches([1], SamplingParams(max_tokens=4)).__anext__()
        engine._tasks[0].cancel()

    asyncio.run(main())


def test_a_stream_whose_client_left_before_it_started_gives_its_room_back_at_once() -> None:
    """The client disconnects before the response's first write: the stream never starts, and its
    admission is released when the response ends, not whenever the garbage collector runs."""

    async def main() -> None:
        engine, pipe = _engine()
        serving = _serving(engine, limit=8)
        from pagoda.server import protocol as p

        body = p.CompletionRequest(model="m", prompt=[1, 2], max_tokens=50, stream=True)
        response = sse_response(await serving.completion_stream(body, time.monotonic()))
        assert engine.num_unreported == 1

        async def receive() -> dict:
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await asyncio.sleep(0.01)  # the disconnect is seen before the body's first event

        gc.disable()
        try:
            scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST"}
            await response(scope, receive, send)
            assert engine.num_unreported == 0 and not pipe.sent
        finally:
            gc.enable()
        engine._tasks[0].cancel()

    asyncio.run(main())


class _FakeCore:
    """The slice of LLMEngine that `core_process._loop` uses: requests wait until aborted, and the
    stats never change (so only the received count can make the core report)."""

    def __init__(self) -> None:
        self.live: set[str] = set()

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def add_request(self, request_id, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        self.live.add(request_id)

    def abort_request(self, ids: list[str]) -> list[RequestOutput]:
        self.live -= set(ids)
        return [RequestOutput(i, None, [1], [CompletionOutput(0, "", [], None, None, "abort")], True) for i in ids]

    def step(self) -> list:
        return []

    def take_rejected(self) -> list[tuple[str, str]]:
        return []

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 0, 0, 0, 0)


class _Inbox:
    """Batches of messages: each `_receive` drains one."""

    def __init__(self, batches: list[list]) -> None:
        self.batches, self.current = batches, []

    def poll(self, timeout: int) -> bool:
        if self.current:
            return True
        self.current = self.batches.pop(0) if self.batches else [Shutdown()]
        return False

    def recv_pyobj(self):  # noqa: ANN201
        return self.current.pop(0)


class _Outbox:
    def __init__(self) -> None:
        self.sent: list[Outputs] = []

    def send_pyobj(self, message: Outputs) -> None:
        self.sent.append(message)


def test_the_core_reports_how_many_requests_it_took() -> None:
    def add(rid: str) -> AddRequest:
        return AddRequest(rid, [1], SamplingParams(max_tokens=4), None, True, 0.0)

    # Requests taken are always reported, even when the stats did not change: until then the API side
    # counts them as waiting.
    inbox, outbox = _Inbox([[], [add("a"), add("b")], [add("c")], [Shutdown()]]), _Outbox()
    _loop(_FakeCore(), inbox, [outbox])
    assert [m.received for m in outbox.sent] == [0, 2, 3]
