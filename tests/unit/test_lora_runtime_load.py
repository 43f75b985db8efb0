"""/v1/load_lora_adapter asks the engine core to read the adapter before answering, without a core process: the
core answers `AddLoRA` with `LoRAAdded` (the reason when it cannot serve the adapter) and carries on; the API
side's `AsyncEngine.add_lora` turns the answer into InvalidRequest (a 400), or EngineDead if the core dies while
reading; `OpenAIServing.load_lora` lists only an adapter the core read, and refuses a served model's name. The
real server with PEFT adapters: tests/e2e/test_lora_serve.py."""

from __future__ import annotations

import asyncio

import pytest

from pagoda.engine.core_process import AddLoRA, AddRequest, LoRAAdded, Shutdown, _loop
from pagoda.errors import EngineDead, InvalidRequest
from pagoda.lora.request import LoRARequest
from pagoda.sampling_params import SamplingParams
from pagoda.server.metrics import ServerMetrics
from pagoda.server.serving import OpenAIServing, ServingContext
from tests.unit.test_overload_and_death import _engine, _FakeCore, _Inbox, _Outbox


class _LoRACore(_FakeCore):
    """Reads every adapter but those under /bad (what `lora/peft.py` refuses: no weights, another base...)."""

    def __init__(self) -> None:
        super().__init__()
        self.loras: list[str] = []

    def add_lora(self, lora: LoRARequest) -> bool:
        if lora.lora_path.startswith("/bad"):
            raise InvalidRequest(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}): no weights", "lora_request")
        if lora.lora_path.startswith("/bug"):
            raise RuntimeError("a bug")
        self.loras.append(lora.lora_name)
        return True


def test_the_core_answers_each_adapter_to_the_process_that_asked_and_carries_on():
    core, first, second = _LoRACore(), _Outbox(), _Outbox()
    add = AddRequest("r", [1], SamplingParams(max_tokens=4), None, True, 0.0)
    batches = [
        [AddLoRA("c1", LoRARequest("a", 1, "/good"), client_index=1)],
        [AddLoRA("c2", LoRARequest("b", 2, "/bad/folder"), client_index=0), add],
        [AddLoRA("c3", LoRARequest("c", 3, "/bug"), client_index=1)],
        [Shutdown()],
    ]
    _loop(core, _Inbox(batches), [first, second])
    answers = {i: [m for m in box.sent if isinstance(m, LoRAAdded)] for i, box in enumerate((first, second))}
    assert answers[1][0] == LoRAAdded("c1", None) and core.loras == ["a"]
    assert answers[0] == [LoRAAdded("c2", "LoRA adapter 'b' (/bad/folder): no weights")]
    assert answers[1][1].call_id == "c3" and "Internal error while reading the adapter: RuntimeError" in str(
        answers[1][1].error
    )
    assert core.live == {"r"}  # the request after the refused adapter was taken


def _answer(pipe, error: str | None) -> None:
    (call,) = [m for m in pipe.sent if isinstance(m, AddLoRA)]
    pipe.sent.remove(call)
    pipe.inbound.put_nowait(LoRAAdded(call.call_id, error))


def test_the_api_side_waits_for_the_cores_answer():
    async def run() -> None:
        engine, pipe = _engine()
        lora = LoRARequest("a", 1, "/x")
        loading = asyncio.create_task(engine.add_lora(lora))
        await asyncio.sleep(0.01)
        assert not loading.done() and [m.lora_request for m in pipe.sent] == [lora]
        _answer(pipe, None)
        await asyncio.wait_for(loading, 5)
        loading = asyncio.create_task(engine.add_lora(lora))
        await asyncio.sleep(0.01)
        _answer(pipe, "LoRA adapter 'a' (/x): no adapter_model.safetensors there (found: none)")
        with pytest.raises(InvalidRequest, match="no adapter_model.safetensors") as info:
            await asyncio.wait_for(loading, 5)
        assert info.value.http_status == 400
        loading = asyncio.create_task(engine.add_lora(lora))
        await asyncio.sleep(0.01)
        engine._mark_dead("engine process exited")
        with pytest.raises(EngineDead):
            await asyncio.wait_for(loading, 5)
        assert not engine._lora_calls

    asyncio.run(run())


class _Engine:
    """`AsyncEngine.add_lora` as the core would answer it."""

    def __init__(self) -> None:
        self.asked: list[LoRARequest] = []

    async def add_lora(self, lora: LoRARequest) -> None:
        self.asked.append(lora)
        await asyncio.sleep(0.01)
        if "bad" in lora.lora_path:
            raise InvalidRequest(f"LoRA adapter {lora.lora_name!r}: an adapter of another base model?", "lora_path")


def _serving(engine: _Engine) -> OpenAIServing:
    return OpenAIServing(
        ServingContext(
            engine=engine,  # type: ignore[arg-type]
            tokenizer=None,
            served_model_names=["base", "alias"],
            max_model_len=512,
            vocab_size=1000,
            architecture="Fake",
            chat_template=None,
            metrics=ServerMetrics("base"),
            lora_modules={"startup": LoRARequest("startup", 1, "/s")},
            max_lora_rank=16,
            runtime_lora_updating=True,
        )
    )


def _folder(root, name: str) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    return str(folder)


def test_only_an_adapter_the_core_read_is_served(tmp_path):
    engine = _Engine()
    serving = _serving(engine)
    good, bad = _folder(tmp_path, "good"), _folder(tmp_path, "bad")

    async def run() -> None:
        with pytest.raises(InvalidRequest, match="another base model") as info:
            await serving.load_lora("wrong", bad)
        assert info.value.http_status == 400 and "wrong" not in serving.ctx.lora_modules
        # Two loads of one name at once: the second is refused while the core reads the first.
        first = asyncio.create_task(serving.load_lora("new", good))
        await asyncio.sleep(0)
        with pytest.raises(InvalidRequest, match="already been loaded"):
            await serving.load_lora("new", good)
        assert "added successfully" in await first
        assert serving.ctx.lora_modules["new"] == engine.asked[-1]
        assert [lora.lora_int_id for lora in engine.asked] == [2, 3]  # ids never reused, the refused one's too

    asyncio.run(run())


@pytest.mark.parametrize("name", ["base", "alias"])
def test_a_served_model_name_is_not_an_adapter_name(tmp_path, name):
    engine = _Engine()
    serving = _serving(engine)
    with pytest.raises(InvalidRequest, match="is a served model name") as info:
        asyncio.run(serving.load_lora(name, _folder(tmp_path, "good")))
    assert info.value.http_status == 400 and info.value.param == "lora_name" and not engine.asked
    assert serving.ctx.lora_modules.keys() == {"startup"}
