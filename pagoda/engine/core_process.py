"""The engine core in its own process: a tight loop of drain inputs → step → send outputs.

Why a process: at high stream counts the HTTP event loop and the engine loop fighting over one GIL
is where servers stall (performance-notes.md). The API process owns HTTP, tokenization and chat
templates, and detokenization of requests without stop strings (`AddRequest.detokenize`); this
process owns the model, the KV cache and the text of requests with stop strings.

Wire protocol (pickled dataclasses over two ZMQ PUSH/PULL pipes):
  API → core: AddRequest | AbortRequests | Shutdown
  core → API: Ready | StartupFailed (once) then Outputs (every step that produced something) | CoreDied

With several API processes (`--api-server-count N > 1`, `cli/serve_multi.py`) the core binds its
input pipe (every API process pushes into it) and pushes to one pipe per API process: a request's
outputs go only to the process that submitted it (`AddRequest.client_index`), `EngineStats` to all
of them; Ready / StartupFailed / CoreDied go to the launcher's own pipe (and CoreDied to every API
process too). The core remembers which process owns each live request id, so an abort from another
process (whose duplicate id the core rejected) cannot abort the owner's request.

`Outputs` carries each request's delta as a plain tuple (`wire_output`), not a pickled `RequestOutput`:
every streamed token crosses this pipe, and unpickling dataclasses (plus the prompt's token ids, resent
with every delta) cost the API process ~2.4 us per output against ~0.25 us for the tuple. The API side
already knows each request's prompt; `AsyncEngine` rebuilds `RequestOutput`s from the tuples.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from pagoda.config import EngineConfig
from pagoda.outputs import CompletionOutput, EngineStats, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.serving_gc import prepare_gc_for_serving

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
    client_index: int = 0          # which API process sent it (several API processes only)
    # False: the API process turns this request's tokens into text itself, so its outputs carry
    # token ids and empty text (the core still detokenizes any request with stop strings: it must
    # see the text to stop). Detokenizing every stream cost the core ~1 ms of its ~3.3 ms host work per
    # step at 256 streams (benchmarks/host_overhead.py).
    detokenize: bool = True


@dataclass
class AbortRequests:
    request_ids: list[str]
    client_index: int = 0


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
    # AddRequests taken from this API process so far, counted into `stats`: the API side counts the
    # ones it sent beyond this as waiting (`--max-waiting-requests` holds against a burst sent while
    # the core was in a long step; `AsyncEngine.num_unreported`).
    received: int = 0


@dataclass
class CoreDied:
    message: str


def run_engine_core(config: EngineConfig, input_address: str, output_address: str,
                    client_addresses: list[str] | None = None) -> None:
    """Process entry point (spawned). One API process: it bound both pipes, `output_address` carries
    everything. Several (`client_addresses`, one per API process): this process binds the input pipe,
    `output_address` is the launcher's (Ready / StartupFailed / CoreDied) and outputs go to
    `client_addresses[AddRequest.client_index]`."""
    import os
    import signal

    import zmq

    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.errors import PagodaError

    # Ctrl-C reaches the whole process group: the API process drains in-flight requests and then
    # sends Shutdown, so the core must not die on the same SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if client_addresses is not None:
        # Likewise SIGTERM sent to the whole group or cgroup (`timeout`, systemd): the launcher stops
        # the API processes first and then this one (SIGKILL if it must).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(output_address)
    clients = []
    if client_addresses is None:
        inbox.connect(input_address)
    else:
        inbox.bind(input_address)
        for address in client_addresses:     # connected before the API processes bind: messages queue
            clients.append(ctx.socket(zmq.PUSH))
            clients[-1].connect(address)
    try:
        engine = LLMEngine(config)
    except PagodaError as exc:
        outbox.send_pyobj(StartupFailed(exc.message))
        return
    except Exception as exc:  # noqa: BLE001 - a bug or a broken environment: still say why in one line
        outbox.send_pyobj(StartupFailed(f"{type(exc).__name__}: {exc}"))
        return
    layout = engine.kv_layout
    prepare_gc_for_serving()         # no full GC pass over the startup heap mid-serving (a ~0.2 s stall)
    outbox.send_pyobj(Ready(layout.num_blocks - 1, layout.block_size,
                            layout.max_concurrency(config.model.max_model_len)))
    try:
        if clients:
            _loop_clients(engine, inbox, clients, parent)
        else:
            _loop(engine, inbox, outbox, parent)
    except Exception:
        died = CoreDied(traceback.format_exc(limit=8))
        for box in [outbox, *clients]:
            box.send_pyobj(died)
        raise
    finally:
        for box in [outbox, *clients]:
            box.close(linger=1000)
        inbox.close(linger=0)


def _receive(engine, inbox, parent: int) -> list | None:
    """The messages that arrived since the last step, in order: blocks (1 s at a time) while the
    engine is idle, only drains while it has work. None: stop (a Shutdown, or the parent is gone —
    killed without a Shutdown — so do not linger as an orphan)."""
    import os

    timeout = 0 if engine.has_unfinished_requests() else 1000
    if timeout and os.getppid() != parent:
        return None
    messages = []
    while inbox.poll(timeout):
        timeout = 0
        message = inbox.recv_pyobj()
        if isinstance(message, Shutdown):
            return None
        messages.append(message)
    return messages


def _add(engine, message: AddRequest) -> str | None:
    """Queue the request; the refusal's message if the engine refuses it."""
    from pagoda.errors import PagodaError

    try:
        engine.add_request(message.request_id, message.prompt_token_ids, message.params, prompt=message.prompt,
                           delta=message.delta, arrival_time=message.arrival_time, mm_inputs=message.mm_inputs,
                           detokenize=message.detokenize)
    except PagodaError as exc:
        return exc.message
    except Exception as exc:  # noqa: BLE001 - a bug reached by this request must not end the core
        logger.exception("Request %s could not be added", message.request_id)
        return f"Internal error while adding the request: {type(exc).__name__}."
    return None


