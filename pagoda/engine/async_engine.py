"""The API process's handle on the engine core process: `generate()` → async iterator of outputs.

One asyncio task reads every batch of outputs the core sends and routes each `RequestOutput` to
the queue of its request; a background check marks the engine dead if the core process exits.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pagoda.config import EngineConfig
from pagoda.engine.core_process import (AbortRequests, AddRequest, CoreDied, Outputs, Ready, Shutdown,
                                        StartupFailed, run_engine_core)
from pagoda.engine.outputs import EngineStats, RequestOutput
from pagoda.errors import ConfigError, EngineDead, InvalidRequest
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger("pagoda")


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.ready: Ready | None = None
        self.stats = EngineStats(0, 0, 0.0, 0, 0, 0, 0)
        self.dead_reason: str | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._process: multiprocessing.process.BaseProcess | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._listeners: list = []          # callables(Outputs) — metrics

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def num_pending(self) -> int:
        return len(self._queues)

    def add_listener(self, callback) -> None:
        self._listeners.append(callback)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        import zmq
        import zmq.asyncio

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
        if self.is_dead:
            raise EngineDead(f"The engine is not running: {self.dead_reason}")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:
            # Checked here, not only in the core: registering a second queue under the same id would
            # steal the first request's outputs, and the second's cleanup would abort the first.
            raise InvalidRequest(f"Request id {request_id!r} is already in use.", "request_id")
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self._outbox.send_pyobj(AddRequest(request_id, prompt_token_ids, params, prompt, delta,
                                                     time.monotonic(), mm_inputs))
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished and not self.is_dead:
                await self._outbox.send_pyobj(AbortRequests([request_id]))

    async def _read_outputs(self) -> None:
        while True:
            message = await self._inbox.recv_pyobj()
            if isinstance(message, CoreDied):
                self._mark_dead(f"engine core failed:\n{message.message}")
                return
            if not isinstance(message, Outputs):
                continue
            self.stats = message.stats
            for request_id, error in message.rejected.items():
                if (queue := self._queues.get(request_id)) is not None:
                    queue.put_nowait(InvalidRequest(error))
            for output in message.outputs:
                if (queue := self._queues.get(output.request_id)) is not None:
                    queue.put_nowait(output)
            for listener in self._listeners:
                listener(message)

    async def _watch_process(self) -> None:
        assert self._process is not None
        while self._process.is_alive():
            await asyncio.sleep(0.5)
        self._mark_dead(f"engine process exited with code {self._process.exitcode}")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            logger.error("Engine is dead: %s", reason)
            self.dead_reason = reason
        for queue in self._queues.values():
            queue.put_nowait(EngineDead("The engine stopped while serving this request."))

