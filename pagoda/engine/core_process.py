"""The engine core in its own process: a tight loop of drain inputs → step → send outputs.

Why a process: at high stream counts the HTTP event loop and the engine loop fighting over one GIL
is where servers stall (performance-notes.md). The API process owns HTTP, tokenization and chat
templates; this process owns the model, the KV cache and detokenization of outputs.

Wire protocol (pickled dataclasses over two ZMQ PUSH/PULL pipes):
  API → core: AddRequest | AbortRequests | Shutdown
  core → API: Ready | StartupFailed (once) then Outputs (every step that produced something) | CoreDied
"""

from __future__ import annotations

import logging
import traceback
from typing import Any
from dataclasses import dataclass, field

from pagoda.config import EngineConfig
from pagoda.engine.outputs import EngineStats, RequestOutput
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


@dataclass
class Outputs:
    outputs: list[RequestOutput]
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
            outbox.send_pyobj(Outputs(outputs, stats, rejected))
        last_stats = stats


def _changed(stats: EngineStats, last: EngineStats | None) -> bool:
    if last is None:
        return True
    return (stats.num_running, stats.num_waiting, stats.kv_cache_usage) != (
        last.num_running, last.num_waiting, last.kv_cache_usage)
