"""The API process's handle on the engine core process: `generate()` → async iterator of outputs.

One asyncio task reads every batch of outputs the core sends and routes each output (a wire tuple,
rebuilt into a `RequestOutput`) to the stream of its request; a background check marks the engine dead if the core process exits.

Detokenization happens here, not in the core, for every request without stop strings once the server
hands this engine its tokenizer (`use_tokenizer`; `pagoda serve` does with several API processes): the
core sends token ids, and each stream's own `IncrementalDetokenizer` turns them into the same text
deltas the core's would have. That takes ~1 ms per step at 256 streams off the core's critical path
and spreads it over the API processes. Requests with stop strings stay detokenized in the core, which
must see the text to stop generating.

With several API processes (`CoreClient`), each process's `AsyncEngine` attaches to a core that the
launcher started: it connects to the core's input pipe, binds its own output pipe, tags what it sends
with its index, and leaves starting and stopping the core to the launcher.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagoda.config import EngineConfig
from pagoda.engine.core_process import (AbortRequests, AddRequest, CoreDied, Outputs, Ready, Shutdown,
                                        StartupFailed, from_wire, run_engine_core)
from pagoda.engine.outputs import EngineStats, RequestOutput
from pagoda.errors import ConfigError, EngineDead, InvalidRequest
from pagoda.frontend.detokenizer import IncrementalDetokenizer
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger("pagoda")


@dataclass(frozen=True)
class CoreClient:
    """How API process `index` reaches a core started by the launcher (`cli/serve_multi.py`)."""

    index: int
    input_address: str        # the core's input pipe (bound by the core)
    output_address: str       # this process's output pipe (bound here, the core connects)
    core_pid: int
    ready: Ready


class AsyncEngine:
    def __init__(self, config: EngineConfig, client: CoreClient | None = None):
        self.config = config
        self.client = client
        self._client_index = client.index if client is not None else 0
        self.ready: Ready | None = None
        self.stats = EngineStats(0, 0, 0.0, 0, 0, 0, 0)
        self.dead_reason: str | None = None
        self._streams: dict[str, _Stream] = {}
        self._process: multiprocessing.process.BaseProcess | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._listeners: list = []          # callables(Outputs) — metrics
        self._tokenizer: Any | None = None  # set: detokenize requests without stop strings here

    def use_tokenizer(self, tokenizer: Any | None) -> None:
        """Detokenize in this process, with this tokenizer (the same one the core loads), every request
        that has no stop strings."""
        self._tokenizer = tokenizer

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    def add_listener(self, callback) -> None:
        self._listeners.append(callback)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        if self.client is not None:
            self._zmq = zmq.asyncio.Context()
            self._outbox = self._zmq.socket(zmq.PUSH)
            self._outbox.connect(self.client.input_address)
            self._inbox = self._zmq.socket(zmq.PULL)
            self._inbox.bind(self.client.output_address)
            self.ready = self.client.ready
            self._tasks = [asyncio.create_task(self._read_outputs()), asyncio.create_task(self._watch_pid())]
            return
        folder = self._ipc_folder = tempfile.mkdtemp(prefix="pagoda-")
        to_core, from_core = f"ipc://{folder}/in", f"ipc://{folder}/out"
        self._zmq = zmq.asyncio.Context()
        self._outbox = self._zmq.socket(zmq.PUSH)
        self._outbox.bind(to_core)
        self._inbox = self._zmq.socket(zmq.PULL)
        self._inbox.bind(from_core)
        ctx = multiprocessing.get_context("spawn")
        self._process = ctx.Process(target=run_engine_core, args=(self.config, to_core, from_core),
                                    name="pagoda-engine-core", daemon=True)
        self._process.start()
        while True:
            if await self._inbox.poll(500):
                first = await self._inbox.recv_pyobj()
                break
            if not self._process.is_alive():
                raise ConfigError(f"The engine process exited during startup (exit code {self._process.exitcode}).")
        if isinstance(first, StartupFailed):
            self._process.join(5)
            raise ConfigError(first.message)
        assert isinstance(first, Ready)
        self.ready = first
        self._tasks = [asyncio.create_task(self._read_outputs()), asyncio.create_task(self._watch_process())]

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.client is not None:          # the launcher stops the core
            self._zmq.destroy(linger=0)
            return
        if self._process is not None and self._process.is_alive():
            await self._outbox.send_pyobj(Shutdown())
            await asyncio.to_thread(self._process.join, 10)
            if self._process.is_alive():
                self._process.kill()
        self._zmq.destroy(linger=0)
        shutil.rmtree(self._ipc_folder, ignore_errors=True)

    # ---- requests -----------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                       delta: bool = True, request_id: str | None = None,
                       mm_inputs: Any = None) -> AsyncIterator[RequestOutput]:
        """Yields outputs until the last one (`finished=True`). Cancelling the consumer (client gone)
        aborts the request in the engine and frees its KV blocks."""
        async for batch in self.generate_batches(prompt_token_ids, params, prompt, delta, request_id, mm_inputs):
            for output in batch:
                yield output

    async def generate_batches(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                               delta: bool = True, request_id: str | None = None,
                               mm_inputs: Any = None) -> AsyncIterator[list[RequestOutput]]:
        """`generate`, but each wake-up yields every output that has arrived since the last one (in order;
        the last batch ends with the `finished` output): a consumer that fell behind by several engine
        steps catches up in one pass (and, streaming, in one write)."""
        if self.is_dead:
            raise EngineDead(f"The engine is not running: {self.dead_reason}")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            # Checked here, not only in the core: registering a second stream under the same id would
            # steal the first request's outputs, and the second's cleanup would abort the first.
            raise InvalidRequest(f"Request id {request_id!r} is already in use.", "request_id")
        stream = _Stream(prompt, prompt_token_ids)
        if self._tokenizer is not None and not params.stop:
            stream.detokenizers = [
                IncrementalDetokenizer(self._tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                                       spaces_between_special_tokens=params.spaces_between_special_tokens)
                for _ in range(params.n)]
        self._streams[request_id] = stream
        finished = False
        loop = asyncio.get_running_loop()
        try:
            await self._outbox.send_pyobj(AddRequest(request_id, prompt_token_ids, params, prompt, delta,
                                                     time.monotonic(), mm_inputs, self._client_index,
                                                     detokenize=stream.detokenizers is None))
            while not finished:
                if not stream.items:
                    stream.waiter = loop.create_future()
                    try:
                        await stream.waiter
                    finally:
                        stream.waiter = None
                items, stream.items = stream.items, []
                batch: list[RequestOutput] = []
                for item in items:
                    if isinstance(item, Exception):
                        if batch:
                            yield batch
                        raise item
                    batch.append(item)
                    if item.finished:
                        finished = True
                        break
                if batch:
                    yield batch
        finally:
            self._streams.pop(request_id, None)
            if not finished and not self.is_dead:
                await self._outbox.send_pyobj(AbortRequests([request_id], self._client_index))

    async def _read_outputs(self) -> None:
        streams = self._streams
        while True:
            message = await self._inbox.recv_pyobj()
            if isinstance(message, CoreDied):
                self._mark_dead(f"engine core failed:\n{message.message}")
                return
            if not isinstance(message, Outputs):
                continue
            self.stats = message.stats
            for request_id, error in message.rejected.items():
                if (stream := streams.get(request_id)) is not None:
                    stream.push(InvalidRequest(error))
            for wire in message.outputs:
                if (stream := streams.get(wire[0])) is not None:
                    output = from_wire(wire, stream.prompt, stream.prompt_token_ids)
                    if stream.detokenizers is not None:
                        _add_text(output, stream.detokenizers)
                    stream.push(output)
            for listener in self._listeners:
                listener(message)

    async def _watch_process(self) -> None:
        assert self._process is not None
        while self._process.is_alive():
            await asyncio.sleep(0.5)
        self._mark_dead(f"engine process exited with code {self._process.exitcode}")

    async def _watch_pid(self) -> None:
        """A core this process did not start: the launcher reaps it when it exits (and tells every API
        process with a CoreDied); this is the fallback should that message not come."""
        assert self.client is not None
        while True:
            await asyncio.sleep(0.5)
            try:
                os.kill(self.client.core_pid, 0)
            except ProcessLookupError:
                self._mark_dead("engine process exited")
                return
            except PermissionError:
                pass

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            logger.error("Engine is dead: %s", reason)
            self.dead_reason = reason
        for stream in self._streams.values():
            stream.push(EngineDead("The engine stopped while serving this request."))


def _add_text(output: RequestOutput, detokenizers: list[IncrementalDetokenizer]) -> None:
    """Fill in the text of an output the core sent as token ids only: each sample's new tokens go
    through its detokenizer (flushed when the sample finishes). In delta mode the text is what is new;
    in final-only mode the one output holds every token, so the text is the whole completion."""
    for completion in output.outputs:
        detok = detokenizers[completion.index]
        for token in completion.token_ids:
            detok.update_one(token)          # no stop strings here: never reports a stop
        if completion.finish_reason is not None:
            detok.finish()
        completion.text = detok.get_delta()


class _Stream:
    """One request's undelivered outputs and the consumer's wake-up (lighter than an asyncio.Queue:
    one append per output, at most one future per wake-up however many outputs it collects).
    `detokenizers` (one per sample): set when this process turns the request's tokens into text."""

    __slots__ = ("prompt", "prompt_token_ids", "items", "waiter", "detokenizers")

    def __init__(self, prompt: str | None, prompt_token_ids: list[int]):
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.items: list[RequestOutput | Exception] = []
        self.waiter: asyncio.Future[None] | None = None
        self.detokenizers: list[IncrementalDetokenizer] | None = None

    def push(self, item: RequestOutput | Exception) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

