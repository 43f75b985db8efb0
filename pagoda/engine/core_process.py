"""The engine core in its own process: a tight loop of drain inputs → step → send outputs.

Why a process: at high stream counts the HTTP event loop and the engine loop fighting over one GIL
is where servers stall (performance-notes.md). The API process owns HTTP, tokenization and chat
templates; this process owns the model, the KV cache and detokenization of outputs.

Wire protocol (pickled dataclasses over two ZMQ PUSH/PULL pipes):
  API → core: AddRequest | AbortRequests | Shutdown
  core → API: Ready | StartupFailed (once) then Outputs (every step that produced something) | CoreDied

`Outputs` carries each request's delta as a plain tuple (`wire_output`), not a pickled `RequestOutput`:
every streamed token crosses this pipe, and unpickling dataclasses (plus the prompt's token ids, resent
with every delta) cost the API process ~2.4 us per output against ~0.25 us for the tuple. The API side
already knows each request's prompt; `AsyncEngine` rebuilds `RequestOutput`s from the tuples.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any
from dataclasses import dataclass, field

from pagoda.config import EngineConfig
from pagoda.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger("pagoda.core")


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    delta: bool
    arrival_time: float
    mm_inputs: Any = None          # multimodal.inputs.MultiModalInputs (pixels travel pickled)


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


@dataclass
class Ready:
    num_blocks: int
    block_size: int
    max_concurrency: float


@dataclass
class StartupFailed:
    message: str


# One request's delta on the wire (core → API), see `wire_output`:
#   (request_id, finished, completions, num_prompt_tokens, num_cached_tokens, queue_time)
# and each of its completions:
#   (index, text, token_ids, finish_reason, stop_reason, logprobs, cumulative_logprob)
WireOutput = tuple


def wire_output(out: RequestOutput) -> WireOutput:
    return (out.request_id, out.finished,
            [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
             for c in out.outputs],
            len(out.prompt_token_ids), out.num_cached_tokens, out.queue_time)


def from_wire(wire: WireOutput, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
    """The `RequestOutput` a wire tuple stands for, given the request's prompt (which the API side keeps)."""
    request_id, finished, completions, _, num_cached_tokens, queue_time = wire
    return RequestOutput(request_id, prompt, prompt_token_ids,
                         [CompletionOutput(index, text, token_ids, cumulative, logprobs, reason, stop)
                          for index, text, token_ids, reason, stop, logprobs, cumulative in completions],
                         finished, num_cached_tokens, queue_time)


@dataclass
class Outputs:
    outputs: list[WireOutput]      # `wire_output` of each RequestOutput of the step
    stats: EngineStats
    rejected: dict[str, str] = field(default_factory=dict)   # request id → error message (validation in core)


@dataclass
class CoreDied:
    message: str


def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    """Process entry point (spawned)."""
    import os
    import signal

    import zmq

    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.errors import PagodaError

    # Ctrl-C reaches the whole process group: the API process drains in-flight requests and then
    # sends Shutdown, so the core must not die on the same SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(output_address)
    try:
        engine = LLMEngine(config)
    except PagodaError as exc:
        outbox.send_pyobj(StartupFailed(exc.message))
        return
    except Exception as exc:  # a bug or a broken environment: still say why in one line
        outbox.send_pyobj(StartupFailed(f"{type(exc).__name__}: {exc}"))
        return
    layout = engine.kv_layout
    engine.freeze_startup_heap()     # no full GC pass over the startup heap mid-serving (a ~0.2 s stall)
    outbox.send_pyobj(Ready(layout.num_blocks - 1, layout.block_size,
                            layout.max_concurrency(config.model.max_model_len)))
    try:
        _loop(engine, inbox, outbox, parent)
    except Exception:
        outbox.send_pyobj(CoreDied(traceback.format_exc(limit=8)))
        raise
    finally:
        outbox.close(linger=1000)
        inbox.close(linger=0)


def _loop(engine, inbox, outbox, parent: int) -> None:
    import os

    from pagoda.errors import PagodaError

    last_stats: EngineStats | None = None
    while True:
        # Block while idle; otherwise only drain what has already arrived.
        timeout = 0 if engine.has_unfinished_requests() else 1000
        if timeout and os.getppid() != parent:
            return  # the API process is gone (killed without a Shutdown): do not linger as an orphan
        outputs: list[RequestOutput] = []
        rejected: dict[str, str] = {}
        while inbox.poll(timeout):
            timeout = 0
            message = inbox.recv_pyobj()
            if isinstance(message, Shutdown):
                return
            if isinstance(message, AbortRequests):
                outputs += engine.abort_request(message.request_ids)
            elif isinstance(message, AddRequest):
                try:
                    engine.add_request(message.request_id, message.prompt_token_ids, message.params,
                                       prompt=message.prompt, delta=message.delta, arrival_time=message.arrival_time,
                                       mm_inputs=message.mm_inputs)
                except PagodaError as exc:
                    rejected[message.request_id] = exc.message
        if engine.has_unfinished_requests():
            outputs += engine.step()
        # Report outputs, and also any change of state without outputs (a prefill chunk, a request
        # admitted): the gauges stay current. Nothing is sent while nothing changes.
        stats = engine.stats()
        if outputs or rejected or _changed(stats, last_stats):
            outbox.send_pyobj(Outputs([wire_output(out) for out in outputs], stats, rejected))
        last_stats = stats


def _changed(stats: EngineStats, last: EngineStats | None) -> bool:
    if last is None:
        return True
    return (stats.num_running, stats.num_waiting, stats.kv_cache_usage) != (
        last.num_running, last.num_waiting, last.kv_cache_usage)