def _loop(engine, inbox, outbox, parent: int) -> None:
    last_stats: EngineStats | None = None
    busy = cpu = 0.0
    received = reported = 0
    while (messages := _receive(engine, inbox, parent)) is not None:
        started, started_cpu = time.perf_counter(), time.thread_time()
        outputs: list[RequestOutput] = []
        rejected: dict[str, str] = {}
        for message in messages:
            if isinstance(message, AbortRequests):
                outputs += engine.abort_request(message.request_ids)
            elif isinstance(message, AddRequest):
                received += 1
                if (refused := _add(engine, message)) is not None:
                    rejected[message.request_id] = refused
        if engine.has_unfinished_requests():
            outputs += engine.step()
        # Report outputs, and also any change of state without outputs (a prefill chunk, a request
        # admitted): the gauges stay current. Nothing is sent while nothing changes.
        stats = engine.stats()
        stats.busy_seconds, stats.cpu_seconds = busy, cpu
        if outputs or rejected or received != reported or _changed(stats, last_stats):
            outbox.send_pyobj(Outputs([wire_output(out) for out in outputs], stats, rejected, received))
            reported = received
        last_stats = stats
        busy += time.perf_counter() - started
        cpu += time.thread_time() - started_cpu


def _loop_clients(engine, inbox, clients: list, parent: int) -> None:
    """`_loop` for several API processes: each output goes to the process that owns its request,
    the stats to every process whenever they change (the first process also counts the engine's
    running totals into its metrics, so they must reach it every time they move)."""
    owners: dict[str, int] = {}            # live request id → index of the API process that sent it
    count = len(clients)
    last_stats: EngineStats | None = None
    busy = cpu = 0.0
    received, reported = [0] * count, [0] * count     # AddRequests per API process: taken, last reported
    while (messages := _receive(engine, inbox, parent)) is not None:
        started, started_cpu = time.perf_counter(), time.thread_time()
        outputs: list[RequestOutput] = []
        rejected: list[dict[str, str]] = [{} for _ in range(count)]
        for message in messages:
            if isinstance(message, AbortRequests):
                # Only the owner may abort: another process's request with the same (rejected) id
                # sends an abort from its cleanup too.
                ids = [rid for rid in message.request_ids if owners.get(rid) == message.client_index]
                if ids:
                    outputs += engine.abort_request(ids)
            elif isinstance(message, AddRequest):
                received[message.client_index] += 1
                refused = _add(engine, message)
                if refused is not None:
                    rejected[message.client_index][message.request_id] = refused
                else:
                    owners[message.request_id] = message.client_index
        if engine.has_unfinished_requests():
            outputs += engine.step()
        per_client: list[list[WireOutput]] = [[] for _ in range(count)]
        for out in outputs:
            owner = owners.pop(out.request_id, None) if out.finished else owners.get(out.request_id)
            if owner is not None:
                per_client[owner].append(wire_output(out))
        stats = engine.stats()
        stats.busy_seconds, stats.cpu_seconds = busy, cpu
        changed = _totals_changed(stats, last_stats)
        for index, box in enumerate(clients):
            if per_client[index] or rejected[index] or changed or received[index] != reported[index]:
                box.send_pyobj(Outputs(per_client[index], stats, rejected[index], received[index]))
                reported[index] = received[index]
        last_stats = stats
        busy += time.perf_counter() - started
        cpu += time.thread_time() - started_cpu


def _totals_changed(stats: EngineStats, last: EngineStats | None) -> bool:
    # num_steps: the core's clock totals (busy, device wait) move with every step and process 0 counts them.
    return _changed(stats, last) or (stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits,
                                     stats.num_steps) != (last.num_preemptions, last.prefix_cache_queries,
                                                          last.prefix_cache_hits, last.num_steps)


def _changed(stats: EngineStats, last: EngineStats | None) -> bool:
    if last is None:
        return True
    return (stats.num_running, stats.num_waiting, stats.kv_cache_usage) != (
        last.num_running, last.num_waiting, last.kv_cache_usage)
