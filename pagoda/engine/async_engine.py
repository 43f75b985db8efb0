"""The API process's handle on the engine core process: `generate()` → async iterator of outputs.

One asyncio task reads every batch of outputs the core sends and routes each output (a wire tuple,
rebuilt into a `RequestOutput`) to the stream of its request; a background check marks the engine dead if the
core process exits.

Detokenization happens here, not in the core, for every request without stop strings once the server
hands this engine its tokenizer (`use_tokenizer`; `pagoda serve` does with several API processes): the
core sends token ids, and each stream's own `IncrementalDetokenizer` turns them into the same text
deltas the core's would have. That takes detokenization off the core's critical path
(benchmarks/profile/host_overhead.py) and spreads it over the API processes. Requests with stop strings
stay detokenized in the core, which must see the text to stop generating.

There is one way to reach a core: each API process's `AsyncEngine` attaches, through its `CoreClient`, to
a core that the launcher started (`core_process.CoreProcess`): it connects to the core's input pipe, binds
its own output pipe, tags what it sends with its index, and leaves starting and stopping the core to the
launcher.

Admission counts (`num_unreported`): the core's `EngineStats` are as of its last report, and it reports
only between steps, so a burst sent during a long step is invisible in them. Each report also says how
many AddRequests the core has taken from this process (`Outputs.received`); what this process sent
beyond that, plus what `admit` reserved for requests about to be sent, is counted as waiting by
`--max-waiting-requests` and, once stale, by the waiting gauge (`waiting_estimate`).

Runtime adapters (/v1/load_lora_adapter): `add_lora` sends the core an `AddLoRA` and waits for its `LoRAAdded`,
so an adapter the core cannot serve (no weights, another base model's shapes) is refused when it is loaded, not
when a request first names it.

The core's death: a pidfd wakes `_watch_core` the moment the core process exits, and a send never waits
on a dead core (`_send`): a PUSH to a peer that is gone never completes, and a request stuck there
would hang until its client gave up.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from pagoda.config import EngineConfig
from pagoda.engine.core_process import (
    AbortRequests,
    AddLoRA,
    AddRequest,
    CoreClient,
    CoreDied,
    LoRAAdded,
    Outputs,
    Ready,
    RemoveLoRA,
    from_wire,
)
from pagoda.errors import EngineDead, InvalidRequest, RequestFailed, ShuttingDown
from pagoda.frontend.detokenizer import IncrementalDetokenizer
from pagoda.outputs import EngineStats, RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger("pagoda")


class Admission:
    """Room that `check_capacity` took for `count` requests not yet sent to the core: a stream is sent
    only once its response has started, so every request of a burst would pass the check before the
    first was sent. Held by the request's generator; it ends when the request is sent, or when the
    generator is dropped without ever starting (a client gone before its stream began): the engine
    only keeps a weak reference."""

    __slots__ = ("count", "__weakref__")

    def __init__(self, count: int):
        self.count = count


# KV usage from which the core's free seats count as taken: a new request would wait for blocks.
KV_FULL = 0.95


def free_seats(stats: EngineStats, max_num_seqs: int | None) -> int:
    """Seats (`max_num_seqs`) the core's last report leaves free. The waiting requests take them first
    (those the last step's token budget left out run at the next), then new ones: of W waiting and U more,
    max(0, W + U - free) wait. 0 while the KV cache is full, where even a free seat waits for blocks."""
    if max_num_seqs is None or stats.kv_cache_usage >= KV_FULL:
        return 0
    return max(0, max_num_seqs - stats.num_running)


class AsyncEngine:
    def __init__(self, config: EngineConfig, client: CoreClient):
        self.config = config
        self.client = client
        self._client_index = client.index
        self.ready: Ready | None = None
        self.stats = EngineStats(0, 0, 0.0, 0, 0, 0, 0)
        self.dead_reason: str | None = None
        self._streams: dict[str, _Stream] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._listeners: list = []  # callables(Outputs) — metrics
        self._tokenizer: Any | None = None  # set: detokenize requests without stop strings here
        self._sent = 0  # AddRequests sent to the core
        self._seen = 0  # of them, those the core had taken at its last report
        self._unseen_since = 0.0  # monotonic time of the first send since the core had seen all
        self._last_report = 0.0  # monotonic time of the core's last report
        self._admissions: weakref.WeakSet[Admission] = weakref.WeakSet()
        self._died = asyncio.Event()
        self._closed: str | None = None  # why new requests are refused (`end_streams`)
        self._lora_calls: dict[str, asyncio.Future[str | None]] = {}  # AddLoRA call id → the core's answer

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

    @property
    def num_unreported(self) -> int:
        """This process's requests that the core's last report does not count: sent since, or admitted
        and about to be sent."""
        return self._sent - self._seen + sum(a.count for a in self._admissions)

    def admit(self, count: int = 1) -> Admission:
        """Reserve room for `count` requests until they are sent (see `Admission`)."""
        admission = Admission(count)
        self._admissions.add(admission)
        return admission

    def waiting_estimate(self, stale_after: float = 1.0, max_num_seqs: int | None = None) -> int | None:
        """The core's last waiting count plus this process's requests sent since that it has not
        reported, less the free seats (`free_seats`), once they have gone unreported for
        `stale_after` s (the core is in a long step); None while its report is current. A short delay
        keeps the gauge the core's own between steps."""
        unseen = self._sent - self._seen
        if unseen <= 0 or time.monotonic() - max(self._last_report, self._unseen_since) < stale_after:
            return None
        return max(0, self.stats.num_waiting + unseen - free_seats(self.stats, max_num_seqs))

    def end_streams(self, message: str) -> None:
        """End every open request with a `ShuttingDown` error (a stream's last events are that error
        and [DONE]) and refuse new ones: `--shutdown-timeout` has run out."""
        self._closed = message
        for stream in self._streams.values():
            stream.push(ShuttingDown(message))

    def add_listener(self, callback) -> None:
        self._listeners.append(callback)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Attach to the core: connect to its input pipe, bind this process's output pipe."""
        self._zmq = zmq.asyncio.Context()
        self._outbox = self._zmq.socket(zmq.PUSH)
        self._outbox.connect(self.client.input_address)
        self._inbox = self._zmq.socket(zmq.PULL)
        self._inbox.bind(self.client.output_address)
        self.ready = self.client.ready
        self._tasks = [asyncio.create_task(self._read_outputs()), asyncio.create_task(self._watch_core())]

    async def shutdown(self) -> None:
        """Detach (the launcher stops the core)."""
        for task in self._tasks:
            task.cancel()
        self._zmq.destroy(linger=0)

    # ---- requests -----------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        delta: bool = True,
        request_id: str | None = None,
        mm_inputs: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields outputs until the last one (`finished=True`). Cancelling the consumer (client gone)
        aborts the request in the engine and frees its KV blocks."""
        async for batch in self.generate_batches(prompt_token_ids, params, prompt, delta, request_id, mm_inputs):
            for output in batch:
                yield output

    async def generate_batches(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        delta: bool = True,
        request_id: str | None = None,
        mm_inputs: Any = None,
        admission: Admission | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> AsyncIterator[list[RequestOutput]]:
        """`generate`, but each wake-up yields every output that has arrived since the last one (in order;
        the last batch ends with the `finished` output): a consumer that fell behind by several engine
        steps catches up in one pass (and, streaming, in one write). `admission`: the room `admit` took
        for this request, handed over to the sent count when it is sent. `cache_salt`, `priority` and
        `lora_request`: as `LLMEngine.add_request` takes them."""
        if self.is_dead:
            raise EngineDead(f"The engine is not running: {self.dead_reason}")
        if self._closed is not None:
            raise ShuttingDown(self._closed)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            # Checked here, not only in the core: registering a second stream under the same id would
            # steal the first request's outputs, and the second's cleanup would abort the first.
            raise InvalidRequest(f"Request id {request_id!r} is already in use.", "request_id")
        stream = _Stream(prompt, prompt_token_ids)
        if self._tokenizer is not None and not params.stop:
            stream.detokenizers = [
                IncrementalDetokenizer(
                    self._tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                )
                for _ in range(params.n)
            ]
        self._streams[request_id] = stream
        finished = False
        loop = asyncio.get_running_loop()
        try:
            if admission is not None and admission.count > 0:
                admission.count -= 1
                if not admission.count:
                    self._admissions.discard(admission)
            if self._sent == self._seen:
                self._unseen_since = time.monotonic()
            self._sent += 1
            await self._send(
                AddRequest(
                    request_id,
                    prompt_token_ids,
                    params,
                    prompt,
                    delta,
                    time.monotonic(),
                    mm_inputs,
                    self._client_index,
                    detokenize=stream.detokenizers is None,
                    cache_salt=cache_salt,
                    priority=priority,
                    lora_request=lora_request,
                )
            )
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
                try:
                    await self._send(AbortRequests([request_id], self._client_index))
                except EngineDead:
                    pass  # nothing left to abort

    async def add_lora(self, lora_request: Any) -> None:
        """Have the core read and check an adapter (`lora.request.LoRARequest`) now, as vLLM's engine client
        `add_lora` does: its weights against the model's layers, which only the core holds. InvalidRequest with
        the core's line when the adapter cannot be served; EngineDead if the core is gone."""
        if self.is_dead:
            raise EngineDead(f"The engine is not running: {self.dead_reason}")
        call_id = uuid.uuid4().hex
        answer: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._lora_calls[call_id] = answer
        try:
            await self._send(AddLoRA(call_id, lora_request, self._client_index))
            error = await answer
        finally:
            self._lora_calls.pop(call_id, None)
        if error is not None:
            raise InvalidRequest(error, "lora_path")

    async def remove_lora(self, lora_id: int) -> None:
        """Tell the core an adapter is unloaded: it frees the adapter's memory once its requests finish. A dead
        core holds nothing to free."""
        if not self.is_dead:
            try:
                await self._send(RemoveLoRA(lora_id, self._client_index))
            except EngineDead:
                pass

    async def _send(self, message: Any) -> None:
        """Send to the core; at once while its pipe has room (the usual case), otherwise wait for room
        or for the core's death, whichever comes first (EngineDead)."""
        sending = self._outbox.send_pyobj(message)
        if not isinstance(sending, asyncio.Future):
            await sending  # a stand-in pipe's coroutine (tests)
            return
        if not sending.done():
            died = asyncio.ensure_future(self._died.wait())
            try:
                await asyncio.wait((sending, died), return_when=asyncio.FIRST_COMPLETED)
            finally:
                died.cancel()
            if not sending.done():
                sending.cancel()  # out of the socket's queue: there is no one to take it
                raise EngineDead(f"The engine is not running: {self.dead_reason}")
        sending.result()

    async def _read_outputs(self) -> None:
        streams = self._streams
        while True:
            message = await self._inbox.recv_pyobj()
            if isinstance(message, CoreDied):
                self._mark_dead(f"engine core failed:\n{message.message}")
                return
            if isinstance(message, LoRAAdded):
                answer = self._lora_calls.get(message.call_id)
                if answer is not None and not answer.done():
                    answer.set_result(message.error)
                continue
            if not isinstance(message, Outputs):
                continue
            self.stats = message.stats
            self._seen = message.received
            self._last_report = time.monotonic()
            for request_id, error in message.rejected.items():
                if (stream := streams.get(request_id)) is not None:
                    stream.push(InvalidRequest(error))
            for wire in message.outputs:
                if (stream := streams.get(wire[0])) is not None:
                    # The common case (a step's delta, decoded by the core) without the checks' call.
                    stream.push(
                        _deliverable(wire, stream)
                        if wire[1] or stream.detokenizers is not None
                        else from_wire(wire, stream.prompt, stream.prompt_token_ids)
                    )
            for listener in self._listeners:
                listener(message)

    async def _watch_core(self) -> None:
        """Mark the engine dead when the core process exits. A pidfd (Linux 5.3+) wakes this the moment
        it does, so requests that race the death are answered 503 at once rather than after a polling
        interval; polling every 0.5 s is the fallback. The core is the launcher's child, reaped by it (a
        zombie still answers kill(pid, 0), so only the pidfd or the launcher's CoreDied notice it)."""
        pid = self.client.core_pid
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        try:
            opened = os.pidfd_open(pid)
            loop.add_reader(opened, lambda: None if exited.done() else exited.set_result(None))
            fd: int | None = opened
        except (AttributeError, OSError):
            fd = None
        try:
            while not exited.done() and _alive(pid):
                await asyncio.wait((exited,), timeout=0.5)
        finally:
            if fd is not None:
                loop.remove_reader(fd)
                os.close(fd)
        self._mark_dead("engine process exited")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            logger.error("Engine is dead: %s", reason)
            self.dead_reason = reason
        self._died.set()
        for stream in self._streams.values():
            stream.push(EngineDead("The engine stopped while serving this request."))
        for answer in self._lora_calls.values():
            if not answer.done():
                answer.set_exception(EngineDead("The engine stopped while reading this LoRA adapter."))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _deliverable(wire: Any, stream: _Stream) -> RequestOutput | Exception:
    """What a stream gets for one wire output: the `RequestOutput` (its text decoded here when this
    process detokenizes), or the error that ends the request — the core ended it with finish_reason
    "error", or decoding it here raised (that request fails; the reader goes on for all the others)."""
    request_id, finished, completions = wire[0], wire[1], wire[2]
    if finished and any(c[3] == "error" for c in completions):
        message = next(c[4] for c in completions if c[3] == "error")
        return RequestFailed(str(message or "The engine failed while processing this request."))
    try:
        output = from_wire(wire, stream.prompt, stream.prompt_token_ids)
        if stream.detokenizers is not None:
            _add_text(output, stream.detokenizers)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        logger.exception("Request %s failed while turning its tokens into text", request_id)
        return RequestFailed(
            f"Internal error while turning this request's tokens into text: {type(exc).__name__}. "
            f"The server log has the details (request {request_id})."
        )
    return output


def _add_text(output: RequestOutput, detokenizers: list[IncrementalDetokenizer]) -> None:
    """Fill in the text of an output the core sent as token ids only: each sample's new tokens go
    through its detokenizer (flushed when the sample finishes). In delta mode the text is what is new;
    in final-only mode the one output holds every token, so the text is the whole completion."""
    for completion in output.outputs:
        detok = detokenizers[completion.index]
        for token in completion.token_ids:
            detok.update_one(token)  # no stop strings here: never reports a stop
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
