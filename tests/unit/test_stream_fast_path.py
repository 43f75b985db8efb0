"""The API process's per-token fast path: pre-serialized SSE chunk templates (byte for byte what the
pydantic models produce), the lean core → API wire tuples, and AsyncEngine's batched streams."""

from __future__ import annotations

import asyncio
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.engine.async_engine import AsyncEngine, CoreClient
from pagoda.engine.core_process import AbortRequests, AddRequest, Outputs, Ready, from_wire, wire_output
from pagoda.errors import EngineDead, InvalidRequest
from pagoda.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.server import protocol as p
from pagoda.server.metrics import ServerMetrics

texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)  # any code point but lone surrogates
reasons = st.sampled_from([None, "stop", "length"])
stops = st.one_of(st.none(), st.integers(0, 200_000), texts)
choices = st.lists(st.tuples(st.integers(0, 9), texts, reasons, stops), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(chunk_id=texts, created=st.integers(0, 2**40), model=texts, items=choices)
def test_completion_template_is_byte_identical_to_pydantic(chunk_id, created, model, items) -> None:
    t = p.CompletionChunkTemplate(chunk_id, created, model)
    fast = t.event([t.choice(*item) for item in items])
    slow = p.CompletionResponse(
        id=chunk_id,
        created=created,
        model=model,
        choices=[p.CompletionChoice(index=i, text=text, finish_reason=r, stop_reason=s) for i, text, r, s in items],
    )
    assert fast == "data: " + slow.model_dump_json(exclude_none=True) + "\n\n"


@settings(max_examples=300, deadline=None)
@given(chunk_id=texts, created=st.integers(0, 2**40), model=texts, items=choices)
def test_chat_template_is_byte_identical_to_pydantic(chunk_id, created, model, items) -> None:
    t = p.ChatChunkTemplate(chunk_id, created, model)
    fast = t.event([t.choice(*item) for item in items])
    slow = p.ChatCompletionChunk(
        id=chunk_id,
        created=created,
        model=model,
        choices=[
            p.ChatStreamChoice(index=i, delta=p.DeltaMessage(content=text), finish_reason=r, stop_reason=s)
            for i, text, r, s in items
        ],
    )
    assert fast == "data: " + slow.model_dump_json(exclude_unset=False) + "\n\n"


def test_template_declines_stop_reasons_of_other_types() -> None:
    for template in (p.CompletionChunkTemplate("x", 1, "m"), p.ChatChunkTemplate("x", 1, "m")):
        assert template.choice(0, "a", "stop", True) is None  # bool is no token id: pydantic decides
        assert template.choice(0, "a", "stop", 1.5) is None  # type: ignore[arg-type]
        assert template.choice(0, "a", "stop", 7) is not None


def _output(
    request_id: str, finished: bool = False, text: str = " a", reason: str | None = None, logprobs: bool = False
) -> RequestOutput:
    lp = [{5: Logprob(-0.5, 1, " a"), 6: Logprob(-1.5, 2, " b")}] if logprobs else None
    return RequestOutput(
        request_id,
        "the prompt",
        [1, 2, 3],
        [
            CompletionOutput(0, text, [5], -0.5 if logprobs else None, lp, reason, "x" if reason == "stop" else None),
            CompletionOutput(1, text + "!", [6, 7], None, None, reason),
        ],
        finished,
        2,
        0.25 if finished else None,
    )


@pytest.mark.parametrize("finished,logprobs", [(False, False), (True, True)])
def test_wire_round_trip_rebuilds_the_request_output(finished: bool, logprobs: bool) -> None:
    out = _output("r1", finished, reason="stop" if finished else None, logprobs=logprobs)
    message = pickle.loads(pickle.dumps(Outputs([wire_output(out)], EngineStats(1, 0, 0.1, 0, 0, 0, 1))))
    wire = message.outputs[0]
    assert isinstance(wire, tuple) and wire[3] == 3  # the prompt itself does not travel
    assert from_wire(wire, "the prompt", [1, 2, 3]) == out


# ---- AsyncEngine streams, over in-memory pipes (no core process) ----------------------------------------
class _Pipe:
    def __init__(self) -> None:
        self.sent: list = []
        self.inbound: asyncio.Queue = asyncio.Queue()

    async def send_pyobj(self, message) -> None:  # noqa: ANN001
        self.sent.append(message)

    async def recv_pyobj(self):  # noqa: ANN201
        return await self.inbound.get()


def _engine() -> tuple[AsyncEngine, _Pipe, ServerMetrics]:
    engine = AsyncEngine(None, CoreClient(0, "", "", 0, Ready(1, 16, 1.0)))  # type: ignore[arg-type]
    pipe = _Pipe()
    engine._outbox = engine._inbox = pipe  # type: ignore[attr-defined]
    metrics = ServerMetrics("m")
    engine.add_listener(metrics.on_engine_outputs)
    engine._tasks = [asyncio.get_running_loop().create_task(engine._read_outputs())]
    return engine, pipe, metrics


def _stats() -> EngineStats:
    return EngineStats(1, 0, 0.1, 0, 0, 0, 1)


def test_batches_keep_order_and_end_with_the_finished_output() -> None:
    async def main() -> None:
        engine, pipe, metrics = _engine()
        params = SamplingParams(n=2, max_tokens=4)
        gen = engine.generate_batches([1, 2, 3], params, "the prompt", request_id="r1")
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        assert isinstance(pipe.sent[0], AddRequest)
        # Three steps arrive before the consumer runs: one batch, in order.
        for _k, out in enumerate(
            [_output("r1", text="x"), _output("r1", text="y"), _output("other"), _output("r1", True, "z", "stop")]
        ):
            pipe.inbound.put_nowait(Outputs([wire_output(out)], _stats()))
        batch = await first
        assert [o.outputs[0].text for o in batch] == ["x", "y", "z"]
        assert batch[-1].finished and batch[0].prompt_token_ids == [1, 2, 3] and batch[0].prompt == "the prompt"
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()
        assert not any(isinstance(m, AbortRequests) for m in pipe.sent)  # finished: nothing to abort
        assert engine.num_pending == 0
        # Metrics count every output's tokens (the unknown request's too) and the finished prompt.
        assert metrics.generation_tokens._value.get() == 4 * 3
        assert metrics.prompt_tokens._value.get() == 3
        engine._tasks[0].cancel()

    asyncio.run(main())


def test_an_error_after_outputs_delivers_them_first_and_cancel_aborts() -> None:
    async def main() -> None:
        engine, pipe, _ = _engine()
        params = SamplingParams(max_tokens=4)
        gen = engine.generate_batches([1], params, request_id="r1")
        nxt = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        pipe.inbound.put_nowait(Outputs([wire_output(_output("r1", text="x"))], _stats()))
        await asyncio.sleep(0)
        engine._mark_dead("test")
        assert [o.outputs[0].text for o in await nxt] == ["x"]
        with pytest.raises(EngineDead):
            await gen.__anext__()

        engine2, pipe2, _ = _engine()
        gen2 = engine2.generate_batches([1], params, request_id="r2")
        task = asyncio.ensure_future(gen2.__anext__())
        await asyncio.sleep(0)
        pipe2.inbound.put_nowait(Outputs([], _stats(), {"r2": "bad request"}))
        with pytest.raises(InvalidRequest):
            await task

        engine3, pipe3, _ = _engine()
        gen3 = engine3.generate_batches([1], params, request_id="r3")
        task = asyncio.ensure_future(gen3.__anext__())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await gen3.aclose()
        assert isinstance(pipe3.sent[-1], AbortRequests) and pipe3.sent[-1].request_ids == ["r3"]
        assert engine3.num_pending == 0
        for e in (engine, engine2, engine3):
            e._tasks[0].cancel()

    asyncio.run(main())
